"""``HybridParallelPlugin`` (issue 29): the product notes' TP x PP x DP plugin as a restricted plan.

- Signature: every parameter of the notes' constructor (their Booster API reference, transcribed
  below) by name and by position with its documented default; ignored ones log one line,
  unsupported ones raise ``NotImplementedError`` naming them, bad values ``ValueError``.
- Bad sizes on 4 gloo ranks: ``tp_size`` not dividing the world, ``pp_size`` above the model's
  repeated blocks, ZeRO-2 with a pipeline, fp16 with offloaded ZeRO-2 gradients (which no scaler
  sees), a micro-batch size not dividing the batch -- a ``ValueError`` naming the argument and its
  value on every rank, before any collective (the launch would hang otherwise).
- Training on 4 gloo ranks (fp32, 5 AdamW steps, rtol 1e-4 against the single-device model on
  the whole batch): every gradient of the first step, the loss of every step and every parameter
  after the steps, for tp=2 x dp=2,
  tp=4, tp=2 x pp=2 with ZeRO-1, pp=2 x dp=2 with ZeRO-1 and an interleaved pp=2 x dp=2, on GPT-2 tiny, Llama
  tiny and a model outside the zoo; the boosted model's ``.plan`` has the asked mesh, its matrices
  split over the tp axis, its embeddings and cross entropy vocabulary-parallel.
- The notes' example block with only the import line changed and a tiny model: fp16 (their
  default) across pipeline stages tracks fp32 within 2e-2; an overflowing scale skips the step
  on every rank.
"""

from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch
from torch import nn

from autopar import zoo
from autopar.booster import AutoParallelPlugin, Booster, HybridParallelPlugin
from autopar.runtime.launch import run_local

REQUIRED = inspect.Parameter.empty
# The notes' signature (booster_api_reference.txt, "colossalai.booster.plugin.HybridParallelPlugin"),
# in its positional order with its defaults.
NOTES_PARAMS = {
    "tp_size": REQUIRED, "pp_size": REQUIRED, "precision": "fp16", "zero_stage": 0, "enable_all_optimization": False,
    "enable_fused_normalization": False, "enable_flash_attention": False, "enable_jit_fused": False,
    "enable_sequence_parallelism": False, "enable_sequence_overlap": False, "parallel_output": True,
    "num_microbatches": None, "microbatch_size": None, "initial_scale": 65536, "min_scale": 1, "growth_factor": 2,
    "backoff_factor": 0.5, "growth_interval": 1000, "hysteresis": 2, "max_scale": 4294967296, "max_norm": 0,
    "broadcast_buffers": True, "ddp_bucket_cap_mb": 25, "find_unused_parameters": False, "check_reduction": False,
    "gradient_as_bucket_view": False, "static_graph": False, "zero_bucket_size_in_m": 12, "cpu_offload": False,
    "communication_dtype": None, "overlap_communication": True, "custom_policy": None, "pp_style": "1f1b",
    "num_model_chunks": 1, "enable_metadata_cache": True,
}
WORLD, STEPS, BATCH, SEQ, LR, EPS = 4, 5, 8, 16, 1e-3, 1e-6
PARAM_ATOL = 1e-5


def test_signature_matches_the_notes():
    sig = inspect.signature(HybridParallelPlugin)  # (the later releases' keywords follow, keyword-only:
    notes = {k: p for k, p in sig.parameters.items() if p.kind is not p.KEYWORD_ONLY}  # test_hybrid_sequence)
    assert {k: p.default for k, p in notes.items()} == NOTES_PARAMS
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in notes.values())
    defaults = [v for v in NOTES_PARAMS.values()][2:]
    by_position = HybridParallelPlugin(2, 1, *defaults)
    by_name = HybridParallelPlugin(**{**NOTES_PARAMS, "tp_size": 2, "pp_size": 1})
    for plugin in (by_position, by_name):
        assert isinstance(plugin, AutoParallelPlugin)
        assert (plugin.tp_size, plugin.precision, plugin.zero_stage, plugin.pipeline) == (2, "fp16", 0, None)
        assert (plugin.initial_scale, plugin.growth_interval, plugin.max_norm) == (65536, 1000, 0)
    piped = HybridParallelPlugin(1, 2, "bf16", 1, num_microbatches=4, max_norm=1.0,
                                 communication_dtype=torch.bfloat16, pp_style="interleaved", num_model_chunks=2)
    assert (piped.pipeline, piped.schedule(), piped.num_microbatches, piped.zero_stage, piped.reduce_dtype) == \
        (2, "interleaved-1f1b", 4, 1, "bf16")


