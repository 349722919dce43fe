"""The ``autopar`` command line on zoo models at their published size. A fresh interpreter
(subprocess) where the process itself is checked: ``inspect gpt2``'s progress lines on a piped
stderr, the pipeline page's stdout kept free of the solver's banner, one bad input as a user meets
it; every other case through ``main(argv)`` in this process (output captured), where a fresh
interpreter per case (2-5 s of imports) adds nothing but time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from autopar.plans import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "autopar.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    """``autopar`` in this process (``main(argv)``, output captured): for checks of what one
    command says, where a fresh interpreter per case (3-5 s) adds nothing but time."""
    import contextlib
    import io
    import logging
    import warnings

    from autopar.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)  # what the command logs reaches its stderr, as in a process
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code
    finally:
        logging.getLogger().removeHandler(handler)
    return subprocess.CompletedProcess(["autopar", *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> str:
    assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("autopar: error:")]
    assert len(errors) == 1, out.stderr
    assert out.stderr.rstrip().endswith(errors[0])  # the error is the last thing said
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


class _Html(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.ids: set[str] = set()
        self.open: list[str] = []
        self.polyline_points = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "polyline":
            self.polyline_points = len(attrs.get("points", "").split())
        if tag not in ("meta", "line", "rect", "circle", "polygon", "polyline", "br"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        if tag in ("line", "rect", "circle", "polygon", "polyline"):
            return
        assert self.open and self.open[-1] == tag, f"unbalanced </{tag}>, open: {self.open[-5:]}"
        self.open.pop()


def _ms(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in output"
    return float(m.group(1))


# ------------------------------------------------------------------------------- inspect: gpt2
@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    out = run_cli("inspect", "gpt2", "--mesh", "2x4", "--device", "a100-80gb", "--memory", "40GiB",
                  "--allow-fallback", "--json", str(d / "plan.json"), "--html", str(d / "plan.html"))
    return out, d


def test_inspect_gpt2_summary_and_tables(gpt2_run):
    out, _ = gpt2_run
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for key in ("autopar plan: GPT2LMHeadModel on mesh a100-80gb:2x4", "step time", "peak memory",
                "of 40.00 GiB budget", "solver         highs optimal", "gap",
                "communication per collective and mesh axis", "per-layer strategies",
                "transformer.h.* x12", ".attn.c_attn", ".mlp.c_fc", "baselines (same cost model and budget)",
                "data-parallel", "zero3", "megatron-tp", "dp x tp", "autopar speed-up over the best baseline"):
        assert key in text, key
    # The communication table accounts for the summary's communication time, to the microsecond.
    comm = _ms(r"communication ([\d.]+) ms \(in ops", text)
    assert _ms(r"\n  total ([\d.]+) ms", text) == pytest.approx(comm, abs=2e-3)
    # Step = compute + communication - the asynchronous communication hidden under compute
    # (a100's comm_overlap; the table's hidden column sums to it).
    step, compute = _ms(r"step time\s+([\d.]+) ms", text), _ms(r"= compute ([\d.]+) ms", text)
    hidden = _ms(r"hidden under compute ([\d.]+) ms", text) if "hidden under compute" in text else 0.0
    assert _ms(r"\n  total [\d.]+ ms: exposed [\d.]+ ms, hidden ([\d.]+) ms", text) == pytest.approx(hidden, abs=2e-3)
    assert step == pytest.approx(compute + comm - hidden, abs=2e-3)
    # Progress: stage lines on stderr (piped, so plain lines), each with its elapsed time.
    for stage in ("trace", "profile", "strategies", "solve"):
        assert re.search(rf"\[autopar +[\d.]+s\] {stage} done in [\d.]+s", out.stderr), stage


def test_inspect_gpt2_json_loads_back_and_beats_baselines(gpt2_run):
    out, d = gpt2_run
    assert out.returncode == 0, out.stderr[-3000:]
    plan = Plan.load(str(d / "plan.json"))
    assert plan.mesh.shape == (2, 4) and plan.budget_bytes == 40 * 2**30
    assert plan.estimate.peak_bytes <= plan.budget_bytes
    assert _ms(r"step time\s+([\d.]+) ms", out.stdout) == pytest.approx(plan.estimate.step_s * 1e3, abs=1e-3)
    assert {b.name for b in plan.baselines} == {"data-parallel", "zero3", "megatron-tp", "dp x tp"}
    for b in plan.baselines:
        if b.feasible:
            assert plan.estimate.step_s <= b.estimate.step_s * (1 + 1e-6), b.name
    assert any(n.kind == "op" and n.module.startswith("transformer.h.11") for n in plan.nodes)


def test_inspect_gpt2_html_has_chart_and_tables(gpt2_run):
    out, d = gpt2_run
    assert out.returncode == 0, out.stderr[-3000:]
    page = (d / "plan.html").read_text()
    parser = _Html()
    parser.feed(page)
    parser.close()
    assert parser.open == []  # every element closed
    assert {"memory-chart", "strategy-map", "baselines", "communication"} <= parser.ids
    assert "svg" in parser.tags and parser.polyline_points > 100  # a real timeline, not a stub
    assert "budget 40.00 GiB" in page and "transformer.h.*" in page and "megatron-tp" in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


# ----------------------------------------------------------------------------- other commands
def test_inspect_resnet50_on_profiled_mesh_file(tmp_path):
    # A hand-written mesh file (the format profile-mesh writes) in place of a preset.
    mesh = {"version": 1, "shape": [8], "axis_names": ["dp"], "alpha": [1e-5], "beta": [1 / 100e9],
            "peak_flops": 100e12, "mem_bandwidth": 1e12, "mem_capacity": 16 * 2**30, "name": "lab"}
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps(mesh))
    out = run_cli_here("inspect", "resnet50", "--device", str(path), "--allow-fallback", "--no-baselines",
                  "--json", str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on mesh lab:8 (8 devices, axes dp=8)" in out.stdout
    assert "of 16.00 GiB budget" in out.stdout  # the default budget is the device capacity
    assert "resnet.encoder.stages.*" in out.stdout
    assert "Baselines" not in out.stdout and "baselines (same" not in out.stdout
    assert Plan.load(str(tmp_path / "p.json")).mesh.axis_names == ("dp",)


def test_coverage_gpt2():
    out = run_cli_here("coverage", "gpt2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["op", "count", "rule"]
    row = next(line for line in lines if line.startswith("aten.addmm.default"))
    assert row.split()[1] == "48" and row.split()[2] == "native"  # 4 linears x 12 blocks
    assert re.search(r"\d+ distinct ops, \d+ op nodes; \d+ native, \d+ generic, \d+ dtensor, \d+ decomposed; "
                     r"0 ops \(0 nodes\) without a sharding rule", lines[-1])


def test_coverage_names_the_source_of_every_op(tmp_path):
    src = tmp_path / "net.py"
    src.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(16, 16)\n"
        "    def forward(self, x):\n"
        "        y = nn.functional.hardtanh(self.lin(x))\n"  # generic (pointwise tag)
        "        y = nn.functional.glu(y, dim=-1)\n"  # decomposed
        "        return torch.fft.rfft(y).real.sum()\n"  # fft: DTensor-derived, then view_as_real ...
        "def factory():\n"
        "    return Net(), {'x': torch.randn(4, 16)}\n")
    out = run_cli_here("coverage", f"{src}:factory")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split()[2] for line in out.stdout.splitlines()[2:-1]}
    assert rows["aten.linear.default"] == "native"
    assert rows["aten.hardtanh.default"] == "generic"
    assert rows["aten.glu.default"] == "decomposed"
    assert rows["aten._fft_r2c.default"] == "dtensor"


def test_inspect_custom_factory_with_inputs(tmp_path):
    src = tmp_path / "net.py"
    src.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc1 = torch.nn.Linear(1024, 4096)\n"
        "        self.fc2 = torch.nn.Linear(4096, 1024)\n"
        "    def forward(self, x):\n"
        "        return self.fc2(torch.relu(self.fc1(x))).sum()\n"
        "def make():\n"
        "    with torch.device('meta'):\n"
        "        return Net()\n")
    out = run_cli_here("inspect", f"{src}:make", "--mesh", "4", "--device", "h100-80gb", "--input",
                       "x:float32[64,1024]", "--no-baselines", "--allow-fallback")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on mesh h100-80gb:4" in out.stdout and "fc1" in out.stdout and "fc2" in out.stdout
    missing = run_cli_here("inspect", f"{src}:make", "--mesh", "4")
    assert_one_line_error(missing, "returned only a model", "--input")


@pytest.mark.full_sweep  # the deprecated alias of `autopar calibrate` (tests/cli/test_calibrate.py)
def test_profile_mesh_local_writes_a_loadable_mesh(tmp_path):
    from autopar.layout.mesh import MeshSpec

    path = tmp_path / "mesh.json"
    out = run_cli("profile-mesh", "--local", "2", "--mesh", "2", "--repeats", "2", "-o", str(path))
    assert out.returncode == 0, out.stderr[-3000:]
    mesh = MeshSpec.load(str(path))
    assert mesh.shape == (2,) and mesh.alpha[0] > 0 and mesh.beta[0] > 0
    assert f"wrote {path}" in out.stdout


# -------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, needles", [
    (("inspect", "gpt-5", "--mesh", "2x4"), ("unknown model 'gpt-5'", "gpt2-xl")),
    (("inspect", "gpt2", "--mesh", "3x4", "--device", "a100-80gb"), ("12 devices", "8 devices per node")),
    (("inspect", "gpt2", "--mesh", "2x4", "--memory", "40QB"), ("cannot parse memory size '40QB'",)),
    (("inspect", "gpt2", "--mesh", "twoxfour"), ("cannot parse mesh shape",)),
    (("inspect", "gpt2", "--mesh", "2x4", "--device", "tpu-v9"), ("unknown --device 'tpu-v9'",)),
    (("inspect", "gpt2", "--mesh", "2x4", "--preset", "tpu-v9"), ("unknown --preset 'tpu-v9'",)),
    (("inspect", "gpt2", "--mesh", "2x4", "--time-limit", "0"), ("--time-limit must be positive seconds, got 0.0",)),
    (("inspect", "gpt2", "--mesh", "2x4", "--input", "ids:int64(8)"), ("cannot parse --input",)),
    (("inspect", "nope.py:make", "--mesh", "2"), ("model file 'nope.py' not found",)),
    (("profile-mesh", "--mesh", "2x2", "-o", "m.json"), ("--local N", "torchrun")),
])
def test_bad_input_is_one_clear_line(args, needles):
    assert_one_line_error(run_cli_here(*args), *needles)


def test_bad_input_is_one_clear_line_in_a_fresh_process():
    # the cases above run in this process; one as a user meets it, in a fresh interpreter
    assert_one_line_error(run_cli("inspect", "gpt-5", "--mesh", "2x4", timeout=60), "unknown model 'gpt-5'")


def test_infeasible_budget_names_the_smallest_budget():
    out = run_cli_here("inspect", "mlp", "--mesh", "2", "--memory", "256MiB", "--no-baselines", "--allow-fallback")
    line = assert_one_line_error(out, "cannot be met on mesh 2", "smallest budget")
    assert re.search(r"\d+\.\d+ GiB", line)


def test_unknown_checkpoint_mode_is_a_usage_error():
    out = run_cli_here("inspect", "gpt2", "--mesh", "2x4", "--checkpoint", "sometimes")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.rstrip().splitlines()[-1]
    assert "argument --checkpoint: invalid choice: 'sometimes'" in last and "'rotor'" in last, out.stderr


def test_unknown_option_is_a_usage_error():
    out = run_cli_here("inspect", "gpt2", "--mesh", "2x4", "--colour")
    assert out.returncode == 2 and "unrecognized arguments: --colour" in out.stderr
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------- inspect: Hugging Face config.json
# Where the pipeline is not the point: --pipeline 1 skips the default's pipeline floors (two more
# traces of the micro-batch graphs); the default "auto" is inspected in gpt2_run (GPT-2 on 2x4).
NO_PIPELINE = ("--pipeline", "1")
_TINY_HF = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=128)


def _save_config(tmp_path, name: str, **extra) -> str:
    import transformers

    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}[name]
    config_class = getattr(transformers, arch).config_class
    folder = tmp_path / name
    config_class(architectures=[arch], **extra).save_pretrained(str(folder))  # as a user's config.json
    return str(folder / "config.json")


def _main(capsys, *args: str) -> tuple[int, str, str]:
    from autopar.cli.main import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name, extra", [
    ("llama", {}),
    ("qwen2", {}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
])
def test_inspect_hf_config_json_in_process(tmp_path, capsys, name, extra):
    path = _save_config(tmp_path, name, **_TINY_HF, **extra)
    with open(path) as f:
        assert json.load(f)["use_cache"] is True  # the default, as saved: the trace turns it off
    code, out, err = _main(capsys, "inspect", path, "--mesh", "2", "--batch", "4", "--seq", "16", *NO_PIPELINE,
                           "--no-baselines", "-q")  # no fallback: every op has a rule
    assert code == 0, err[-3000:]
    with open(path) as f:
        arch = json.load(f)["architectures"][0]
    assert f"autopar plan: {arch} on mesh a100-80gb:2" in out
    assert "model.layers.* x2" in out and "lm_head" in out and "step time" in out


def test_inspect_preset_and_its_old_name_device(tmp_path, capsys):
    path = _save_config(tmp_path, "llama", **_TINY_HF)
    for flag in ("--preset", "--device"):
        code, out, err = _main(capsys, "inspect", path, "--mesh", "2", "--batch", "4", "--seq", "16", *NO_PIPELINE,
                               flag, "h100-80gb", "--no-baselines", "-q")
        assert code == 0, err[-3000:]
        assert "autopar plan: LlamaForCausalLM on mesh h100-80gb:2" in out, flag


def test_inspect_hf_config_folder_real_width_llama_on_2x4(tmp_path, capsys):
    # LlamaConfig() at its published defaults (hidden 4096, vocab 32000), 2 of its 32 layers to stay fast.
    path = _save_config(tmp_path, "llama")
    code, out, err = _main(capsys, "inspect", os.path.dirname(path), "--mesh", "2x4", "--layers", "2", *NO_PIPELINE,
                           "--batch", "8", "--seq", "1024", "--no-baselines", "--no-layers",
                           "-q", "--json", str(tmp_path / "plan.json"))
    assert code == 0, err[-3000:]
    assert "autopar plan: LlamaForCausalLM on mesh a100-80gb:2x4" in out
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert plan.mesh.shape == (2, 4) and not plan.fallbacks
    # real width: the embedding of 32000 x 4096 is in the plan
    assert any("embed_tokens" in n.module for n in plan.nodes)


def test_inspect_hf_config_bad_files_are_one_line(tmp_path, capsys):
    import transformers

    transformers.LlamaConfig(**_TINY_HF).save_pretrained(str(tmp_path / "noarch"))  # no architectures
    (tmp_path / "alien.json").write_text(json.dumps({"architectures": ["AlienForCausalLM"], "vocab_size": 8}))
    (tmp_path / "broken.json").write_text("{not json")
    cases = [((str(tmp_path / "noarch" / "config.json"),), "'architectures' field is missing"),
             ((str(tmp_path / "noarch"),), "'architectures' field is missing"),
             ((str(tmp_path / "alien.json"),), "architecture 'AlienForCausalLM' is not a model class of transformers"),
             ((str(tmp_path / "broken.json"),), "cannot read"),
             ((str(tmp_path / "missing.json"),), "not found")]
    # transformers 5's T5Config() lacks decoder_start_token_id: the trace error says so, in one line.
    transformers.T5Config(architectures=["T5ForConditionalGeneration"], d_model=64, d_kv=16, d_ff=128,
                          num_layers=2, num_heads=4, vocab_size=128).save_pretrained(str(tmp_path / "t5"))
    cases.append(((str(tmp_path / "t5"), "--seq", "16"), "has no attribute 'decoder_start_token_id'"))
    for args, needle in cases:
        code, out, err = _main(capsys, "inspect", *args, "--mesh", "2", "-q")
        assert code == 1 and out == "", (args, out)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("autopar: error:") and needle in lines[0], err


def test_inspect_precision_flag_plans_bf16_and_says_so(tmp_path, capsys):
    path = _save_config(tmp_path, "llama", **_TINY_HF)
    out_json = tmp_path / "plan.json"
    code, out, err = _main(capsys, "inspect", path, "--mesh", "2", "--batch", "4", "--seq", "16", "--precision",
                           "bf16", *NO_PIPELINE, "--no-baselines", "-q", "--json", str(out_json))
    assert code == 0, err[-3000:]
    assert "precision      bf16 compute, fp32 master weights, gradients summed in fp32" in out
    assert json.loads(out_json.read_text())["precision"] == "bf16"
    bad = run_cli_here("inspect", "gpt2", "--mesh", "2", "--precision", "int8")
    assert bad.returncode == 2 and "invalid choice: 'int8'" in bad.stderr


def test_inspect_zero_stage_auto_shows_stages_and_zero_baselines(tmp_path, capsys):
    path = _save_config(tmp_path, "llama", **_TINY_HF)
    code, out, err = _main(capsys, "inspect", path, "--mesh", "2x2", "--batch", "8", "--seq", "32", *NO_PIPELINE,
                           "--zero-stage", "auto", "--preset", "cpu", "-q")
    assert code == 0, err[-3000:]
    assert "zero1" in out and "zero2" in out and "data-parallel" in out
    code, out, err = _main(capsys, "inspect", path, "--mesh", "2x2", "--batch", "8", "--seq", "32", *NO_PIPELINE,
                           "--zero-stage", "2", "--preset", "cpu", "--no-baselines", "-q")
    assert code == 0, err[-3000:]
    # every parameter with a replicated axis at stage 2 (a norm sharded whole would show as stage 0)
    assert "ZeRO           stage " in out and "stage 2: " in out and "stage 1: " not in out
    bad = run_cli_here("inspect", "gpt2", "--mesh", "2", "--zero-stage", "3")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


# ---------------------------------------------------------------------- inspect --pipeline --html
def test_inspect_pipeline_html_shows_stages_and_the_schedule(tmp_path):
    page_file = tmp_path / "pp.html"
    out = run_cli("inspect", "gpt2", "--layers", "4", "--batch", "8", "--seq", "32", "--mesh", "2x2",
                  "--pipeline", "2", "--schedule", "zero-bubble", "--microbatches", "4", "--no-baselines", "-q",
                  "--html", str(page_file))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 micro-batches, zero-bubble" in out.stdout
    assert "HiGHS" not in out.stdout  # highspy 1.16's banner is kept off stdout (solver.ilp)
    page = page_file.read_text()
    parser = _Html()
    parser.feed(page)
    assert not parser.open and {"stages", "schedule"} <= parser.ids
    # 4 stages (2 ranks x 2 virtual) x 4 micro-batches x (forward, input grad, weight grad)
    boxes = re.findall(r"<title>(forward|backward|weight gradient \(zero-bubble\)), stage (\d), micro-batch (\d)",
                       page)
    assert sorted(set(boxes)) == sorted({(k, str(s), str(m)) for k in ("forward", "backward",
                                                                        "weight gradient (zero-bubble)")
                                         for s in range(4) for m in range(4)})
    assert len(boxes) == 48
    assert _ms(r"Simulated step ([\d.]+) ms", page) > 0


# ------------------------------------------------------------------------------- inspect --verify
def test_inspect_verify_runs_the_plan_on_local_processes(tmp_path, capsys):
    path = _save_config(tmp_path, "llama", **_TINY_HF)
    code, out, err = _main(capsys, "inspect", path, "--mesh", "2", "--batch", "4", "--seq", "16", "--preset", "cpu",
                           "--no-baselines", "-q", "--verify", "--local", "2")
    assert code == 0, err[-3000:]
    assert re.search(r"verified: loss [\d.]+ \(all-replicated [\d.]+\), \d+ gradients", out), out[-2000:]
    assert "on 2 local processes" in out


@pytest.mark.parametrize("extra, needle", [
    (("--verify",), "pass --local N"),
    (("--verify", "--local", "4"), "the mesh has 2 devices; pass --local 2"),
    (("--local", "2"), "--local N goes with --verify"),
])
def test_inspect_verify_flags_are_checked_first(extra, needle):
    assert_one_line_error(run_cli_here("inspect", "gpt2", "--mesh", "2", *extra), needle)


# ------------------------------------------------------------------------------ inspect --family
@pytest.mark.slow
def test_inspect_family_prints_the_fixed_configuration(tmp_path, capsys):
    """``--family``: HybridParallelPlugin's plan offline -- dp x Megatron on 2x2 (every matrix split
    over the tp axis), and Megatron stages of a 2-stage pipeline; an unknown family is one line."""
    path = _save_config(tmp_path, "llama", **_TINY_HF)
    out_json = tmp_path / "plan.json"
    code, out, err = _main(capsys, "inspect", path, "--mesh", "2x2", "--batch", "8", "--seq", "16", "--family",
                           "dp x megatron", "--preset", "cpu", "-q", "--json", str(out_json))
    assert code == 0, err[-3000:]
    layouts = dict(re.findall(r"^  (\S+\.weight): (\S+)", out, flags=re.M))
    matrices = [k for k in layouts if "proj" in k or "embed" in k or "lm_head" in k]
    assert matrices and all(re.fullmatch(r"RS\d", layouts[k]) for k in matrices), layouts
    assert Plan.load(str(out_json)).mesh.shape == (2, 2)
    code, out, err = _main(capsys, "inspect", path, "--mesh", "2x2", "--batch", "8", "--seq", "16", "--family",
                           "megatron", "--pipeline", "2", "--microbatches", "2", "--schedule", "1f1b",
                           "--checkpoint", "none", "--preset", "cpu", "--no-baselines", "-q")
    assert code == 0, err[-3000:]
    assert "2 micro-batches, 1f1b" in out
    code, out, err = _main(capsys, "inspect", path, "--mesh", "2", "--family", "nope", "-q")
    assert code == 1 and "--family 'nope'" in err and len(err.strip().splitlines()) == 1
