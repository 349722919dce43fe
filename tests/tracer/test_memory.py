"""Tracing and profiling a 1.5B-parameter model on meta allocates no parameter-sized memory."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import resource
    from autopar import zoo
    from autopar.tracer import profile, trace
    model, inputs = zoo.build("gpt2-xl")  # 1.56e9 parameters = 6.2 GB in fp32, on meta
    traced = trace(model, inputs)
    prof = profile(traced)
    assert traced.num_params > 1_500_000_000, traced.num_params
    assert prof.activation_bytes > 50 * 2**30, prof.activation_bytes  # 8 x 1024 tokens, 48 layers
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
""")


@pytest.mark.slow
def test_gpt2_xl_on_meta_stays_under_3_gib():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    peak_kib = int(done.stdout.strip().splitlines()[-1])
    assert peak_kib < 3 * 2**20, f"peak RSS {peak_kib / 2**20:.2f} GiB"
