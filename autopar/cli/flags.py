"""The planning flags of ``autopar inspect``, generated from the option records' fields.

Every field of ``autopar.planner.options.PlanOptions`` becomes ``--field-name`` (older names
kept as aliases: ``--memory``, ``--allow-fallback``, ``--device``), in one argument group per
record, with the field's help line, its ``Literal`` values as choices and its default (where the
CLI's default differs, ``CLI_DEFAULTS`` says so). ``plan_options`` checks each value with
``check_option`` under the flag's name, so a bad value is reported as the library reports it,
naming the flag. Torch-free: the flags are checked before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from autopar.planner.options import OPTION_GROUPS, PlanOptions, check_option, choices_of

__all__ = ["CLI_DEFAULTS", "add_option_flags", "flag_of", "plan_options", "parse_offload"]

# Where the offline CLI's default is not the library's: it plans for a GPU preset and shows baselines.
CLI_DEFAULTS = {"preset": "a100-80gb", "baselines": True}


class NamedFlag(argparse.Action):
    """Stores the value and which of the option's names was typed, as ``<dest>_flag`` (error
    messages repeat the name the user typed, e.g. the old ``--device`` for ``--preset``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_flag", option_string)


def flag_of(name: str) -> str:
    """The generated flag of option ``name``: ``time_limit`` -> ``--time-limit``."""
    return "--" + name.replace("_", "-")


def parse_offload(text: str):
    """``none``, ``auto`` or ``static:OPTIM,PARAM`` -> what ``PlanOptions.offload`` takes
    (``autopar.offload.parse_offload``), an argparse error naming ``--offload`` otherwise."""
    from autopar.offload import parse_offload as parse

    try:
        return parse(text, what="--offload")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_or_word(text: str):
    return int(text) if text.isdigit() else text  # the option's check names a bad value with the flag's text


# What each field's text becomes, where its type does not say it (a union of words and ints).
_PARSERS = {"offload": parse_offload}
_METAVARS = {"offload": "none|auto|static:OPTIM,PARAM", "memory_budget": "SIZE"}


def _argument(f: dataclasses.Field) -> dict:
    """``add_argument``'s keywords for field ``f``, derived from its type, default and help."""
    default = CLI_DEFAULTS.get(f.name, f.default)
    said = f.metadata["help"] if "(default" in f.metadata["help"] else f"{f.metadata['help']} (default: {default})"
    kwargs: dict = {"dest": f.name, "default": default, "help": said}
    choices = choices_of(f.type)
    if f.type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif f.name in _PARSERS:
        kwargs.update(type=_PARSERS[f.name], metavar=_METAVARS[f.name])
    elif f.type is float:
        kwargs["type"] = float
    elif choices and all(isinstance(c, str) for c in choices) and typing.get_origin(f.type) is typing.Literal:
        kwargs["choices"] = choices
    elif choices and typing.get_origin(f.type) is typing.Literal:
        kwargs.update(type=_int_or_word, choices=choices)
    else:
        kwargs["type"] = _int_or_word
        if f.name in _METAVARS:
            kwargs["metavar"] = _METAVARS[f.name]
    if f.name == "preset":  # a preset name or a profiled mesh JSON, resolved with the mesh (cli.inputs)
        kwargs.update(action=NamedFlag, help=f"{f.metadata['help']}, or a machine profile JSON from "
                                             f"`autopar calibrate` (default: {default}; --device is its old name)")
    return kwargs


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One argument group per option record, one flag per field (and its older aliases)."""
    for group in OPTION_GROUPS:
        section = parser.add_argument_group(group.__name__.removesuffix("Options").lower(),
                                            (group.__doc__ or "").strip().splitlines()[0])
        for f in dataclasses.fields(group):
            section.add_argument(flag_of(f.name), *f.metadata["flags"], **_argument(f))
    parser.set_defaults(preset_flag="--preset")


def plan_options(args: argparse.Namespace, *, skip: tuple[str, ...] = ("preset",)) -> PlanOptions:
    """The ``PlanOptions`` of parsed flags, each value checked under its flag's name (``skip``:
    fields resolved elsewhere: the preset goes with the mesh, which may be a profiled JSON)."""
    values = {f.name: check_option(f.name, getattr(args, f.name), name=flag_of(f.name))
              for f in dataclasses.fields(PlanOptions) if f.name not in skip}
    return PlanOptions(**values)
