"""``make test``'s shards: each test file runs in exactly one, and any shard's failure (5, nothing
collected, included) is the runner's status."""

import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import shards
from tests.conftest import in_shard

TESTS = Path(__file__).parent


def _config(shard):
    return SimpleNamespace(getoption=lambda name: shard, rootpath=TESTS.parent)


@pytest.mark.parametrize("count", [2, 3])
def test_every_test_file_is_in_exactly_one_shard(count):
    files = sorted(TESTS.rglob("test_*.py"))
    owners = {path: [k for k in range(1, count + 1) if in_shard(_config(f"{k}/{count}"), path)]
              for path in files}
    assert all(len(ks) == 1 for ks in owners.values()), owners
    sizes = [sum(ks == [k] for ks in owners.values()) for k in range(1, count + 1)]
    assert min(sizes) > len(files) / (2 * count), sizes  # no shard nearly empty
    assert all(in_shard(_config(None), path) for path in files)


@pytest.mark.parametrize("value", ["3/2", "0/2", "x"])
def test_a_bad_shard_is_a_usage_error(value):
    with pytest.raises(pytest.UsageError, match="--shard"):
        in_shard(_config(value), TESTS / "test_api.py")


def test_any_failing_shard_fails_the_run(tmp_path, monkeypatch, capsys):
    # A stand-in for ``python -m pytest``: shard 2 of 2 collects nothing (status 5).
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "ran $3"\ncase "$3" in --shard=2/2) exit 5;; esac\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("AUTOPAR_TEST_SHARDS", "2")
    assert shards.main(["-q"], python=str(fake)) == 5
    out = capsys.readouterr().out
    assert "ran --shard=2/2" in out and "shard 2: exit 5" in out
    monkeypatch.setenv("AUTOPAR_TEST_SHARDS", "3")
    assert shards.main(["-q"], python=str(fake)) == 0
    monkeypatch.setenv("AUTOPAR_TEST_SHARDS", "none")
    with pytest.raises(SystemExit, match="AUTOPAR_TEST_SHARDS"):
        shards.main([], python=str(fake))