def test_layout_is_pp_dp_tp():
    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, precision="fp32", zero_stage=1)
    layout = plugin.layout(8)
    assert (layout.shape, layout.axis_names, layout.family, layout.pipeline) == ((2, 2, 2), ("pp", "dp", "tp"),
                                                                                 "dp x megatron", 2)
    assert HybridParallelPlugin(4, 1, zero_stage=2).layout(8).family == "zero2 x megatron"
    assert HybridParallelPlugin(4, 1).layout(4).shape == (4,)
    assert HybridParallelPlugin(1, 1, zero_stage=1).layout(4).family == "zero1"
    with pytest.raises(ValueError, match="tp_size=3"):
        HybridParallelPlugin(3, 1).layout(4)


def test_booster_mixed_precision_and_pickling_keep_the_arguments():
    """``Booster(mixed_precision=...)`` over a plugin left at fp32: the same plugin, that precision
    (not a TypeError from rebuilding it); a pickled plugin keeps its own arguments."""
    import pickle

    booster = Booster(plugin=HybridParallelPlugin(2, 1, precision="fp32", zero_stage=1), mixed_precision="bf16")
    assert (booster.plugin.precision, booster.plugin.tp_size, booster.plugin.zero_stage) == ("bf16", 2, 1)
    again = pickle.loads(pickle.dumps(HybridParallelPlugin(2, 2, "bf16", microbatch_size=2)))
    assert (again.tp_size, again.pipeline, again.microbatch_size, again.precision) == (2, 2, 2, "bf16")
    with pytest.raises(ValueError, match="mixed_precision"):
        Booster(plugin=HybridParallelPlugin(2, 1), mixed_precision="bf16")  # the plugin says fp16


def test_ignored_arguments_log_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="autopar.booster.hybrid"):
        HybridParallelPlugin(2, 1, enable_flash_attention=True, ddp_bucket_cap_mb=50, enable_metadata_cache=False,
                             num_microbatches=4)
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    for name in ("enable_flash_attention=True", "ddp_bucket_cap_mb=50", "enable_metadata_cache=False",
                 "num_microbatches=4"):
        assert name in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="autopar.booster.hybrid"):
        HybridParallelPlugin(2, 1)
    assert not caplog.records


@pytest.mark.parametrize("kwargs", [dict(min_scale=2), dict(max_scale=2.0**16), dict(hysteresis=1),
                                    dict(custom_policy=object()), dict(cpu_offload=True, zero_stage=1),
                                    dict(pp_size=2, precision="bf16", pp_style="interleaved", num_model_chunks=4)])
def test_unsupported_arguments_raise_naming_them(kwargs):
    name = next(k for k in kwargs if k not in ("zero_stage", "pp_size", "precision", "pp_style"))
    with pytest.raises(NotImplementedError, match=name):
        HybridParallelPlugin(**{"tp_size": 2, "pp_size": 1, **kwargs})


