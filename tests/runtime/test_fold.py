"""``runtime.fold.fold_constants``: nodes that read no input are computed once at build time;
random draws, writes, graph outputs and values over the size cap are still computed each step."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime import fold
from autopar.runtime.fold import fold_constants

aten = torch.ops.aten


def _module() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(aten.arange.default, (8,), {"dtype": torch.float32})
    scaled = g.call_function(aten.mul.Tensor, (ar, 2.0))
    mask = g.call_function(aten.le.Tensor, (g.call_function(aten.unsqueeze.default, (ar, 0)),
                                            g.call_function(aten.unsqueeze.default, (ar, 1))))
    noise = g.call_function(aten.rand.default, ([8],), {"dtype": torch.float32})  # a draw: every step anew
    out = g.call_function(aten.add.Tensor, (x, scaled))
    out = g.call_function(aten.add.Tensor, (out, noise))
    masked = g.call_function(aten.where.ScalarOther, (mask, x, 0.0))
    const_out = g.call_function(aten.ones.default, ([2],))  # returned to the caller: not kept
    g.output((out, masked, const_out))
    return fx.GraphModule(torch.nn.Module(), g)


def test_input_independent_nodes_fold_and_draws_outputs_stay():
    gm = _module()
    x = torch.randn(8, 8)
    torch.manual_seed(0)
    want = gm(x)
    values = fold_constants(gm)
    code = gm.code
    assert "arange" not in code and "aten.le" not in code and "aten.mul" not in code, code
    assert "aten.rand" in code and "aten.ones" in code, code
    assert sorted(values) == ["le_tensor", "mul_tensor"]
    assert "_autopar_folded" not in dict(gm.named_buffers()) and not gm.state_dict()
    torch.manual_seed(0)
    got = gm(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not torch.equal(gm(x)[0], got[0])  # the draw is still drawn each call


def test_values_over_the_cap_are_computed_each_step(monkeypatch):
    monkeypatch.setattr(fold, "FOLD_MAX_BYTES", 16)  # the (8, 8) mask is over it, arange (32 bytes) too
    gm = _module()
    fold_constants(gm)
    assert "aten.le" in gm.code and "aten.arange" in gm.code
    x = torch.randn(8, 8)
    torch.manual_seed(0)
    got = gm(x)
    assert torch.equal(got[1], torch.where(torch.arange(8.0)[None] <= torch.arange(8.0)[:, None], x, 0.0))


def _attention(offset: int) -> fx.GraphModule:
    """sdpa with a mask from ``arange``: key j visible from query i when ``j <= i + offset``."""
    g = fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    rows = g.call_function(aten.unsqueeze.default, (g.call_function(aten.arange.default, (6,)), 1))
    cols = g.call_function(aten.unsqueeze.default, (g.call_function(aten.arange.default, (6,)), 0))
    mask = g.call_function(aten.le.Tensor, (cols, g.call_function(aten.add.Tensor, (rows, offset))))
    mask = g.call_function(aten.expand.default, (mask, [2, 1, 6, 6]))
    g.output(g.call_function(aten.scaled_dot_product_attention.default, (q, k, v, mask), {"scale": 0.5}))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_folded_causal_mask_becomes_is_causal_other_masks_stay():
    q, k, v = (torch.randn(2, 3, 6, 4) for _ in range(3))
    for offset, causal in ((0, True), (1, False), (-1, False)):
        gm = _attention(offset)
        want = gm(q, k, v)
        values = fold_constants(gm)
        assert ("is_causal = True" in gm.code) == causal, gm.code
        assert (values == {}) == causal  # the causal mask is no longer kept at all
        torch.testing.assert_close(gm(q, k, v), want)


def _grouped_attention(offset: int, ndim: int = 4) -> fx.GraphModule:
    """transformers' ``repeat_kv`` (2 key/value heads to 4) in front of a masked sdpa (``_attention``'s mask)."""
    g = fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    rows = g.call_function(aten.unsqueeze.default, (g.call_function(aten.arange.default, (6,)), 1))
    cols = g.call_function(aten.unsqueeze.default, (g.call_function(aten.arange.default, (6,)), 0))
    mask = g.call_function(aten.le.Tensor, (cols, g.call_function(aten.add.Tensor, (rows, offset))))

    def repeat(x):
        x = g.call_function(aten.unsqueeze.default, (x, 2))
        x = g.call_function(aten.expand.default, (x, [2, 2, 2, 6, 4]))
        return g.call_function(aten.reshape.default, (x, [2, 4, 6, 4]))

    g.output(g.call_function(aten.scaled_dot_product_attention.default, (q, repeat(k), repeat(v), mask),
                             {"scale": 0.5}))
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in g.nodes:
        node.meta["ndim"] = ndim if node.op == "placeholder" else None
    return gm


def test_grouped_attention_without_a_mask_reads_its_key_value_heads_once():
    q, k, v = torch.randn(2, 4, 6, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    ndim_of = lambda node: node.meta.get("ndim")  # noqa: E731 -- the traced ranks: placeholders only here
    for offset, causal in ((0, True), (1, False)):
        gm = _grouped_attention(offset)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want = gm(*leaves)
        want.sum().backward()
        fold_constants(gm, ndim_of=ndim_of)
        # Only once the mask is gone (causal), as transformers does eagerly: no repeated copies.
        assert ("enable_gqa = True" in gm.code) == causal and ("expand" in gm.code) != causal, gm.code
        got_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = gm(*got_leaves)
        got.sum().backward()
        torch.testing.assert_close(got, want)
        for a, b in zip(got_leaves, leaves):
            torch.testing.assert_close(a.grad, b.grad)
    # A rank it cannot confirm (or none given): the repeat stays.
    for gm, kwargs in ((_grouped_attention(0, ndim=3), {"ndim_of": ndim_of}), (_grouped_attention(0), {})):
        fold_constants(gm, **kwargs)
        assert "is_causal = True" in gm.code and "enable_gqa" not in gm.code and "expand" in gm.code, gm.code
