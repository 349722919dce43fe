"""Every candidate strategy of every ruled op, forward and backward, on PyTorch's OpInfo samples.

``autopar.strategies.opinfo`` traces OpInfo samples (``op_db``) with autopar's tracer and turns
every traced call of an ATen overload that has a rule (``rule_for``: native, generic or
DTensor-derived) into a ``Sample``; here each is checked like the rules' own samples in
``test_rules_numeric.py``, on meshes (2,) and (2, 2), forward and backward. OpInfo's sizes are
often odd (5, 3): a sample with no sharded candidate there is also checked on the first of
(3,), (5,) that has one; ``test_the_sweep_is_not_vacuous`` counts how many ops got a sharded
candidate checked and fails if too few did.

Expected failures are listed in ``opinfo_sweep.XFAIL`` with their reason, keyed by
- ``"<overload>"``: every sample of the op;
- ``"<overload>@<OpInfo name>"`` or ``"<overload>@<OpInfo name>[<sample index>]"``: the samples
  from that OpInfo (or that one sample) only; the op's other samples are still checked;
- ``"<overload>@random"``: samples that cannot be compared whatever
  the strategy (``opinfo.quirk``), kept only for ops that have no other sample; such a sample
  fails its own test until it is listed.
Entries are strict xfails: one that passes fails the run, and one that matches no sample fails
``test_every_xfail_entry_is_used``, so the list cannot go stale.

Runs ~2 minutes on 2 cores (most of it tracing ~1,300 OpInfo samples with torch.export);
``AUTOPAR_OPINFO=name1,name2`` restricts it to some OpInfos while working on a rule.
"""

import collections
import os

import pytest
import torch

from autopar.strategies import opinfo
from autopar.strategies.check import StrategyMismatch, check_strategy, reference

from . import opinfo_sweep

pytestmark = pytest.mark.slow

MESHES = opinfo_sweep.MESHES
XFAIL = opinfo_sweep.XFAIL
_bucket = opinfo_sweep.bucket
_strategies = opinfo_sweep.strategies
_meshes = opinfo_sweep.meshes

# Traced in a forked process while pytest collected the other test files (opinfo_sweep says why).
FOUND = opinfo_sweep.collection()
GROUPS: dict[str, list[opinfo.OpInfoSample]] = collections.defaultdict(list)
for _items in FOUND.samples.values():
    for _item in _items:
        GROUPS[_bucket(_item)].append(_item)


def _params():
    for key in sorted(GROUPS):
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[key])] if key in XFAIL else []
        yield pytest.param(key, marks=marks, id=key)


@pytest.mark.parametrize("key", _params())
def test_every_strategy_matches_the_unsharded_op_on_opinfo_samples(key):
    failures, num_checked = [], 0
    with torch.random.fork_rng():
        torch.manual_seed(0)  # random ops (expected failures) fail the same way on every run
        for item in GROUPS[key]:
            ref = reference(item.target, item.sample)
            for shape in _meshes(ref[0])[0]:
                for strategy in _strategies(ref[0], shape):
                    num_checked += 1
                    try:
                        check_strategy(item.target, item.sample, strategy, shape, ref=ref)
                    except StrategyMismatch as exc:
                        failures.append(str(exc))
    assert not failures, f"{len(failures)}/{num_checked} strategies wrong:\n" + "\n".join(failures)


def test_every_xfail_entry_is_used():
    if os.environ.get("AUTOPAR_OPINFO"):
        return  # a restricted sweep reaches only some entries
    unused = sorted(set(XFAIL) - set(GROUPS))
    assert not unused, f"XFAIL entries that match no OpInfo sample: {unused}"


def _coverage(items: list[opinfo.OpInfoSample]) -> str:
    """The best ``_meshes`` kind over an op's samples ("none" also when the rule raises: the
    per-op test reports that)."""
    kinds = set()
    for item in items:
        try:
            kinds.add(_meshes(opinfo.info_of(item))[1])
        except Exception:  # noqa: BLE001 - reported by the per-op test
            continue
    return next((k for k in ("even", "odd") if k in kinds), "none")


def _source(target) -> str:
    """'native', 'generic', 'dtensor' (``rule_source`` where it exists, else native)."""
    from autopar import strategies

    return strategies.rule_source(target) if hasattr(strategies, "rule_source") else "native"


def test_the_sweep_is_not_vacuous():
    """Most ruled ops reached get a sharded candidate checked from some OpInfo sample."""
    kinds = {t: _coverage(items) for t, items in FOUND.samples.items()}
    table = collections.Counter((_source(t), k) for t, k in kinds.items())
    none = sorted(str(t) for t, k in kinds.items() if k == "none")
    lines = [f"  {src:8} " + ", ".join(f"{k} {table[src, k]}" for k in ("even", "odd", "none"))
             for src in sorted({s for s, _ in table})]
    print(f"\n{opinfo.describe(FOUND)}\nsharded candidates checked on {MESHES} (even), only on an odd mesh "
          f"(odd), replication only (none), by rule source:\n" + "\n".join(lines) + f"\n  none: {none}")
    if os.environ.get("AUTOPAR_OPINFO"):
        return  # a restricted sweep: the counts above are the report
    assert len(FOUND.samples) >= 100, opinfo.describe(FOUND)
    # ~9% today: random ops, reductions over every dim, DTensor-derived rules whose candidates
    # are admitted only on even sizes; the bound leaves room for new ops of those kinds.
    assert len(none) <= len(kinds) * 15 // 100, f"no sharded candidate checked for: {none}"