@pytest.mark.parametrize("kwargs, name", [
    (dict(tp_size=0), "tp_size"), (dict(pp_size=1.5), "pp_size"), (dict(zero_stage=3), "zero_stage"),
    (dict(precision="fp8"), "precision"), (dict(pp_style="gpipe"), "pp_style"),
    (dict(num_microbatches=0), "num_microbatches"), (dict(microbatch_size=-1), "microbatch_size"),
    (dict(pp_size=2, precision="bf16", zero_stage=2), "zero_stage=2"),
    (dict(tp_size=1, cpu_offload=True, zero_stage=2), "precision='fp16'"),
    (dict(tp_size=1, cpu_offload=True, zero_stage=2, precision="bf16", max_norm=1.0), "max_norm=1.0"),
    (dict(pp_size=2, precision="bf16", num_model_chunks=2), "num_model_chunks=2"),
    (dict(pp_size=2, precision="bf16", pp_style="interleaved"), "num_model_chunks"),
    (dict(tp_size=1, cpu_offload=True), "cpu_offload"), (dict(max_norm=-1), "max_norm"),
    (dict(enable_jit_fused=1), "enable_jit_fused"), (dict(communication_dtype=torch.int8), "communication_dtype"),
])
def test_bad_values_raise_value_error(kwargs, name):
    with pytest.raises(ValueError, match=name.replace("(", r"\(")):
        HybridParallelPlugin(**{"tp_size": 2, "pp_size": 1, **kwargs})


# ------------------------------------------------------------------------ models and references
class TinyLM(nn.Module):
    """A model outside the zoo: embedding, repeated pre-norm MLP blocks, a separate head, and the
    cross entropy computed in ``forward`` (returns the loss)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                                  nn.Linear(4 * hidden, hidden)) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def lm_batches(vocab: int, *, batch: int, seq: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` language-model batches of random token ids and labels, the same every call."""
    gen = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen),
             "labels": torch.randint(0, vocab, (batch, seq), generator=gen)} for _ in range(steps)]


