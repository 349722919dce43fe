"""``TorchDDPPlugin`` and ``TorchFSDPPlugin`` (issue 29 points 1-2).

- Signatures: every parameter of the product notes' constructors (their Booster API reference,
  transcribed below) accepted by name and position with its documented default; ignored ones log
  one line; unsupported semantics raise NotImplementedError.
- Training on 4 gloo ranks: GPT-2 tiny and Llama tiny (FSDP's under full_sweep), 5 AdamW steps, clipping
  through ``Booster.boost`` / ``booster.backward`` / ``optimizer.step``; every step's loss (the
  mean of the ranks' losses over their quarter of the batch) and the final parameters equal
  single-device training on the whole batch (fp32, rtol 1e-4); then ``save_model`` /
  ``load_model`` of the full state dict and ``save_optimizer`` / ``load_optimizer`` round-trip
  into a fresh boosted model and optimizer.
"""

from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

from autopar import zoo
from autopar.booster import Booster, TorchDDPPlugin, TorchFSDPPlugin
from autopar.runtime.launch import run_local

# The notes' signatures (booster_api_reference.txt, "colossalai.booster.plugin.TorchDDPPlugin" and
# "...TorchFSDPPlugin"), in their positional order with their defaults.
DDP_PARAMS = {"broadcast_buffers": True, "bucket_cap_mb": 25, "find_unused_parameters": False,
              "check_reduction": False, "gradient_as_bucket_view": False, "static_graph": False}
FSDP_PARAMS = {"process_group": None, "sharding_strategy": None, "cpu_offload": None, "auto_wrap_policy": None,
               "backward_prefetch": None, "mixed_precision": None, "ignored_modules": None, "param_init_fn": None,
               "sync_module_states": False}
WORLD, STEPS, BATCH, SEQ, LR, MAX_NORM = 4, 5, 8, 16, 1e-3, 1.0
# Adam divides by sqrt(v) + eps: a gradient that is zero in exact arithmetic (attention's key bias:
# softmax ignores a shift) is float rounding, which a tiny eps would turn into lr-sized steps that
# differ with the summation order. eps=1e-6 keeps those steps below the parameters' atol.
EPS, PARAM_ATOL = 1e-6, 1e-5


@pytest.mark.parametrize("cls, params", [(TorchDDPPlugin, DDP_PARAMS), (TorchFSDPPlugin, FSDP_PARAMS)])
def test_signature_matches_the_notes(cls, params):
    sig = inspect.signature(cls)
    assert {k: p.default for k, p in sig.parameters.items()} == params
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
    cls(*params.values())  # by position
    cls(**params)  # by name


def test_ddp_arguments_reach_ddp_and_check_reduction_logs_once(caplog):
    plugin = TorchDDPPlugin(False, 10, True, False, True, False)
    assert plugin.ddp_kwargs == {"broadcast_buffers": False, "bucket_cap_mb": 10, "find_unused_parameters": True,
                                 "check_reduction": False, "gradient_as_bucket_view": True, "static_graph": False}
    with caplog.at_level(logging.INFO, logger="autopar.booster.torch_plugins"):
        TorchDDPPlugin(check_reduction=True)
    assert len(caplog.records) == 1 and "check_reduction is ignored" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        TorchDDPPlugin(bucket_cap_mb=0)


def test_training_batch_norm_is_named_as_per_rank_statistics(caplog):
    from autopar.booster.torch_plugins import _per_rank_statistics_notice

    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Sequential(nn.BatchNorm2d(4)))
    with caplog.at_level(logging.INFO, logger="autopar.booster.torch_plugins"):
        _per_rank_statistics_notice("TorchDDPPlugin", cnn)
        _per_rank_statistics_notice("TorchDDPPlugin", cnn.eval())  # eval: running statistics, as one device
        _per_rank_statistics_notice("TorchDDPPlugin", nn.Sequential(nn.SyncBatchNorm(4)).train())
    assert len(caplog.records) == 1
    said = caplog.records[0].getMessage()
    assert "TorchDDPPlugin: 1, 3.0 normalise each rank's share" in said and "differs from one device" in said
    assert "AutoParallelPlugin(batch_norm_stats='per_rank') trains with these per-rank statistics" in said


