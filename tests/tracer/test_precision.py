"""The mixed-precision pass (autopar.tracer.precision): what the rewritten graph computes in."""

import pytest
import torch
from torch import nn

from autopar import zoo
from autopar.tracer import profile, trace
from autopar.tracer.meta_keys import PARAM_CAST_KEY
from autopar.tracer.precision import FP32_OPS, apply_precision

from tests.tracer.conftest import FAMILIES, traced_tiny

aten = torch.ops.aten

_LOW: dict = {}


def traced_low(name: str, precision: str):
    if (name, precision) not in _LOW:
        model, inputs, _ = traced_tiny(name)
        _LOW[name, precision] = trace(model, inputs, name=name, precision=precision)
    return _LOW[name, precision]


def _loss(traced, values):
    return values[traced.flat_outputs.index(traced.loss_node)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_computes_in_low_precision_with_fp32_masters(name, precision):
    model, inputs, traced = traced_tiny(name)
    low = traced_low(name, precision)  # the module's other tests read these traces too (running them changes nothing)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert low.precision == precision and traced.precision == "fp32"
    # Masters stay fp32: the placeholders are the same, and each cast weight has ONE cast.
    assert [(p.fqn, p.dtype) for p in low.placeholders] == [(p.fqn, p.dtype) for p in traced.placeholders]
    casts = [n for n in low.gm.graph.nodes if PARAM_CAST_KEY in n.meta]
    assert len({n.meta[PARAM_CAST_KEY] for n in casts}) == len(casts) > 0
    assert all(n.meta["val"].dtype == dtype and n.args[0].op == "placeholder" for n in casts)
    # Matmuls and convolutions compute in the low dtype; the loss comes out in fp32.
    heavy = [n for n in low.compute_nodes() if isinstance(n.target, torch._ops.OpOverload) and
             n.target.overloadpacket.__name__ in ("addmm", "mm", "bmm", "linear", "matmul", "convolution",
                                                  "conv2d", "scaled_dot_product_attention")]
    assert heavy and all(n.meta["val"].dtype == dtype for n in heavy), [(n.name, n.meta["val"].dtype) for n in heavy]
    assert low.loss_node.meta["val"].dtype == torch.float32
    assert low.graph_hash != traced.graph_hash
    # It runs, and the loss is the fp32 loss to low-precision accuracy.
    want = _loss(traced, traced.gm(*traced.bind(model, inputs)))
    got = _loss(low, low.gm(*low.bind(model, inputs)))
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=0.01), (got, want)
    got.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)
    model.zero_grad(set_to_none=True)


def test_casts_sit_before_the_first_use_not_among_the_placeholders():
    low = traced_low("gpt2", "bf16")
    nodes = list(low.gm.graph.nodes)
    first_op = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    assert all(n.op == "placeholder" for n in nodes[:first_op]) and \
        all(n.op != "placeholder" for n in nodes[first_op:])
    for cast in (n for n in nodes if PARAM_CAST_KEY in n.meta):
        users = list(cast.users)
        assert nodes.index(cast) < min(nodes.index(u) for u in users)
        # owned by the parameter's module (the repeated-block analysis groups by module path)
        assert low.node(cast.meta[PARAM_CAST_KEY]).meta["autopar_placeholder"].fqn.startswith(
            cast.meta["autopar_module"])


def test_fp32_ops_compute_in_fp32_and_noop_casts_follow_their_input():
    low = traced_low("gpt2", "bf16")
    ops = {n.target for n in low.compute_nodes()}
    assert aten._assert_tensor_metadata.default not in ops
    for n in low.compute_nodes():
        if isinstance(n.target, torch._ops.OpOverload) and n.target.overloadpacket in FP32_OPS:
            floats = [a.meta["val"] for a in n.all_input_nodes if a.meta["val"].dtype.is_floating_point]
            assert all(v.dtype == torch.float32 for v in floats), n.name
    # GPT-2's position embedding goes through ``.to(inputs_embeds.dtype)`` (a no-op in the fp32
    # trace): the residual stream stays bf16 instead of being forced back to fp32.
    adds = [n for n in low.compute_nodes() if n.target == aten.add.Tensor and n.meta["val"].dim() == 3]
    assert adds and all(n.meta["val"].dtype == torch.bfloat16 for n in adds)


def test_batch_norm_keeps_fp32_weights_and_statistics():
    low = traced_low("resnet50", "bf16")
    norms = [n for n in low.compute_nodes() if n.target == aten.batch_norm.default]
    assert norms
    for n in norms:
        x, weight, bias, mean, var = n.args[:5]
        assert x.meta["val"].dtype == torch.bfloat16 and n.meta["val"].dtype == torch.bfloat16
        assert all(a.op == "placeholder" and a.meta["val"].dtype == torch.float32 for a in (weight, bias, mean, var))


