"""Shared fixtures: device-free meshes of 1, 2 and 3 axes (CPU preset costs); every test plans
with its own empty plan cache directory (never the user's, never another test's entries)."""

import itertools
import sys
import zlib
from pathlib import Path

import pytest

from autopar.layout.mesh import MeshSpec

_CACHE_DIRS = itertools.count()


@pytest.fixture(scope="session", autouse=True)
def _plan_cache_root(tmp_path_factory):
    """The plan cache is on by default: never the user's directory, even for module fixtures."""
    root = tmp_path_factory.mktemp("plan-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPAR_CACHE_DIR", str(root / "shared"))
        mp.delenv("AUTOPAR_CACHE", raising=False)
        yield root


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """One intra-op thread in the test process. Its single-device references and plans are of tiny
    models, where a second thread only contends with the ranks, the forked sweep workers and the
    other processes on a 2-core machine: a tiny GPT-2's reference steps took ~10 s with two
    threads against 0.2 s with one under a load of 3. Forked ranks set their own
    (``run_local(num_threads=)``)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def _own_plan_cache(_plan_cache_root, monkeypatch):
    """A fresh cache directory per test (created only when a plan is stored), so a test never
    reads a plan another test solved."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(_plan_cache_root / str(next(_CACHE_DIRS))))


@pytest.fixture(scope="module", autouse=True)
def _drop_planning_caches():
    """After each test file, the library's process-wide memo tables are emptied: a later file gets
    nothing from them but a bigger heap (up to 65536 option tuples, 4096 strategy lists, 256
    layout graphs, 4096 local indices of the strategy checks, torch's fake-tensor dispatch
    cache), which every later fork copies the page tables of and every full collection of this
    process walks. Only modules already imported."""
    yield
    modules = sys.modules
    if "autopar.layout.conversion" in modules:
        modules["autopar.layout.conversion"].clear_conversion_cache()
    if "autopar.runtime.passes" in modules:
        modules["autopar.runtime.passes"]._STRATEGY_CACHE.clear()
    if "autopar.solver.problem" in modules:
        modules["autopar.solver.problem"]._VALID_OPTIONS.clear()
        modules["autopar.solver.problem"]._OPTION_INDEX.clear()
    if "autopar.strategies.fused" in modules:
        modules["autopar.strategies.fused"].local_index.cache_clear()
    if "torch._subclasses.fake_tensor" in modules:
        modules["torch._subclasses.fake_tensor"].FakeTensorMode.cache_clear()


@pytest.fixture(params=[(2,), (4,)], ids=lambda s: "x".join(map(str, s)))
def mesh_1d(request) -> MeshSpec:
    return MeshSpec.preset("cpu", request.param)


@pytest.fixture(params=[(2, 2), (2, 4)], ids=lambda s: "x".join(map(str, s)))
def mesh_2d(request) -> MeshSpec:
    return MeshSpec.preset("cpu", request.param)


@pytest.fixture
def mesh_3d() -> MeshSpec:
    return MeshSpec.preset("cpu", (2, 2, 2))


@pytest.fixture(params=[(2,), (4,), (2, 2), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def any_mesh(request) -> MeshSpec:
    return MeshSpec.preset("cpu", request.param)


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run only the test files of shard K of N (files split by a hash of their path); "
        "`make test` runs two shards side by side",
    )


def _shard(config) -> tuple[int, int] | None:
    value = config.getoption("--shard")
    if value is None:
        return None
    try:
        k, n = (int(part) for part in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard={value!r}: expected K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard={value!r}: K must be between 1 and N")
    return k, n


def in_shard(config, path: Path) -> bool:
    """Whether ``path`` (a test file) belongs to this run's ``--shard`` (every file without one)."""
    shard = _shard(config)
    if shard is None:
        return True
    k, n = shard
    rel = path.resolve().relative_to(Path(config.rootpath).resolve()).as_posix()
    return zlib.crc32(rel.encode()) % n == k - 1


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if not in_shard(config, collection_path):
            return True
    return None


def pytest_collection_modifyitems(config, items):
    """The sweeps (``tests/sweeps``) first, the rest in their usual order.

    They fork planning processes and gloo ranks by the dozen, and a forked child pays for the
    parent's heap (page tables at fork, copy-on-write as reference counts change): late in the
    suite that heap holds ~2M objects, and the three sweep files took 137 s there against 88 s
    in a fresh process (session 17, this 2-core host)."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/sweeps/"))


def pytest_configure(config):
    """The OpInfo sweep's samples are traced in a forked process from here, while the other test
    files are collected (``tests/strategies/opinfo_sweep.py`` says why), when the run includes
    ``test_opinfo.py``."""
    from tests.strategies import opinfo_sweep

    if opinfo_sweep.wanted(config.args, Path(config.invocation_params.dir)) and in_shard(
        config, opinfo_sweep.TEST_FILE
    ):
        opinfo_sweep.start()


def pytest_unconfigure(config):
    sweep = sys.modules.get("tests.strategies.opinfo_sweep")
    if sweep is not None:
        sweep.stop()
