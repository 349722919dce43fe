"""``PlanOptions.sequence_parallel`` / ``sp_size``: pinning sequence-split attention (``autopar.planner.pins``).

HF Llama (tiny, sequence 64) planned with the ring pinned splits every attention on the sequence
and keeps the layer around it sequence-split (Megatron's sequence parallelism: norms, rotary,
MLP); Ulysses splits the heads inside with sequence-split inputs; ``split_gather`` splits every
norm on the sequence; ``off`` keeps the sequence whole where ``auto`` rings; ``sp_size`` picks the
innermost axes multiplying to it; ``ep_size`` is a pin of the same filter. A model the pin cannot
apply to is refused with a message naming the option, the node and its module. (The numerics of
these plans on gloo: ``tests/runtime/test_sequence_parallel.py``,
``tests/booster/test_hybrid_sequence.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import zoo
from autopar.api import PlanOptions, plan_traced
from autopar.layout.mesh import MeshSpec
from autopar.planner.pins import pins_of
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from tests.runtime.test_e2e import fast_mesh


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model, inputs = zoo.build("llama-1b", tiny=True, seq=64, device="meta")
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    return traced, profile(traced)


def _ops(plan, module: str) -> dict[str, str]:
    return {n.name: n.strategy for n in plan.by_kind("op") if n.module == module}


def test_ring_pins_every_attention_and_the_layer_stays_sequence_split(llama):
    traced, prof = llama
    plan = plan_traced(traced, prof, mesh=fast_mesh((4,)), options=PlanOptions(sequence_parallel="ring")).plan
    attention = [n.strategy for n in plan.by_kind("op") if n.name.startswith("scaled_dot_product_attention")]
    assert len(attention) == 2 and all(s == "S2 x S2 x S2 x S2 -> S2" for s in attention), attention
    # (B, L, hidden) values split on L (dim 1): the norms and the MLP around the attention.
    for module in ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                   "model.layers.0.mlp"):
        outputs = {s.split(" -> ")[1] for s in _ops(plan, module).values()}
        assert outputs == {"S1"}, (module, _ops(plan, module))


def test_all_to_all_splits_heads_inside_with_sequence_split_inputs(llama):
    traced, prof = llama
    plan = plan_traced(traced, prof, mesh=fast_mesh((2, 2)),
                       options=PlanOptions(sequence_parallel="all_to_all")).plan
    by_name = {n.name: n for n in plan.by_kind("op")}
    pins = _pins(traced, (2, 2), sequence_parallel="all_to_all").pins
    attention = [name for name in pins if name.startswith("scaled_dot_product_attention")]
    assert len(attention) == 2
    for name in attention:
        assert by_name[name].strategy.split(" x ")[0].endswith("S1"), by_name[name].strategy  # heads, axis 1
    producers = [name for name in pins if name not in attention]
    assert len(producers) == 6  # query, key and value of each attention
    for name in producers:
        assert by_name[name].strategy.split(" -> ")[1].endswith("S2"), by_name[name].strategy  # sequence, axis 1


def _pins(traced, shape, **options):
    return pins_of(traced, PlanOptions(**options), MeshSpec.preset("cpu", shape))


def test_auto_and_a_single_device_pin_nothing(llama):
    traced, _ = llama
    assert _pins(traced, (4,), sequence_parallel="auto") is None
    assert _pins(traced, (1,), sequence_parallel="ring") is None


class Attention(nn.Module):
    def __init__(self, dropout: float = 0.0, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.dropout, self.heads = nn.Linear(16, 48), dropout, heads

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return out.transpose(1, 2).flatten(2).sum()


class Inputs(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v).sum()


def _plan_inputs(model, **options):
    qkv = tuple(torch.empty(4, 4, 8, 4, device="meta", requires_grad=True) for _ in range(3))
    traced = trace(model, qkv, decompose_if=needs_decomposition)
    return plan_traced(traced, profile(traced), mesh=MeshSpec.preset("cpu", (4,)), options=PlanOptions(**options))


def _plan(model, seq: int, *, batch: int = 4, mesh: MeshSpec = MeshSpec.preset("cpu", (4,)), **options):
    x = torch.empty(batch, seq, 16, device="meta")
    traced = trace(model, (x,), decompose_if=needs_decomposition)
    return plan_traced(traced, profile(traced), mesh=mesh, options=PlanOptions(**options))


def test_refusals_name_the_option_and_the_node():
    with pytest.raises(ValueError, match="sequence_parallel='ring'.*has no scaled_dot_product_attention"):
        _plan(nn.Sequential(nn.Linear(16, 16)), 8, sequence_parallel="ring")
    with pytest.raises(ValueError, match="node 'scaled_dot_product_attention'.*ring attention is not offered with "
                                         "attention dropout"):
        _plan(Attention(dropout=0.1), 8, sequence_parallel="ring")
    with pytest.raises(ValueError, match="ring'.*the query's sequence \\(dim 2, size 6\\) does not split evenly "
                                         "over mesh axes \\(0,\\) of size 4"):
        _plan(Attention(), 6, sequence_parallel="ring")
    with pytest.raises(ValueError, match="all_to_all'.*the query's heads \\(dim 1, size 2\\)"):
        _plan(Attention(), 8, sequence_parallel="all_to_all")
    with pytest.raises(ValueError, match="all_to_all'.*the query comes from placeholder"):
        _plan_inputs(Inputs(), sequence_parallel="all_to_all")  # an input's layout is no op's choice
    with pytest.raises(ValueError, match="sequence_parallel='ring' is not pinned in pipeline stages"):
        PlanOptions(sequence_parallel="ring", pipeline=2)
    with pytest.raises(ValueError, match="sequence_parallel must be one of"):
        PlanOptions(sequence_parallel="ulysses")


def test_auto_reaches_the_ring_where_nothing_else_splits_causal_attention():
    # One sequence, one head: the batch and the heads cannot split; a causal attention's only
    # split is the ring, which the solver takes on its own on links this fast.
    plan = _plan(Attention(heads=1), 64, batch=1, mesh=fast_mesh((4,))).plan
    assert [n.strategy for n in plan.by_kind("op") if n.name.startswith("scaled")] == ["S2 x S2 x S2 -> S2"]


def test_off_keeps_the_sequence_whole_where_auto_takes_the_ring():
    # The model of the test above: auto rings it; "off" (the plan without context parallelism)
    # may not split the query or the output on the sequence over any axis.
    plan = _plan(Attention(heads=1), 64, batch=1, mesh=fast_mesh((4,)), sequence_parallel="off").plan
    [strategy] = [n.strategy for n in plan.by_kind("op") if n.name.startswith("scaled")]
    query, out = strategy.split(" x ")[0], strategy.split(" -> ")[1]
    assert "S2" not in query and "S2" not in out, strategy


def test_sp_size_picks_the_innermost_axes(llama):
    traced, prof = llama
    both = plan_traced(traced, prof, mesh=fast_mesh((2, 2)), options=PlanOptions(sequence_parallel="ring", sp_size=4))
    attention = [n.strategy for n in both.plan.by_kind("op") if n.name.startswith("scaled_dot_product_attention")]
    assert attention and all(s.split(" x ")[0] == "S2S2" for s in attention), attention
    pins = _pins(traced, (2, 2), sequence_parallel="ring", sp_size=2).pins
    assert {p.axes for p in pins.values()} == {(1,)}
    with pytest.raises(ValueError, match="sp_size=3: the innermost axes of mesh \\(2, 2\\)"):
        _pins(traced, (2, 2), sequence_parallel="ring", sp_size=3)
    with pytest.raises(ValueError, match="sp_size=2 pins the degree.*sequence_parallel='auto'"):
        PlanOptions(sp_size=2)
    with pytest.raises(ValueError, match="sp_size must be"):
        PlanOptions(sequence_parallel="ring", sp_size=0)


def test_split_gather_splits_every_norm_on_the_sequence(llama):
    traced, prof = llama
    plan = plan_traced(traced, prof, mesh=fast_mesh((4,)), options=PlanOptions(sequence_parallel="split_gather")).plan
    norms = [n for n in plan.by_kind("op") if n.module.endswith("norm") and n.output_specs[0] != "R"]
    assert len({n.module for n in norms}) == 5, norms  # two per layer and the final one
    assert all(n.output_specs[0] == "S1" for n in norms), [(n.name, n.strategy) for n in norms]
    with pytest.raises(ValueError, match="split_gather'.*has no normalization module"):
        _plan(Attention(), 8, sequence_parallel="split_gather")


def test_ep_size_is_the_same_filter():
    # The experts op of a MoE model gets an ``experts`` pin of the asked degree (numerics: tests/runtime/
    # test_expert_parallel.py); a degree no axes multiply to is refused naming ep_size.
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    ids = torch.zeros(4, 8, dtype=torch.long, device="meta")
    traced = trace(model, {"input_ids": ids, "labels": ids}, decompose_if=needs_decomposition)
    pins = _pins(traced, (2, 2), ep_size=4).pins
    assert [(p.kind, p.degree) for p in pins.values()] == [("experts", 4)]
    with pytest.raises(ValueError, match="ep_size=3"):
        _pins(traced, (2, 2), ep_size=3)
