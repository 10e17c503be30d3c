"""Engine configuration is declared once: ``EngineConfig``'s fields are the command-line flags.

Every field has a flag and every engine flag a field, with the field's default, so a new option
cannot be added in one place and forgotten in the other.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from eeserve.cli import _build_parser
from eeserve.config import EngineConfig, Weights
from eeserve.engine_args import COMMAND_NAMED, add_engine_args, engine_config, flag_of


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    add_engine_args(p)
    return p


def test_every_field_has_a_flag_and_every_flag_a_field() -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - set(COMMAND_NAMED)
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    dests = {a.dest for a in p._actions}
    assert dests == fields
    flags = {s for a in p._actions for s in a.option_strings}
    assert {flag_of(name) for name in fields} <= flags


def test_flag_defaults_are_the_config_defaults() -> None:
    assert engine_config(_parser().parse_args([])) == EngineConfig()


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
        (["--no-prefix-caching"], "enable_prefix_caching", False),
        (["--no-cpu-kernels"], "cpu_kernels", False),
        (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
        (["--max-num-batched-tokens", "300"], "max_num_batched_tokens", 300),
        (["--kv-cache-memory", "0.25"], "kv_cache_memory", 0.25),
        (["--attention-context", "0"], "attention_context", 0.0),
        (["--exit-policy", "batch_all"], "exit_policy", "batch_all"),
        (["--quantization", "int8"], "quantization", "int8"),
        (["--weights", "native"], "weights", Weights.NATIVE),
    ],
)
def test_flags_set_their_field(argv: list[str], field: str, value: object) -> None:
    assert getattr(engine_config(_parser().parse_args(argv)), field) == value


def test_choices_come_from_the_config() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kv-fill", "nope"])


def test_native_weights_take_no_int8() -> None:
    assert EngineConfig().weights is Weights.FLOAT32
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="q4")
    for other in ({"quantization": "int8"}, {"speculative_draft": "int8"}):
        with pytest.raises(ValueError, match="takes neither quantization"):
            EngineConfig(weights="native", **other)


@pytest.mark.parametrize("command", ["generate", "serve", "batch", "calibrate"])
def test_every_engine_command_takes_every_engine_flag(command: str) -> None:
    sub = next(
        a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - set(COMMAND_NAMED)
    assert {flag_of(name) for name in fields} <= flags
