"""Offload configuration: one record of Gemini's static fractions, read by planner and runtime.

``StaticOffload`` is what ``GeminiPlugin(placement_policy="static")`` calls its offload knobs:
the leading ``offload_optim_frac`` of the trainable parameter bytes (in model order, as Gemini
walks its chunks) keep their fp32 master and optimizer state on the host, the leading
``offload_param_frac`` keep the parameter there too. Two readers specialise it and nothing else
declares or checks these fields:

- the planner prices ``OffloadPolicy`` (``autopar.plan(..., offload=OffloadPolicy(...))``,
  ``autopar.planner.offload_pricing``), per parameter, with Gemini's rule that a host parameter
  needs its optimizer state on the host (its tiers have no host parameter with device state);
- the chunk runtime places chunks by ``StaticPolicy`` (``autopar.runtime.gemini.policies``), which
  adds the runtime's knobs (ZeRO-3 chunk sharding, pinned memory, the device budget) and runs any
  mix of the two fractions.

The planner's ``offload`` option is ``"none"``, ``"auto"`` (the solver chooses every tier) or an
``OffloadPolicy``; ``check_offload`` is its one check and ``parse_offload`` reads its string form
(``str(policy)``: ``static:OPTIM,PARAM``). Plain data: no torch, no other autopar import, so the
planner, the runtime, the booster and the CLI all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Union

__all__ = ["OFFLOAD_MODES", "OffloadMode", "OffloadOption", "StaticOffload", "OffloadPolicy", "fraction",
           "check_offload", "parse_offload", "runtime_options"]

OffloadMode = Literal["none", "auto"]
OFFLOAD_MODES: tuple[OffloadMode, ...] = ("none", "auto")


# How a fraction out of [0, 1] is reported, by every reader: the knob's name and the value given.
RANGE_ERROR = "{name} must be a number in [0, 1], got {value!r}"


def fraction(value, name: str, message: str = RANGE_ERROR) -> float:
    """``value`` as a float in [0, 1]; ValueError(``message`` naming ``name`` and the value) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(message.format(name=name, value=value))
    return float(value)


@dataclass(frozen=True, slots=True)
class StaticOffload:
    """Gemini's static offload fractions (module docstring); the fields are checked here only."""

    offload_optim_frac: float = 0.0
    """fraction of the trainable parameter bytes, leading ones first, whose optimizer state is on the host"""
    offload_param_frac: float = 0.0
    """fraction of the trainable parameter bytes, leading ones first, whose parameter is on the host"""

    RANGE_ERROR: ClassVar[str] = RANGE_ERROR  # how __post_init__ reports a field out of [0, 1]

    def __post_init__(self) -> None:
        for name in ("offload_optim_frac", "offload_param_frac"):
            object.__setattr__(self, name, fraction(getattr(self, name), name, self.RANGE_ERROR))

    def __str__(self) -> str:
        return f"static:{self.offload_optim_frac:g},{self.offload_param_frac:g}"

    @classmethod
    def parse(cls, text: str, *, what: str = "offload"):
        """The record whose ``str`` is ``text`` (``static:OPTIM,PARAM``); ValueError naming ``what``
        otherwise, or the record's own error for a bad fraction."""
        head, _, fracs = text.partition(":")
        try:
            optim, param = (float(x) for x in fracs.split(","))
        except ValueError:
            head = None
        if head != "static":
            raise ValueError(f"{what} takes none, auto or static:OPTIM,PARAM, got {text!r}")
        return cls(offload_optim_frac=optim, offload_param_frac=param)


@dataclass(frozen=True, slots=True)
class OffloadPolicy(StaticOffload):
    """The static fractions the planner prices (``autopar.plan(..., offload=OffloadPolicy(...))``):
    parameters are taken in graph order, their layouts and ZeRO stages are still the solver's.
    ``offload_param_frac > 0`` needs ``offload_optim_frac == 1``, as in Gemini, where a host
    parameter is updated by the CPU optimizer."""

    RANGE_ERROR: ClassVar[str] = "OffloadPolicy." + RANGE_ERROR

    def __post_init__(self) -> None:
        StaticOffload.__post_init__(self)  # slots dataclasses cannot use zero-argument super()
        if self.offload_param_frac > 0 and self.offload_optim_frac != 1.0:
            raise ValueError(f"offload_param_frac={self.offload_param_frac} needs offload_optim_frac=1.0 (a host "
                             f"parameter is updated on the host), got {self.offload_optim_frac}")


# What ``autopar.plan``'s ``offload`` takes: a mode, or the static fractions the planner prices.
OffloadOption = Union[OffloadMode, OffloadPolicy]


def check_offload(value, *, plan_given: bool = False) -> OffloadOption:
    """``"auto"``, ``"none"`` or an ``OffloadPolicy``; ValueError otherwise, or when it asks to plan
    offload for a run given a plan (``plan_given``), which brings its own offload decisions."""
    if not (isinstance(value, OffloadPolicy) or value in OFFLOAD_MODES):
        raise ValueError(f"offload must be 'auto', 'none' or an OffloadPolicy(...), got {value!r}")
    if plan_given and value != "none":
        raise ValueError(f"offload={value!r} with a given plan: the plan brings its own offload decisions "
                         f"(Plan.offload, made by autopar.plan(..., offload=...)); leave offload out")
    return value


def parse_offload(text: str, *, what: str = "offload") -> OffloadOption:
    """``none``, ``auto`` or ``static:OPTIM,PARAM`` (``str`` of an ``OffloadPolicy``) -> the option."""
    return text if text in OFFLOAD_MODES else OffloadPolicy.parse(text, what=what)


def runtime_options(options: dict, *, plan_given: bool) -> dict:
    """``autoparallelize``'s planning ``options`` (a dict with ``offload``, ``zero_stage``,
    ``checkpoint``) for a run with offload: the chunk runtime (``autopar.runtime.gemini``) holds
    ZeRO-1/2 (optimizer state, and the gradient under stage 2, sharded in the chunks) and
    activation recompute (a recomputed region re-fetches its chunks) as the plan chooses them:
    ``zero_stage`` and ``checkpoint`` as given, ZeRO stage 0 when left out."""
    if check_offload(options.get("offload", "none"), plan_given=plan_given) == "none":
        return options
    return {**options, "zero_stage": 0 if options.get("zero_stage") is None else options["zero_stage"]}