def test_mixed_inputs_are_cast_down_saturating():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, mask):
            scores = self.proj(x)
            bias = (1.0 - mask.to(torch.float32)) * torch.finfo(torch.float32).min
            return torch.softmax(scores + bias, dim=-1).sum()

    model = Masked()
    x, mask = torch.randn(2, 8), torch.ones(2, 8, dtype=torch.long)
    mask[1, 3:] = 0
    low = trace(model, {"x": x, "mask": mask}, precision="fp16")
    add = next(n for n in low.compute_nodes() if n.target == aten.add.Tensor)
    assert add.meta["val"].dtype == torch.float16
    clamp = next(n for n in low.compute_nodes() if n.target == aten.clamp.default)
    assert clamp.args[1:] == (torch.finfo(torch.float16).min, torch.finfo(torch.float16).max)
    (out,) = low.gm(*low.bind(model, {"x": x, "mask": mask}))
    assert torch.isfinite(out) and torch.allclose(out.float(), torch.tensor(2.0), rtol=1e-2)


def test_activation_bytes_about_halve_for_gpt2():
    """The profile (and so the planner) sees what runs: saved activations at 2 bytes."""
    model, inputs = zoo.build("gpt2", tiny=True, batch=8, seq=128, device="cpu")
    full = profile(trace(model, inputs)).activation_bytes
    half = profile(trace(model, inputs, precision="bf16")).activation_bytes
    assert 0.45 < half / full < 0.6, half / full


def test_bad_precision_and_second_rewrite_are_errors():
    model, inputs, _ = traced_tiny("mlp")
    with pytest.raises(ValueError, match="precision must be one of"):
        trace(model, inputs, precision="int8")
    low = trace(model, inputs, precision="bf16")
    assert apply_precision(low, "bf16") is low  # idempotent
    with pytest.raises(ValueError, match="already rewritten for bf16"):
        apply_precision(low, "fp16")


def test_explicit_upcasts_keep_their_fp32_region_and_come_back_down():
    """Llama's RMSNorm: ``h.to(float32)`` ... ``weight * h.to(input_dtype)`` -- both no-ops in the
    fp32 trace. The first meets a 2-byte value (kept: variance and rsqrt in fp32, which fp16
    needs: rsqrt's gradient of a 1e-3 variance overflows 65504), the second a value of that
    region (back to the compute dtype). The rotary tables come from fp32 buffers and stay fp32
    until they meet 2-byte queries."""
    model, inputs, traced = traced_tiny("llama-1b")
    low = traced_low("llama-1b", "fp16")
    ops = list(low.compute_nodes())
    rsqrt = [n for n in ops if n.target == aten.rsqrt.default]
    assert rsqrt and all(n.meta["val"].dtype == torch.float32 for n in rsqrt)
    for n in rsqrt:
        (var,) = (a for a in n.all_input_nodes)
        assert all(a.meta["val"].dtype == torch.float32 for a in var.all_input_nodes)
    linears = [n for n in ops if n.target == aten.linear.default]
    assert linears and all(n.meta["val"].dtype == torch.float16 for n in linears)
    loss = _loss(low, low.gm(*low.bind(model, inputs)))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)


def test_per_module_casts_give_a_tied_weight_one_cast_per_reader():
    """``param_casts="per_module"`` (how pipelines trace): GPT-2's tied ``wte``, read by the
    embedding and the LM head, gets two casts, each before its own reader; every other weight
    keeps one; the graph computes the same values as with one shared cast."""
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, num_layers=2, batch=2, device="cpu")
    graphs = {c: trace(model, inputs, precision="bf16", param_casts=c) for c in ("shared", "per_module")}
    for casts, traced in graphs.items():
        counts = {p.fqn: sum(1 for u in traced.node(p.name).users if u.meta.get(PARAM_CAST_KEY) == p.name)
                  for p in traced.placeholders if p.kind == "parameter"}
        want_wte = 2 if casts == "per_module" else 1
        assert counts.pop("transformer.wte.weight") == want_wte, casts
        assert set(counts.values()) <= {0, 1}, (casts, counts)
    wte = next(p.name for p in graphs["per_module"].placeholders if p.fqn == "transformer.wte.weight")
    readers = [{u.meta.get("autopar_module") or "" for u in cast.users}
               for cast in graphs["per_module"].node(wte).users]
    assert len(readers) == 2 and all(len(r) == 1 for r in readers) and readers[0] != readers[1]
    losses, grads = {}, {}
    for c, g in graphs.items():
        losses[c] = _loss(g, g.gm(*g.bind(model, inputs)))
        losses[c].backward()
        grads[c] = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    assert torch.equal(losses["shared"], losses["per_module"])
    for k, want in grads["shared"].items():
        if k != "transformer.wte.weight":
            assert torch.equal(grads["per_module"][k], want), k
    # The tied gradient's two halves are summed in fp32 (after each cast's backward), not in bf16
    # before one: equal to bf16 rounding.
    torch.testing.assert_close(grads["per_module"]["transformer.wte.weight"], grads["shared"]["transformer.wte.weight"],
                               rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match="param_casts must be 'shared' or 'per_module', got 'each'"):
        trace(model, inputs, precision="bf16", param_casts="each")