def _build(name: str):
    torch.manual_seed(0)
    if name.startswith("tinylm"):  # "tinylm4": 4 blocks (2 pipeline ranks x 2 model chunks)
        model, vocab = TinyLM(layers=int(name[6:] or 2)), 64
    else:
        model, _ = zoo.build(name, tiny=True, batch=BATCH, seq=SEQ, device="cpu")
        vocab = model.config.vocab_size
    return model, lm_batches(vocab, batch=BATCH, seq=SEQ, steps=STEPS)


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _single_device(model, batches, *, grads: dict | None = None):
    """Losses and final parameters of 5 AdamW steps; ``grads`` gets the first step's gradients."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in batches:
        loss = _loss(model(**batch))
        loss.backward()
        if grads is not None and not losses:
            grads.update({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(rank, world, model, batches, options):
    options = dict(options)
    loader = options.pop("loader", False)
    plugin = HybridParallelPlugin(**options)
    booster = Booster(plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    if loader:  # the notes' loader: batch_size samples per data-parallel rank, global batches in order
        dataset = [{k: v[i] for k, v in batch.items()} for batch in batches for i in range(BATCH)]
        batches = plugin.prepare_dataloader(dataset, batch_size=BATCH // plugin.data_parallel_size())
        pm, opt, _, batches, _ = booster.boost(model, opt, dataloader=batches)
    else:
        pm, opt, *_ = booster.boost(model, opt, meta_inputs=batches[0])
    losses, grads = [], None
    for batch in batches:
        if pm.plan.pipeline is not None:
            loss = booster.execute_pipeline(iter([batch]), pm, None, opt)["loss"]
        else:
            loss = _loss(pm(**batch))
            booster.backward(loss, opt)
        if grads is None:
            grads = pm.full_gradients()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, pm.full_state_dict(), pm.plan, grads


def _whole_matrices(plan, model) -> list[str]:
    """The trainable matrices (two or more dims) the plan does not store split over the tp axis
    (the mesh's last; a pipelined plan's specs are over the stage sub-mesh, whose last it is too)."""
    import re

    shapes = {n: p.dim() for n, p in model.named_parameters()}
    whole = []
    for node in plan.nodes:
        if node.kind == "parameter" and shapes.get(node.module, 0) >= 2:
            placements = re.findall(r"S\(\d+(?:/\d+)?\)|S\d|R|P", node.output_specs[0])
            if not placements[-1].startswith("S"):
                whole.append(f"{node.module}: {node.output_specs[0]}")
    return whole


def _check(name: str, options: dict, *, timeout: float = 400) -> None:
    model, batches = _build(name)
    ref_grads: dict = {}
    ref_losses, ref_params = _single_device(model, batches, grads=ref_grads)
    options = {"precision": "fp32", **options}
    results = run_local(_train, WORLD, model, batches, options, timeout=timeout)
    tp, pp = options["tp_size"], options["pp_size"]
    for rank, (losses, state, plan, grads) in enumerate(results):
        for key, value in ref_grads.items():  # every gradient of the first step
            torch.testing.assert_close(grads[key], value, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key: f"rank {rank} grad {k}: {m}")
        expected = tuple(n for n in (pp, WORLD // (tp * pp), tp) if n > 1)
        assert tuple(plan.mesh.shape) == expected, (rank, plan.mesh.shape)
        assert (plan.pipeline is not None) == (pp > 1)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
        for key, value in ref_params.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=PARAM_ATOL,
                                       msg=lambda m, k=key: f"rank {rank} {k}: {m}")
    plan = results[0][2]
    if tp > 1:  # Megatron's layout: every trainable matrix split over the tp axis, the vocabulary-
        assert not _whole_matrices(plan, model)  # parallel embedding (table by rows) and cross entropy (by class)
        for op, slot, dim in (("aten.embedding.default", 0, 0), ("aten.cross_entropy_loss.default", 0, 1)):
            reads = [n.input_specs[slot] for n in plan.nodes if n.op == op]
            assert reads and all(s.endswith(f"S{dim}") for s in reads), (op, reads)
    zero = options.get("zero_stage", 0)
    if zero:
        assert {n.zero_stage for n in plan.nodes if n.kind == "parameter"} >= {zero}


CASES = {
    "gpt2 tp2 x dp2": ("gpt2", dict(tp_size=2, pp_size=1)),
    "llama tp4": ("llama-8b", dict(tp_size=4, pp_size=1)),
    "gpt2 tp2 x pp2 zero1": ("gpt2", dict(tp_size=2, pp_size=2, zero_stage=1, num_microbatches=2)),
    "llama pp2 x dp2 zero1": ("llama-8b", dict(tp_size=1, pp_size=2, zero_stage=1, num_microbatches=2)),
    "tinylm tp2 x dp2 zero1, loader": ("tinylm", dict(tp_size=2, pp_size=1, zero_stage=1, loader=True)),
    "tinylm tp2 x pp2": ("tinylm", dict(tp_size=2, pp_size=2, microbatch_size=4)),
    "tinylm4 pp2 x dp2 interleaved": ("tinylm4", dict(tp_size=1, pp_size=2, num_microbatches=2,
                                                      pp_style="interleaved", num_model_chunks=2)),
}


# The default suite runs two (TP x PP x ZeRO-1 on GPT-2; a model outside the zoo fed by the
# notes' loader); `pytest -m full_sweep` runs the rest.
DEFAULT_CASES = ("gpt2 tp2 x pp2 zero1", "tinylm tp2 x dp2 zero1, loader")


@pytest.mark.slow
@pytest.mark.parametrize("case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.full_sweep)
                                  for c in CASES])
def test_trains_like_one_device(case):
    name, options = CASES[case]
    _check(name, options)


# ------------------------------------------------------------------------------- bad sizes
def _bad_sizes(rank, world, model, batch):
    """Each bad configuration's error on this rank; the final barrier shows no rank was left
    waiting in a collective."""
    import torch.distributed as dist

    said = []
    attempts = [dict(tp_size=3, pp_size=1), dict(tp_size=1, pp_size=4, precision="fp32"),
                dict(tp_size=1, pp_size=2, precision="bf16", zero_stage=2),
                dict(tp_size=1, pp_size=1, cpu_offload=True, zero_stage=2),
                dict(tp_size=1, pp_size=2, precision="fp32", microbatch_size=3)]
    for options in attempts:
        try:
            booster = Booster(plugin=HybridParallelPlugin(**options))
            booster.boost(copy.deepcopy(model), meta_inputs=batch)
            said.append(None)
        except ValueError as exc:
            said.append(str(exc))
    dist.barrier()
    return said


@pytest.mark.slow
def test_bad_sizes_fail_on_every_rank_before_any_collective():
    model, batches = _build("gpt2")  # 2 repeated blocks, global batch 8
    results = run_local(_bad_sizes, WORLD, model, batches[0], timeout=120)
    for said in results:
        assert "tp_size=3" in said[0] and "world size 4" in said[0]
        assert "pp_size=4" in said[1] and "has 2" in said[1]
        assert "zero_stage=2" in said[2]
        assert "precision='fp16'" in said[3]
        assert "microbatch_size=3" in said[4]


# ----------------------------------------------------------------- fp16 and the notes' example
def _notes_example(model, train_dataset):
    """The notes' example block, with only the import line changed (the notes' ``...`` filled in
    with a tiny model, its dataset, AdamW and a criterion), then their pipelined training step."""
    from autopar.booster import Booster
    from autopar.booster import HybridParallelPlugin

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    criterion = lambda outputs, inputs: outputs.loss  # noqa: E731 -- the notes' criterion slot
    plugin =  HybridParallelPlugin(tp_size=2, pp_size=2)

    train_dataloader = plugin.prepare_dataloader(train_dataset, batch_size=8)
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, train_dataloader, _ = booster.boost(model, optimizer, criterion, train_dataloader)

    losses = []
    for batch in train_dataloader:
        losses.append(booster.execute_pipeline(iter([batch]), model, criterion, optimizer)["loss"].item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, model, optimizer


def _fp16_body(rank, world, model, batches):
    # An initial scale no fp16 gradient survives: the step is skipped on every rank, the scale halved.
    booster = Booster(plugin=HybridParallelPlugin(2, 2, initial_scale=2.0**40, num_microbatches=2))
    first = copy.deepcopy(model)
    pm, opt, *_ = booster.boost(first, torch.optim.AdamW(first.parameters(), lr=LR, eps=EPS), meta_inputs=batches[0])
    before = pm.full_state_dict()
    booster.execute_pipeline(iter([batches[0]]), pm, None, opt)
    opt.step()
    after = pm.full_state_dict()
    skipped = all(torch.equal(after[k], v) for k, v in before.items()) and opt.scaler.get_scale() == 2.0**39
    dataset = [{k: v[i] for k, v in batch.items()} for batch in batches for i in range(BATCH)]
    losses, pm, opt = _notes_example(copy.deepcopy(model), dataset)
    return skipped, losses, pm.full_state_dict(), opt.scaler.get_scale(), pm.plan.precision


@pytest.mark.slow
def test_notes_example_trains_in_fp16_across_pipeline_stages():
    """The notes' ``HybridParallelPlugin(tp_size=2, pp_size=2)`` (fp16 by default) on GPT-2 tiny:
    fp16 compute with the loss scaled on the last stage tracks fp32 single-device training within
    fp16's rounding (2e-2 over 5 steps); a scale that overflows skips the step on every rank."""
    model, batches = _build("gpt2")
    ref_losses, ref_params = _single_device(model, batches)
    for skipped, losses, state, scale, precision in run_local(_fp16_body, WORLD, model, batches, timeout=400):
        assert skipped and precision == "fp16" and scale > 1
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=2e-2)
        for key, value in ref_params.items():
            torch.testing.assert_close(state[key], value, rtol=2e-2, atol=2e-2, msg=lambda m, k=key: f"{k}: {m}")
