"""Running batch-file requests through one engine: the same validation and bodies as the server.

Contract: ``BatchProcessor(engine, model_names).run(items, emit)`` takes what
``batch.read_envelopes`` yields and calls ``emit`` with one output line per item, in completion
order. Each envelope's body goes through the server's ``parse_body`` and ``prepare`` (so
``early_exit`` works and every invalid body is the server's 400, as an error line) and
``engine_requests.admit``; the answer body is the server's ``Formatter.response``. Up to
``max_in_flight`` requests (default four times the engine's ``max_num_seqs``) are in the engine at
once, batched together by its scheduler; the input is read lazily. A request the engine fails on
becomes a 500 error line (the engine aborts it) and the run goes on; nothing here raises for a
bad line. ``stream: true`` is refused (a batch answers whole bodies).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from eeserve.engine.llm_engine import LLMEngine
from eeserve.outputs import CompletionOutput
from eeserve.server.batch import Envelope, api_error_line, success_line
from eeserve.server.engine_requests import admit
from eeserve.server.formatting import Formatter, TokenStrings
from eeserve.server.prepare import ApiError, ModelInfo, engine_refusal, parse_body, prepare

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]


@dataclass
class _Job:
    env: Envelope
    request_id: str
    fmt: Formatter
    prompt_lens: list[int]
    num_choices: int
    finals: dict[int, CompletionOutput] = field(default_factory=dict)


class BatchProcessor:
    def __init__(
        self, engine: LLMEngine, model_names: list[str], max_in_flight: int | None = None
    ) -> None:
        self.engine = engine
        self.info = ModelInfo(
            tokenizer=engine.tokenizer,  # one thread drives both: no copy needed
            model_names=list(model_names),
            max_model_len=engine.max_model_len,
            num_layers=engine.model_config.num_layers,
        )
        self.strings = TokenStrings(engine.tokenizer)
        self.max_in_flight = max_in_flight or 4 * engine.config.max_num_seqs
        self._jobs: dict[str, _Job] = {}
        self._owner: dict[str, tuple[_Job, int]] = {}  # engine request id -> (job, choice)

    def run(self, items: Iterable[Envelope | dict[str, Any]], emit: Emit) -> None:
        source = iter(items)
        more = True
        while True:
            while more and len(self._jobs) < self.max_in_flight:
                item = next(source, None)
                if item is None:
                    more = False
                elif isinstance(item, Envelope):
                    self._admit(item, emit)
                else:
                    emit(item)  # already an error line
            if self._jobs:
                self._step(emit)
            elif not more:
                return

    def _admit(self, env: Envelope, emit: Emit) -> None:
        request_id = uuid.uuid4().hex
        try:
            req = parse_body(env.kind, env.body)
            if req.stream:
                raise ApiError(400, "stream: a batch answers whole bodies", param="stream")
            prep = prepare(self.info, req, env.kind)
            rids = [f"{request_id}-{i}" for i in range(len(prep.specs))]
            try:
                admit(self.engine, rids, prep.specs, prep.exit_params)
            except ValueError as e:
                raise engine_refusal(e, prep) from e
        except ApiError as e:
            emit(api_error_line(env, request_id, e))
            return
        except Exception as e:  # a library fault on odd input: this line fails, the run goes on
            log.exception("line %d failed", env.line)
            error = ApiError(500, f"internal error: {type(e).__name__}", type_="server_error")
            emit(api_error_line(env, request_id, error))
            return
        fmt = Formatter(
            env.kind,
            req.model,
            self.strings,
            self.info.num_layers,
            len(prep.specs),
            prep.top_logprobs,
            prep.stop,
            tool_calls=prep.tool_calls,
        )
        job = _Job(env, request_id, fmt, prep.prompt_lens, len(prep.specs))
        self._jobs[request_id] = job
        for i, rid in enumerate(rids):
            self._owner[rid] = (job, i)

    def _step(self, emit: Emit) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(f"engine error: {type(e).__name__}: {e}", emit)
            return
        for out in outputs:
            if not out.finished or out.request_id not in self._owner:
                continue
            job, index = self._owner.pop(out.request_id)
            job.finals[index] = out.outputs[0]
            if len(job.finals) == job.num_choices:
                del self._jobs[job.request_id]
                finals = [job.finals[i] for i in range(job.num_choices)]
                body = job.fmt.response(finals, job.prompt_lens)
                emit(success_line(job.env.custom_id, job.request_id, body))

    def _fail_all(self, message: str, emit: Emit) -> None:
        for rid in list(self._owner):
            self.engine.abort_request(rid)
        self._owner.clear()
        jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            error = ApiError(500, message, type_="server_error", code="engine_error")
            emit(api_error_line(job.env, job.request_id, error))
