"""What shape a request's output must take: vLLM's ``StructuredOutputsParams``.

Contract: exactly one constraint is set: ``json`` (a JSON schema, as a dict or its text),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of a list of strings) or
``grammar`` (a Lark grammar, or a GBNF one, recognised by its ``::=`` rules). Construction
checks the shape (``ValueError`` naming the field); whether the library accepts the schema,
regex or grammar is checked when the engine compiles it (``engine.grammar``), also a
``ValueError`` naming the field. ``kind`` names the one that is set; ``key()`` is a canonical
text of the constraint (equal constraints compile once).
"""

from __future__ import annotations

import enum
import json as jsonlib
from dataclasses import dataclass
from typing import Any


class ConstraintKind(enum.StrEnum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in ConstraintKind if self._value(k) not in (None, False)]
        if len(set_) != 1:
            names = ", ".join(k.value for k in ConstraintKind)
            raise ValueError(
                f"StructuredOutputsParams takes exactly one of {names}; got "
                f"{', '.join(k.value for k in set_) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = jsonlib.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            object.__setattr__(self, "json", schema)
        _require(
            self.json is None or isinstance(self.json, dict),
            "json",
            "a JSON schema (an object)",
            self.json,
        )
        _require(isinstance(self.json_object, bool), "json_object", "a bool", self.json_object)
        _require(
            self.regex is None or (isinstance(self.regex, str) and self.regex != ""),
            "regex",
            "a non-empty string",
            self.regex,
        )
        _require(
            self.choice is None
            or (
                isinstance(self.choice, (list, tuple))
                and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice)
            ),
            "choice",
            "a non-empty list of non-empty strings",
            self.choice,
        )
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
        _require(
            self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
            "grammar",
            "a non-empty Lark or GBNF grammar",
            self.grammar,
        )

    def _value(self, kind: ConstraintKind) -> object:
        return {
            ConstraintKind.JSON: self.json,
            ConstraintKind.JSON_OBJECT: self.json_object,
            ConstraintKind.REGEX: self.regex,
            ConstraintKind.CHOICE: self.choice,
            ConstraintKind.GRAMMAR: self.grammar,
        }[kind]

    @property
    def kind(self) -> ConstraintKind:
        return next(k for k in ConstraintKind if self._value(k) not in (None, False))

    def key(self) -> str:
        """Canonical text of the constraint: equal constraints have equal keys."""
        return jsonlib.dumps([self.kind.value, self._value(self.kind)], sort_keys=True)


def _require(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"structured_outputs.{name} must be {expected}, got {value!r}")
