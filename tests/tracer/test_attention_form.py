"""tracer.attention_form: which traced attention the runtime runs causal (and grouped), and the
profile pricing it so."""

import torch
import torch.nn.functional as F
from torch import nn

from autopar.tracer import profile, trace
from autopar.tracer.attention_form import causal_attention

B, H, KV, S, D = 2, 4, 2, 8, 16


class Grouped(nn.Module):
    """Grouped-query attention as HF traces it: a float causal mask built from ``arange``s
    (``mask_from_input``: AND-ed with an input padding mask) and ``repeat_kv``'s copies."""

    def __init__(self, mask_from_input: bool) -> None:
        super().__init__()
        self.q = nn.Linear(D, H * D)
        self.kv = nn.Linear(D, 2 * KV * D)
        self.mask_from_input = mask_from_input

    def forward(self, x, keep):
        q = self.q(x).view(B, S, H, D).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, KV, D).permute(2, 0, 3, 1, 4).unbind(0)
        k, v = (t[:, :, None].expand(B, KV, H // KV, S, D).reshape(B, H, S, D) for t in (k, v))
        pos = torch.arange(S, device=x.device)
        allowed = pos[None, :] <= pos[:, None]
        if self.mask_from_input:
            allowed = allowed & keep[:, None, None, :]
        mask = torch.zeros(allowed.shape, device=x.device).masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def _traced(mask_from_input: bool):
    torch.manual_seed(0)
    model = Grouped(mask_from_input)
    inputs = {"x": torch.randn(B, S, D), "keep": torch.ones(B, S, dtype=torch.bool)}
    return trace(model, inputs, name="grouped")


def _attention(traced):
    return next(n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)


def test_a_constant_causal_mask_runs_causal_on_the_key_value_heads():
    traced = _traced(False)
    attn = _attention(traced)
    forms = causal_attention(traced.graph)
    assert set(forms) == {attn.name}
    # causal without the mask, grouped: key and value read repeat_kv's inputs, (B, KV, S, D) each
    form = forms[attn.name]
    assert form["attn_mask"] is None and form["is_causal"] and form["enable_gqa"]
    assert {k: tuple(form[k].meta["val"].shape) for k in ("key", "value")} == {
        "key": (B, KV, S, D), "value": (B, KV, S, D)}
    # The profile saves the query, the two (B, KV, S, D) heads, the output and the logsumexp:
    # no mask copy, no repeated heads.
    saved = profile(traced)[attn.name].saved_bytes
    assert saved == 4 * (2 * B * H * S * D + 2 * B * KV * S * D + B * H * S)


def test_a_mask_read_from_an_input_is_read_as_traced():
    traced = _traced(True)
    assert causal_attention(traced.graph) == {}
    attn = _attention(traced)
    # the repeated heads (B, H, S, D) are what the attention saves
    assert profile(traced)[attn.name].saved_bytes >= 4 * 4 * B * H * S * D


def test_the_runtime_folds_to_the_form_the_profile_prices():
    """One rewrite: ``runtime.fold`` on the traced graph runs the attention with the arguments
    ``causal_attention`` gave the profile (by the nodes' names), and the repeats are gone."""
    import copy

    from autopar.runtime.fold import fold_constants

    torch.manual_seed(0)
    model = Grouped(False)
    inputs = {"x": torch.randn(B, S, D), "keep": torch.ones(B, S, dtype=torch.bool)}
    traced = trace(model, inputs, name="grouped")
    form = causal_attention(traced.graph)[_attention(traced).name]
    ndim = {n.name: n.meta["val"].dim() for n in traced.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    gm = copy.deepcopy(traced.gm)
    fold_constants(gm, ndim_of=lambda node: ndim.get(node.name))
    ran = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert not ran.args

    def names(args):
        return {k: v.name if isinstance(v, torch.fx.Node) else v for k, v in args.items()}

    assert names(ran.kwargs) == names(form)
    assert not any(n.target is torch.ops.aten.expand.default for n in gm.graph.nodes)
    args = traced.bind(model, inputs)
    got, want = (torch.utils._pytree.tree_leaves(m(*args))[0] for m in (gm, traced.gm))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, model(**inputs), rtol=1e-5, atol=1e-5)