def test_fsdp_mapping_ignored_and_refused(caplog):
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = TorchFSDPPlugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, cpu_offload=CPUOffload(True),
                             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    kw = plugin.fsdp_kwargs
    assert kw["reshard_after_forward"] is False and isinstance(kw["offload_policy"], CPUOffloadPolicy)
    assert kw["mp_policy"].param_dtype is torch.bfloat16 and kw["mp_policy"].reduce_dtype is torch.float32
    assert TorchFSDPPlugin(sharding_strategy=ShardingStrategy.FULL_SHARD).fsdp_kwargs["reshard_after_forward"]
    with caplog.at_level(logging.INFO, logger="autopar.booster.torch_plugins"):
        TorchFSDPPlugin(backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    assert len(caplog.records) == 1 and "backward_prefetch=BACKWARD_POST is ignored" in caplog.records[0].getMessage()
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        with pytest.raises(NotImplementedError, match="sharding_strategy"):
            TorchFSDPPlugin(sharding_strategy=strategy)
    with pytest.raises(NotImplementedError, match="buffer_dtype"):
        TorchFSDPPlugin(mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="keep_low_precision_grads"):
        TorchFSDPPlugin(mixed_precision=MixedPrecision(keep_low_precision_grads=True))


# ------------------------------------------------------------------------------- training
def _batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
             "labels": torch.randint(0, vocab, (BATCH, SEQ), generator=gen)} for _ in range(STEPS)]


def _single_device(model, batches):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _make_plugin(kind: str, options: dict):
    return TorchDDPPlugin(**options) if kind == "ddp" else TorchFSDPPlugin(**options)


def _train(rank, world, model, fresh, batches, kind, options, path):
    torch.manual_seed(rank)  # the plugins, not the seed, must make the ranks agree
    booster = Booster(plugin=_make_plugin(kind, options))
    # The notes' loader: batch_size samples per data-parallel rank, rank r taking samples r::W
    # (so step j's pieces together are samples j*BATCH ... (j+1)*BATCH-1, the reference's batch j).
    dataset = [{k: v[i] for k, v in batch.items()} for batch in batches for i in range(BATCH)]
    loader = booster.plugin.prepare_dataloader(dataset, batch_size=BATCH // world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, _, loader, scheduler = booster.boost(model, optimizer, dataloader=loader, lr_scheduler=scheduler)
    if kind == "ddp":
        assert isinstance(model.engine, torch.nn.parallel.DistributedDataParallel)
    else:
        assert all(isinstance(p, DTensor) for p in model.parameters())
    losses = []
    for local in loader:
        assert len(local["input_ids"]) == BATCH // world
        out = model(**local)
        # FSDP2 computes in the policy's param_dtype (the logits show it), else in fp32
        assert out.logits.dtype == (torch.bfloat16 if "mixed_precision" in options else torch.float32)
        loss = out.loss
        booster.backward(loss, optimizer)
        optimizer.clip_grad_by_norm(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    state = model.full_state_dict()
    booster.save_model(model, path, shard=True, size_per_shard=0.05)
    other = Booster(plugin=_make_plugin(kind, options))
    booster.save_optimizer(optimizer, path + "-optim")
    reloaded, fresh_optimizer, *_ = other.boost(fresh, torch.optim.AdamW(fresh.parameters(), lr=LR, eps=EPS))
    other.load_model(reloaded, path)
    other.load_optimizer(fresh_optimizer, path + "-optim")
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and saved
    for key in saved:
        for name, value in saved[key].items():
            torch.testing.assert_close(loaded[key][name], value, rtol=0, atol=0)
    again = reloaded.full_state_dict()
    same = all(torch.equal(again[k], v) for k, v in state.items())
    # How many all-gather units FSDP2 made (the root, plus one per block an auto_wrap_policy took).
    units = sum(type(m).__name__.startswith("FSDP") for m in model.model.modules())
    assert kind != "fsdp" or units == 1 + ("auto_wrap_policy" in options) * model.model.config.num_hidden_layers
    return (losses, state, same) if rank == 0 else same


def _check(name: str, kind: str, options: dict, tmp_path, *, rtol: float = 1e-4) -> None:
    torch.manual_seed(0)
    model, inputs = zoo.build(name, tiny=True, device="cpu")
    torch.manual_seed(1)
    fresh, _ = zoo.build(name, tiny=True, device="cpu")
    vocab = model.config.vocab_size
    batches = _batches(vocab)
    ref_losses, ref_state = _single_device(model, batches)
    results = run_local(_train, WORLD, model, fresh, batches, kind, options, str(tmp_path / "ckpt"), timeout=240)
    losses, state, _ = results[0]
    assert all(r if isinstance(r, bool) else r[2] for r in results), "load_model did not restore the saved state"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=1e-6)
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        atol = PARAM_ATOL if rtol == 1e-4 else rtol  # bf16: the error is relative to the weights' scale
        torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_gpt2_tiny_equals_single_device(kind, tmp_path):
    _check("gpt2", kind, {}, tmp_path)


# Llama tiny under FSDP: with the whole sweeps; FSDP's 4-rank, 5-step equality with one device stays
# in test_gpt2_tiny_equals_single_device[fsdp].
@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp", marks=pytest.mark.full_sweep)])
def test_llama_tiny_equals_single_device(kind, tmp_path):
    _check("llama-8b", kind, {}, tmp_path)


def test_fsdp_knobs_keep_the_result(tmp_path):
    """SHARD_GRAD_OP, per-block wrapping by an FSDP1 policy, rank 0's state broadcast and CPU
    offload change where tensors live, never the numbers."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    _check("gpt2", "fsdp", {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "cpu_offload": CPUOffload(True),
                            "auto_wrap_policy": ModuleWrapPolicy({GPT2Block}), "sync_module_states": True}, tmp_path)


def test_fsdp_bf16_mixed_precision_tracks_fp32(tmp_path):
    """``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)`` -> FSDP2's policy: bf16 compute,
    fp32 master weights (the full state stays fp32), fp32 gradient reduction; bf16 rounding keeps
    the loss and the weights within 2e-2 of fp32 training over 5 steps."""
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _check("gpt2", "fsdp", {"mixed_precision": mp}, tmp_path, rtol=2e-2)


def test_fsdp_custom_policy_object_wraps_its_modules(tmp_path):
    """A non-callable FSDP1 policy object (``CustomPolicy``) chooses the wrapped blocks too."""
    from torch.distributed.fsdp.wrap import CustomPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    _check("gpt2", "fsdp", {"auto_wrap_policy": CustomPolicy(lambda m: isinstance(m, GPT2Block))}, tmp_path)


def test_ddp_knobs_keep_the_result(tmp_path):
    _check("gpt2", "ddp", {"bucket_cap_mb": 1, "gradient_as_bucket_view": True, "static_graph": True,
                           "broadcast_buffers": False}, tmp_path)


def _meta_model(rank, world, model, batch):
    """A model on ``meta`` materialised by ``param_init_fn`` (rank 0's weights reach every rank
    only through ``sync_module_states``), sharded over an explicit ``process_group``."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        meta = type(model)(model.config)

    def init(module):  # FSDP1's contract: materialise the meta tensors
        module.to_empty(device="cpu")
        with torch.no_grad():
            for key, value in module.state_dict().items():
                value.copy_(state[key] if rank == 0 else torch.zeros_like(value))

    plugin = TorchFSDPPlugin(dist.group.WORLD, param_init_fn=init, sync_module_states=True)
    boosted, *_ = Booster(plugin=plugin).boost(meta)
    assert boosted.device_mesh.size() == world
    full = boosted.full_state_dict()
    return {k: torch.equal(full[k], v) for k, v in state.items()}


