"""The planning options are declared once (``autopar.planner.options``) and every entry point
derives from them: each field is reachable from the CLI and from the Booster plugin, and the same
bad value gives the same message from ``plan``, ``autoparallelize``, the plugin and the CLI (each
naming the option as it spells it)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from autopar.api import autoparallelize, plan
from autopar.booster.plugin import PLANNING_NAMES, AutoParallelPlugin
from autopar.cli.flags import flag_of
from autopar.cli.main import build_parser, main
from autopar.planner.options import OPTION_GROUPS, PlanOptions, choices_of
from autopar.plans import PIPELINE_SCHEDULES, PRECISIONS

FIELDS = dataclasses.fields(PlanOptions)


def _inspect_actions() -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["inspect"]
    return {a.dest: a for a in sub._actions}


def test_every_field_is_documented_and_in_one_group():
    grouped = [f.name for group in OPTION_GROUPS for f in dataclasses.fields(group)]
    assert sorted(grouped) == sorted(f.name for f in FIELDS) and len(grouped) == len(set(grouped))
    for f in FIELDS:
        assert f.metadata["help"].strip() and "\n" not in f.metadata["help"], f.name
    assert choices_of(PlanOptions.__dataclass_fields__["precision"].type) == PRECISIONS
    assert choices_of(PlanOptions.__dataclass_fields__["schedule"].type) == ("auto", *PIPELINE_SCHEDULES)


def test_every_field_is_a_cli_flag_with_the_fields_choices():
    actions = _inspect_actions()
    for f in FIELDS:
        action = actions[f.name]
        assert flag_of(f.name) in action.option_strings, f.name
        for alias in f.metadata["flags"]:
            assert alias in action.option_strings, alias
        if action.choices is not None:  # a Literal field: argparse offers exactly its values
            assert tuple(action.choices) == choices_of(f.type), f.name


def test_every_training_field_is_a_plugin_field_that_reaches_autoparallelize():
    plugin_fields = {f.name for f in dataclasses.fields(AutoParallelPlugin)}
    assert set(PLANNING_NAMES) <= plugin_fields
    reached = set(PLANNING_NAMES.values())
    # The preset is the runtime device's, and baselines are a report: planning-only options.
    assert {f.name for f in FIELDS if f.name not in reached} == {f.name for f in FIELDS if not f.metadata["training"]}
    assert {f.name for f in FIELDS if not f.metadata["training"]} == {"preset", "baselines"}
    kwargs = AutoParallelPlugin(pp_size=2, num_microbatches=4).autoparallelize_kwargs()
    params = set(inspect.signature(autoparallelize).parameters) - {"overrides"}
    assert set(kwargs) <= params | {f.name for f in FIELDS}


def test_unknown_keywords_are_type_errors():
    with pytest.raises(TypeError, match="plan\\(\\) got an unexpected keyword argument 'memory'"):
        plan(nn.Linear(2, 2), (torch.empty(2, 2, device="meta"),), mesh=(2,), memory="1GiB")


# (option, the bad value as the library takes it, the same value as the CLI's text)
BAD = [("time_limit", 0.0, "0"), ("optimizer_multiplier", -1.0, "-1"), ("microbatches", 0, "0"),
       ("pipeline", 0, "0"), ("memory_budget", "40QB", "40QB"), ("allow_replicate_fallback", "yes", None)]


def _plan_message(option: str, value) -> str:
    with pytest.raises(ValueError) as info:
        plan(nn.Linear(2, 2), (torch.empty(2, 2, device="meta"),), mesh=(2,), **{option: value})
    return str(info.value)


def _plugin_message(option: str, value) -> tuple[str, str]:
    name = next(k for k, v in PLANNING_NAMES.items() if v == option)
    with pytest.raises(ValueError) as info:
        AutoParallelPlugin(**{name: value})
    return name, str(info.value)


def _autoparallelize_body(rank, world, cases):
    out = []
    for option, value in cases:
        try:
            autoparallelize(nn.Linear(2, 2), (torch.empty(2, 2, device="meta"),), **{option: value})
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


def _named(message: str, option: str, name: str) -> str:
    return message.replace(f"{option} must", f"{name} must", 1)


def test_the_same_bad_value_gives_the_same_message_everywhere(capsys):
    from autopar.runtime.launch import run_local

    expected = {option: _plan_message(option, value) for option, value, _ in BAD}
    for option, value, _ in BAD:
        name, message = _plugin_message(option, value)
        assert message == _named(expected[option], option, name), option
    ranked = run_local(_autoparallelize_body, 1, [(o, v) for o, v, _ in BAD], timeout=120)[0]
    assert ranked == [expected[o] for o, _, _ in BAD]
    for option, _, text in BAD:
        if text is None:  # a switch on the command line: it cannot be given a bad value
            continue
        code = main(["inspect", "mlp", "--mesh", "2", flag_of(option), text])
        err = capsys.readouterr().err.strip()
        assert code == 1 and err == "autopar: error: " + _named(expected[option], option, flag_of(option)), err
