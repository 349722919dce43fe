"""``make test``'s runner: the default suite as N pytest processes side by side.

``python -m tests.shards [pytest arguments]`` starts ``pytest --shard K/N`` for K = 1..N
(``tests/conftest.py`` gives each test file to one shard by a hash of its path). N is
``AUTOPAR_TEST_SHARDS``, 2 by default.

Why: much of the suite runs in the test process itself (planning, tracing, single-device
references, on one intra-op thread), so a serial run leaves one of CI's two cores idle for long
stretches. On this project's 2-core host the same tree ran in 19:21 serially and 12:18 in two
shards (load 3-4 during the sharded run).

Shard 1 prints to the terminal as it runs; the others write to ``.pytest_cache/shards/K.log``,
printed when they end. The exit status is the first non-zero one among the shards (5, nothing
collected, included), so any failing shard fails ``make test``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shard_count() -> int:
    value = os.environ.get("AUTOPAR_TEST_SHARDS", "2")
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise SystemExit(f"AUTOPAR_TEST_SHARDS={value!r}: expected a positive integer")
    return count


def main(argv: list[str], *, python: str = sys.executable) -> int:
    """Run the shards (``python -m pytest --shard=K/N *argv``); the first non-zero status."""
    count = shard_count()
    logs = ROOT / ".pytest_cache" / "shards"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    procs: list[tuple[int, subprocess.Popen, Path | None]] = []
    try:
        for k in range(1, count + 1):
            cmd = [python, "-m", "pytest", f"--shard={k}/{count}", *argv]
            log = None if k == 1 else logs / f"{k}.log"
            out = None if log is None else log.open("w")
            procs.append((k, subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), log))
            if out is not None:
                out.close()
        codes = []
        for k, proc, log in procs:
            code = proc.wait()
            codes.append(code)
            if log is not None:
                print(f"\n===== shard {k}/{count} (from {log.relative_to(ROOT)}) =====", flush=True)
                sys.stdout.write(log.read_text())
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
    elapsed = time.monotonic() - start
    status = ", ".join(f"shard {k}: exit {code}" for k, code in enumerate(codes, 1))
    print(f"\n===== {count} shards in {elapsed:.0f} s ({status}) =====", flush=True)
    return next((code for code in codes if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