def test_fsdp_param_init_fn_process_group_and_sync_module_states():
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu")
    results = run_local(_meta_model, 2, model, inputs, timeout=120)
    assert all(all(r.values()) for r in results), results


def _ignored_clip(rank, world, model, x):
    booster = Booster(plugin=TorchFSDPPlugin(ignored_modules=[model[1]]))
    module, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    booster.backward(module(x).sum(), optimizer)
    assert isinstance(module.model[0].weight, DTensor) and not isinstance(module.model[1].weight, DTensor)
    return optimizer.clip_grad_by_norm(1.0).item()


def test_fsdp_ignored_modules_stay_plain_and_clipping_counts_them():
    """``ignored_modules`` -> ``ignored_params``: those stay plain tensors next to the DTensors,
    and the one ``clip_grad_norm`` norms the mix (every rank sees the same batch here, so the
    norm is the single-device one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    x = torch.randn(3, 4)
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    for norm in run_local(_ignored_clip, 2, model, x, timeout=120):
        assert norm == pytest.approx(expected, rel=1e-5)


def _accumulate(rank, world, model, batch, kind):
    booster = Booster(plugin=_make_plugin(kind, {}))
    module, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    piece = BATCH // world
    local = {k: v[rank * piece:(rank + 1) * piece] for k, v in batch.items()}
    half = piece // 2
    with module.no_sync():  # the first micro-batch's gradients stay local ...
        booster.backward(module(**{k: v[:half] for k, v in local.items()}).loss / 2, optimizer)
    # ... and the second backward reduces the accumulated sum
    booster.backward(module(**{k: v[half:] for k, v in local.items()}).loss / 2, optimizer)
    optimizer.step()
    with pytest.raises(ValueError, match="execute_pipeline needs a model boosted with a pipeline"):
        booster.execute_pipeline(iter([batch]), module)  # no plan, so no pipeline: a clear refusal
    return module.full_state_dict()


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_no_sync_accumulation_equals_one_step(kind):
    """``TorchParallelModule.no_sync`` (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``):
    two accumulated half-batches on each of 2 ranks equal one SGD step on the whole batch."""
    torch.manual_seed(0)
    model, _ = zoo.build("gpt2", tiny=True, device="cpu")
    batch = _batches(model.config.vocab_size)[0]
    reference = copy.deepcopy(model)
    reference(**batch).loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    state = run_local(_accumulate, 2, model, batch, kind, timeout=120)[0]
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
