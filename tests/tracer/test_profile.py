"""profile(): FLOPs against closed forms and torch's counter, saved bytes against autograd."""

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from autopar.tracer import profile, trace

M, K, N, P, R = 8, 12, 16, 20, 6
B, C, OC, H, W = 2, 3, 4, 10, 10  # OC: output channels


class FlopNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(K, N)
        self.fc2 = nn.Linear(N, P, bias=False)
        self.w = nn.Parameter(torch.randn(P, R))
        self.w3 = nn.Parameter(torch.randn(2, R, P))
        self.conv = nn.Conv2d(C, OC, 3, padding=1)

    def forward(self, x, img):
        h = self.fc2(self.fc1(x))                    # addmm, then linear without bias
        y = torch.mm(h, self.w)                      # (M, R)
        z = torch.bmm(y.reshape(2, M // 2, R), self.w3)  # (2, M/2, P)
        c = self.conv(img)
        return z.sum() + c.sum()


def node_of(traced, module_path, op_fragment):
    matches = [n for n in traced.compute_nodes()
               if traced.module_path(n) == module_path and op_fragment in str(n.target)]
    assert len(matches) == 1, (module_path, op_fragment, matches)
    return matches[0].name


@pytest.fixture(scope="module")
def flopnet():
    torch.manual_seed(0)
    model = FlopNet()
    inputs = {"x": torch.randn(M, K), "img": torch.randn(B, C, H, W)}
    traced = trace(model, inputs)
    return model, inputs, traced, profile(traced)


def test_matmul_and_conv_flops_equal_closed_forms(flopnet):
    model, inputs, traced, prof = flopnet
    fc1 = prof[node_of(traced, "fc1", "linear")]
    fc2 = prof[node_of(traced, "fc2", "linear")]
    mm = prof[node_of(traced, "", "aten.mm")]
    bmm = prof[node_of(traced, "", "aten.bmm")]
    conv = prof[node_of(traced, "conv", "conv2d")]
    assert fc1.fwd_flops == 2 * M * K * N
    assert fc1.bwd_flops == 2 * M * K * N         # weight grad only: x is an input, no grad
    assert fc2.fwd_flops == 2 * M * N * P
    assert fc2.bwd_flops == 4 * M * N * P         # input grad + weight grad
    assert mm.fwd_flops == 2 * M * P * R and mm.bwd_flops == 4 * M * P * R
    assert bmm.fwd_flops == 2 * M * R * P and bmm.bwd_flops == 4 * M * R * P
    conv_flops = 2 * B * OC * H * W * C * 3 * 3
    assert conv.fwd_flops == conv_flops and conv.bwd_flops == conv_flops  # weight grad only
    assert prof.fwd_flops == sum(p.fwd_flops for p in prof.nodes)


def test_totals_equal_torch_flop_counter_on_a_real_run(flopnet):
    model, inputs, traced, prof = flopnet
    with FlopCounterMode(display=False) as counter:
        model(**inputs).backward()
    assert prof.total_flops == counter.get_total_flops()


def test_bytes(flopnet):
    model, inputs, traced, prof = flopnet
    fc1 = prof[node_of(traced, "fc1", "linear")]
    assert fc1.bytes_read == 4 * (M * K + K * N + N)
    assert fc1.bytes_written == fc1.output_bytes == 4 * M * N
    view = prof[node_of(traced, "", "reshape")]
    assert (view.bytes_read, view.bytes_written, view.output_bytes) == (0, 0, 4 * M * R)
    assert prof.param_bytes == 4 * sum(p.numel() for p in model.parameters())
    assert prof.input_bytes == 4 * (M * K + B * C * H * W)
    assert fc1.bwd_bytes >= 4 * (M * N + M * K + K * N)  # reads grad and x, writes weight grad
    assert fc1.saved_from == ("x",) and fc1.saved_bytes == 4 * M * K


def test_sdpa_flops_use_torch_formula(tiny):
    model, inputs, traced = tiny("gpt2")
    prof = profile(traced)
    attn = [p for p in prof.nodes if p.op == "aten.scaled_dot_product_attention.default"]
    batch, seq = inputs["input_ids"].shape
    heads, dim = model.config.n_head, model.config.n_embd // model.config.n_head
    assert len(attn) == model.config.n_layer
    for p in attn:
        assert p.fwd_flops == 4 * batch * heads * seq * seq * dim
        assert p.bwd_flops == 10 * batch * heads * seq * seq * dim  # 5 matmuls in backward
    lm_head = next(p for p in prof.nodes if p.module == "lm_head" and "linear" in p.op)
    assert lm_head.fwd_flops == 2 * batch * seq * model.config.n_embd * model.config.vocab_size


def saved_by_autograd(run, fixed_tensors):
    """Bytes autograd saves during ``run()``: unique storages, parameters/buffers excluded."""
    fixed = {StorageWeakRef(t.untyped_storage()) for t in fixed_tensors}
    seen = {}

    def pack(tensor):
        key = StorageWeakRef(tensor.untyped_storage())
        if key not in fixed:
            seen.setdefault(key, tensor)  # keep it alive so its storage id is not reused
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(t.untyped_storage().nbytes() for t in seen.values())


def _as_run(traced):
    """The traced graph as the runtime runs it: its constant mask folded, attention on that
    mask causal and grouped where it is (``runtime.fold``, as ``runtime.build`` applies it)."""
    import copy

    from autopar.runtime.fold import fold_constants

    ndim = {n.name: n.meta["val"].dim() for n in traced.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    gm = copy.deepcopy(traced.gm)
    fold_constants(gm, ndim_of=lambda node: ndim.get(node.name))
    return gm


def test_saved_bytes_match_autograd_on_the_graph(family):
    """What the traced graph saves when it really runs on CPU as autopar executes it (its
    constant mask folded: ``_as_run``)."""
    name, model, inputs, traced = family
    fixed = [*model.parameters(), *model.buffers()]
    gm = _as_run(traced)
    real = saved_by_autograd(lambda: gm(*traced.bind(model, inputs)), fixed)
    prof = profile(traced)
    assert prof.activation_bytes == pytest.approx(real, rel=0.01), name
    assert prof.activation_bytes == sum(p.saved_bytes for p in prof.nodes)


@pytest.mark.parametrize("name", ["mlp", "gpt2", "bert-base", "llama-1b", "vit-base", "resnet50"])
def test_saved_bytes_match_autograd_on_the_eager_model(tiny, name):
    """Within 5% of the unmodified model. (Llama too: under export HF materialises the causal
    mask and expands K/V for grouped-query attention, which its eager path does not; the
    runtime folds the mask and runs the attention causal on the K/V heads, and the profile
    prices that form: ``tracer.attention_form``.)"""
    model, inputs, traced = tiny(name)
    fixed = [*model.parameters(), *model.buffers()]
    real = saved_by_autograd(lambda: model(**inputs), fixed)
    assert profile(traced).activation_bytes == pytest.approx(real, rel=0.05)


def test_saved_bytes_are_attributed_to_the_saving_node(tiny):
    model, inputs, traced = tiny("mlp")
    prof = profile(traced)
    gelu = next(p for p in prof.nodes if p.op == "aten.gelu.default")
    producer = traced.node(gelu.name).args[0]
    assert gelu.saved_from == (producer.name,)  # GELU keeps its input for the backward
    assert gelu.saved_bytes == producer.meta["val"].numel() * 4
    first = prof[node_of(traced, "blocks.0.0", "linear")]
    assert first.saved_from == ("x",)  # the first linear keeps the user input x
    assert first.saved_bytes == inputs["x"].numel() * 4
    assert all(p.saved_bytes == 0 for p in prof.nodes if p.op == "aten.view.default")


class Attention(nn.Module):
    def __init__(self, dropout_p):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.dropout_p = dropout_p

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 4, 4).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p, is_causal=True).sum()


def test_attention_dropout_is_modelled_as_a_fused_kernel():
    """Dropout inside attention keeps no (seq x seq) probabilities, as on GPU flash kernels."""
    x = torch.empty(2, 8, 16, device="meta")
    plain = profile(trace(Attention(0.0).to("meta"), (x,)))
    dropped = profile(trace(Attention(0.1).to("meta"), (x,)))
    assert dropped.activation_bytes == plain.activation_bytes
    assert dropped.fwd_flops == plain.fwd_flops and dropped.bwd_flops == plain.bwd_flops


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.frozen(x))  # no loss: backward starts from the output


def test_frozen_parameters_and_models_without_loss():
    traced = trace(Frozen(), (torch.empty(2, 8, device="meta"),))
    assert traced.loss_node is None
    assert [p.requires_grad for p in traced.params] == [False, False, True, True]
    prof = profile(traced)
    frozen = prof[node_of(traced, "frozen", "linear")]
    head = prof[node_of(traced, "head", "linear")]
    assert frozen.fwd_flops == 2 * 2 * 8 * 8 and frozen.bwd_flops == 0 and frozen.saved_bytes == 0
    assert head.bwd_flops == 2 * 2 * 8 * 4  # weight grad only: its input needs no grad
