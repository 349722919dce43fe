"""``autopar inspect`` prints each embedding table's placement and, for a table-wise table, its owner."""

from __future__ import annotations

from tests.cli.test_main import run_cli_here

FACTORY = '''
import torch
from autopar import zoo

def make():
    with torch.device("meta"):
        model = zoo.DLRM(num_dense=13, table_rows=(1 << 20,) * 8, dim=20, bottom=(64,), top=(64,), hotness=(4,) * 8)
    return model, zoo.dlrm_inputs(model, batch=65536, device="meta")
'''


def test_inspect_prints_the_owner_of_each_table_wise_table(tmp_path):
    src = tmp_path / "dlrm_tables.py"
    src.write_text(FACTORY)
    # In this process (``main(argv)``): what the command prints is the check, not a fresh interpreter.
    out = run_cli_here("inspect", f"{src}:make", "--mesh", "8", "--device", "h100-80gb", "--memory", "1GiB",
                       "--no-baselines", "--no-cache", "--no-layers", "-q")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.strip().startswith("tables.")]
    assert len(lines) == 8 and all("table-wise over ax0" in line for line in lines), out.stdout
    assert sorted(line.split()[-1] for line in lines) == [f"ax0={d}" for d in range(8)]
