"""coverage(): distinct ops with counts, and the printable table."""

from autopar.tracer import coverage
from autopar.tracer.coverage import format_coverage


def test_coverage_counts_every_op(tiny):
    model, inputs, traced = tiny("gpt2")
    table = coverage(traced)
    assert sum(row.count for row in table) == sum(1 for _ in traced.compute_nodes())
    assert len({row.op for row in table}) == len(table)
    counts = {row.op: row.count for row in table}
    layers = model.config.n_layer
    assert counts["aten.scaled_dot_product_attention.default"] == layers
    assert counts["aten.layer_norm.default"] == 2 * layers + 1
    assert counts["aten.addmm.default"] == 4 * layers  # c_attn, c_proj, c_fc, mlp.c_proj
    assert counts["aten.cross_entropy_loss.default"] == 1
    assert [row.count for row in table] == sorted((row.count for row in table), reverse=True)
    sdpa = next(r for r in table if r.op == "aten.scaled_dot_product_attention.default")
    assert sdpa.first_module == "transformer.h.0.attn"


def test_format_coverage_marks_missing_rules(tiny):
    _, _, traced = tiny("mlp")
    table = coverage(traced)
    text = format_coverage(table, has_rule=lambda op: "linear" in op)
    assert "aten.linear.default" in text and "MISSING" in text and "yes" in text
    assert text.splitlines()[-1] == f"{len(table)} distinct ops, {sum(r.count for r in table)} op nodes"
