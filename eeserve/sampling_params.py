"""Per-request sampling parameters, validated on construction (``ValueError`` names the field).

Also ``check_text(text, field)``: the one check that a request's text can be encoded at all (a
lone UTF-16 surrogate cannot), used on prompts, chat messages and stop strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eeserve.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """What vLLM users know. ``temperature == 0`` is greedy; ``top_k <= 0`` disables top-k."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # The shape the output must take (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            self.stop is None or isinstance(self.stop, (list, tuple)),
            "stop",
            "a string or a list of non-empty strings",
            self.stop,
        )
        self.stop = list(self.stop or [])
        _check(
            isinstance(self.stop_token_ids, (list, tuple)),
            "stop_token_ids",
            "a list of token ids >= 0",
            self.stop_token_ids,
        )
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_numbers()
        self._check_stops()

    def _check_numbers(self) -> None:
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _check(
            _is_num(self.temperature) and self.temperature >= 0,
            "temperature",
            "a number >= 0",
            self.temperature,
        )
        _check(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            "an integer (-1 or 0 disables it)",
            self.top_k,
        )
        _check(
            _is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p
        )
        _check(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            "seed",
            "an integer in [-2**63, 2**64) or None",
            self.seed,
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "an integer in [0, 20] or None",
            self.logprobs,
        )

    def _check_stops(self) -> None:
        assert isinstance(self.stop, list)
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
            self.stop,
        )
        for i, s in enumerate(self.stop):
            check_text(s, f"SamplingParams.stop[{i}]")
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of token ids >= 0",
            self.stop_token_ids,
        )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "a StructuredOutputsParams or None",
            self.structured_outputs,
        )
        # The grammar's end is the end of the sequence: nothing may follow it.
        _check(
            not (self.ignore_eos and self.structured_outputs is not None),
            "ignore_eos",
            "False when structured_outputs is set (the end of the grammar ends the output)",
            self.ignore_eos,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def argmax_only(self) -> bool:
        """Only the argmax of a step's logits is read (over the allowed tokens, under a
        constraint): greedy, no logprobs."""
        return self.greedy and self.logprobs is None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    # Finite only: NaN and infinities would turn the sampling distribution into NaN.
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")


def check_text(text: str, field: str) -> None:
    """``ValueError`` naming ``field`` when ``text`` holds a lone surrogate (not encodable)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{field} is not valid Unicode text: a lone surrogate U+{ord(text[e.start]):04X} "
            f"at position {e.start}"
        ) from None
