"""The offload record (``autopar.offload``): one declaration of Gemini's static fractions that the
planner's ``OffloadPolicy`` and the chunk runtime's ``StaticPolicy`` both are, its string form,
and the names it was reachable by before it moved."""

import argparse
import dataclasses

import pytest

import autopar
from autopar.offload import OffloadPolicy, StaticOffload, check_offload, parse_offload


def test_planner_and_runtime_read_one_record():
    from autopar.runtime.gemini.policies import StaticPolicy

    assert issubclass(OffloadPolicy, StaticOffload) and issubclass(StaticPolicy, StaticOffload)
    fields = {f.name for f in dataclasses.fields(StaticOffload)}
    assert fields == {"offload_optim_frac", "offload_param_frac"}
    assert {f.name for f in dataclasses.fields(OffloadPolicy)} == fields  # the planner adds a rule, no field
    assert fields < {f.name for f in dataclasses.fields(StaticPolicy)}
    # The runtime runs any mix (a host payload with device optimizer state); the planner has no such tier.
    assert StaticPolicy(offload_optim_frac=0.5, offload_param_frac=0.25).offload_param_frac == 0.25
    with pytest.raises(ValueError, match="needs offload_optim_frac=1.0"):
        OffloadPolicy(offload_optim_frac=0.5, offload_param_frac=0.25)
    assert OffloadPolicy(1, 0).offload_optim_frac == 1.0 and isinstance(OffloadPolicy(1, 0).offload_optim_frac, float)
    with pytest.raises(ValueError, match=r"offload_param_frac must be a number in \[0, 1\], got True"):
        StaticOffload(offload_param_frac=True)


def test_string_form_parses_back():
    for policy in (OffloadPolicy(), OffloadPolicy(1.0, 0.25), OffloadPolicy(0.5)):
        assert parse_offload(str(policy)) == policy
    assert str(OffloadPolicy(1.0, 0.25)) == "static:1,0.25"
    assert parse_offload("auto") == "auto" and parse_offload("none") == "none"
    for bad in ("static:1", "gemini", "static:a,b", "cpu:1,0"):
        with pytest.raises(ValueError, match=r"offload takes none, auto or static:OPTIM,PARAM, got"):
            parse_offload(bad)
    with pytest.raises(ValueError, match=r"OffloadPolicy.offload_optim_frac must be a number in \[0, 1\], got 2.0"):
        parse_offload("static:2,0")
    from autopar.planner.options import PlanOptions

    assert "offload static:1,0.5" in str(PlanOptions(offload=OffloadPolicy(1.0, 0.5)))


def test_old_names_keep_working():
    from autopar.cli.flags import parse_offload as cli_offload
    from autopar.planner import offload_pricing, options

    assert autopar.OffloadPolicy is OffloadPolicy
    assert offload_pricing.OffloadPolicy is OffloadPolicy and options.OffloadPolicy is OffloadPolicy
    assert offload_pricing.check_offload is check_offload
    with pytest.raises(argparse.ArgumentTypeError, match="--offload takes none, auto or static:OPTIM,PARAM"):
        cli_offload("gemini")


def test_plugin_builds_the_static_record_from_its_knobs():
    from autopar.booster import AutoParallelPlugin
    from autopar.runtime.gemini.policies import StaticPolicy

    plugin = AutoParallelPlugin(placement_policy="static", shard_param_frac=0.5, offload_optim_frac=1.0,
                                offload_param_frac=0.5, memory_budget="1MiB")
    assert plugin.gemini_policy("cpu") == StaticPolicy(shard_param_frac=0.5, offload_optim_frac=1.0,
                                                       offload_param_frac=0.5, device_budget=2**20)
    with pytest.raises(ValueError, match="the plan brings its own offload decisions"):
        AutoParallelPlugin(offload="auto", plan=autopar.Plan.__new__(autopar.Plan))
