"""The import paths the product notes use, as autopar spells them (the README's table), resolved
in a fresh interpreter: after ``import autopar`` alone, ``autopar.optim.Lamb``,
``autopar.booster.Booster`` and the plugin classes are attributes (as ``torch.optim`` is after
``import torch``), and the launchers are ``autopar.launch`` / ``autopar.launch_from_torch``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# notes' path -> autopar's (the README's table, row by row)
PATHS = {
    "colossalai.booster.Booster": "autopar.booster.Booster",
    "colossalai.Booster": "autopar.Booster",
    "colossalai.booster.plugin.TorchDDPPlugin": "autopar.booster.TorchDDPPlugin",
    "colossalai.booster.plugin.TorchFSDPPlugin": "autopar.booster.TorchFSDPPlugin",
    "colossalai.booster.plugin.LowLevelZeroPlugin": "autopar.booster.LowLevelZeroPlugin",
    "colossalai.nn.optimizer.Lamb": "autopar.optim.Lamb",
    "colossalai.mixed_precision.FP16TorchMixedPrecision": "autopar.booster.FP16TorchMixedPrecision",
    "colossalai.launch": "autopar.launch",
    "colossalai.launch_from_torch": "autopar.launch_from_torch",
    "colossalai.get_default_parser": "autopar.get_default_parser",
}


def test_notes_paths_resolve_after_import_autopar():
    code = ("import sys, autopar\n"
            "lazy = 'torch' not in sys.modules\n"
            f"for path in {sorted(PATHS.values())!r}:\n"
            "    obj = autopar\n"
            "    for part in path.split('.')[1:]:\n"
            "        obj = getattr(obj, part)\n"
            "    assert callable(obj), path\n"
            "from autopar.optim.lr_scheduler import CosineAnnealingLR, LinearWarmupLR\n"
            "from autopar.runtime.launch import priority_execution\n"
            "print(lazy, autopar.booster.AutoParallelPlugin.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "AutoParallelPlugin"]  # torch loads on first use, not at import


def test_readme_table_lists_every_path():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    for notes, ours in PATHS.items():
        words = [*notes.rpartition(".")[::2], *ours.rpartition(".")[::2]]  # both modules and names
        assert any(all(w in row for w in words) for row in rows), (notes, ours)
