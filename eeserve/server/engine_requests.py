"""A group of engine requests added all or none: what one API request asks of the engine.

Contract: a ``ChoiceSpec`` is one engine request (the prompt's text, kept for the record, its
token ids and its sampling parameters). ``admit(engine, request_ids, choices, exit_params)``
resolves the exit parameters against the model's exit config first (``RequestRejected`` with
``param="early_exit"`` when they cannot be), then adds one engine request per choice; if the
engine refuses any (``ValueError``, e.g. a prompt longer than the context), those already added
are aborted and the error is raised. It returns each request's prompt token ids. It runs on
whatever thread owns the engine: ``EngineLoop``'s worker, or a batch file's own engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.sampling_params import SamplingParams


class RequestRejected(ValueError):
    """The engine refused a request because of ``param`` (a request field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[RequestRejected], tuple[str, str]]:
        # Pickled as it is made (it crosses from an engine process to the server).
        return (RequestRejected, (str(self), self.param))


@dataclass
class ChoiceSpec:
    """One engine request: a prompt (text kept for the record, ids already tokenized)."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


def admit(
    engine: LLMEngine, request_ids: list[str], choices: list[ChoiceSpec], ep: ExitParams | None
) -> list[list[int]]:
    """Add a group of engine requests, all or none (the engine's ``ValueError`` is raised after
    aborting those already added); returns each one's prompt token ids."""
    _check_exit_params(engine, ep)
    added: list[str] = []
    prompts: list[list[int]] = []
    try:
        for rid, spec in zip(request_ids, choices):
            ids = spec.prompt_token_ids
            if spec.prompt is None:
                ids = engine.tokenize(ids)  # validates the token ids
            engine.add_request(
                spec.prompt if spec.prompt is not None else ids,
                spec.params,
                request_id=rid,
                prompt_token_ids=ids,
                exit_params=ep,
            )
            added.append(rid)
            prompts.append(ids)
    except BaseException:
        for rid in added:
            engine.abort_request(rid)
        raise
    return prompts


def _check_exit_params(engine: LLMEngine, ep: ExitParams | None) -> None:
    """Resolve the exit plan up front, so that its errors are told apart from the prompt's."""
    cfg = getattr(engine, "exit_config", None)
    if ep is None or cfg is None or engine.config.exit_policy == "none":
        return
    try:
        engine.exit_plan(ep)
    except ValueError as e:
        raise RequestRejected(str(e), "early_exit") from e
