"""Engine options on the command line, derived from ``EngineConfig``'s fields.

Contract: ``add_engine_args`` adds one flag per ``EngineConfig`` field (``--field-name``, its
type, default, choices and help taken from the field; booleans as ``--x``/``--no-x``), except the
model, which each command names its own way; ``engine_config`` turns the parsed flags back into
a config. Nothing here repeats a default: a new field gets its flag by being declared.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from eeserve.config import EngineConfig

# Named by each command itself (a positional argument of ``serve``, ``--model`` elsewhere).
COMMAND_NAMED = ("model",)


def engine_fields() -> list[dataclasses.Field[Any]]:
    """The fields that are flags."""
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in COMMAND_NAMED]


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parser_type(annotation: Any) -> Callable[[str], Any]:
    """int, float or str from ``T`` or ``T | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if isinstance(annotation, types.UnionType) else annotation
    if base not in (int, float, str):
        raise TypeError(f"no command-line type for {annotation!r}")
    return base  # type: ignore[no-any-return]


def add_engine_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for f in engine_fields():
        meta = f.metadata
        names = [flag_of(f.name), *meta.get("aliases", ())]
        kind = hints[f.name]
        if kind is bool:
            p.add_argument(
                *names,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=meta["help"],
            )
            continue
        choices = meta.get("choices") or None
        shown = f" (default {f.default})" if f.default is not None and not choices else ""
        p.add_argument(
            *names,
            dest=f.name,
            type=_parser_type(kind),
            default=f.default,
            choices=choices,
            help=meta["help"] + shown,
        )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    options = {f.name: getattr(args, f.name) for f in engine_fields()}
    return EngineConfig(model=args.model, **options)
