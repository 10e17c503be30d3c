"""A request's output shape, from its HTTP fields to the engine's ``StructuredOutputsParams``.

Contract: ``structured_params(req)`` reads OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema`` with ``strict``), vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` and vLLM's ``structured_outputs`` object, and returns the
one constraint they set (None: free text). More than one of them, or a constraint that
``StructuredOutputsParams`` refuses, raises ``ConstraintError`` with the field to name in the 400.
Whether the grammar library accepts the schema, regex or grammar is the engine's check, when it
compiles the request (its ``ValueError`` also names the field). Under ``strict`` every object of
the schema that lists properties and says nothing of others takes no others, as OpenAI's strict
mode requires them to say.
"""

from __future__ import annotations

from typing import Any

from eeserve.server.protocol import ChatCompletionRequest, CompletionRequest
from eeserve.structured_outputs import StructuredOutputsParams


class ConstraintError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_params(
    req: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    given = _given(req)
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ConstraintError(f"give at most one output constraint, got {names}", given[1][0])
    if not given:
        return None
    param, kwargs = given[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise ConstraintError(f"{param}: {e}", param) from None


def constraint_field(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request field that sets its output's constraint (None: free text)."""
    given = _given(req)
    return given[0][0] if given else None


def _given(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, dict[str, Any]]]:
    """(field, StructuredOutputsParams arguments) for every constraint field the request sets."""
    out: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.json_schema is not None:
        schema = dict(rf.json_schema.schema_)
        if rf.json_schema.strict:
            schema = closed_objects(schema)
        out.append(("response_format.json_schema.schema", {"json": schema}))
    guided = {
        "guided_json": ("json", req.guided_json),
        "guided_regex": ("regex", req.guided_regex),
        "guided_choice": ("choice", req.guided_choice),
        "guided_grammar": ("grammar", req.guided_grammar),
    }
    out += [(name, {key: v}) for name, (key, v) in guided.items() if v is not None]
    so = req.structured_outputs
    if so is not None:
        kwargs = {
            "json": so.json_,
            "json_object": bool(so.json_object),
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
        }
        out.append(("structured_outputs", {k: v for k, v in kwargs.items() if v is not None}))
    return out


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and does not say (OpenAI's strict mode), at any depth."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
