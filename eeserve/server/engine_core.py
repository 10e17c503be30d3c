"""The engine's side of the engine loop: the thread that owns an ``LLMEngine``, runs the commands
posted to it and steps the engine while it has work, reporting all it did as plain data.

Contract:
- ``EngineCore(engine, emit, nice)``; ``run()`` on the thread that is to own the engine (the
  engine loop's worker thread in the serving process, or the engine process's) until ``Stop``
  or a crash. From then on only that thread touches the engine; other threads ``post`` commands
  (a deque plus a wake-up event, so no lock on the engine). ``nice``: how much nicer than its
  creator the running thread makes itself (threads it starts, torch's, inherit it).
- Commands: ``Add`` (a group of engine requests, all or none: ``engine_requests.admit``),
  ``Abort`` (the named requests still running), ``Drain`` (every unfinished request fails at
  ``deadline``, monotonic seconds), ``Stop``. ``post`` returns False once the core has ended.
- Everything reaches the consumer through ``emit(report)``, in order, from the running thread:
  ``Reply`` (an ``Add``'s prompt token ids, or the error it raised), ``Stepped`` (an engine
  step: its outputs, seconds, prompt tokens computed, generated tokens are the consumer's to
  count), ``Failed`` (requests ended by a drain's deadline, an engine error or the core's end,
  with the message and HTTP status they end with), ``Aborted`` (after a round of commands that
  aborted requests). Each carries the engine's ``Gauges`` after it.
- The outputs' ``prompt_token_ids`` are left empty: the consumer has them from the ``Reply``,
  and an engine process need not send a long prompt again with every step.
- ``EngineHost`` names where a serving process runs its core: a thread of its own, or a process
  of its own (``engine_host``).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.outputs import RequestOutput
from eeserve.server.engine_requests import ChoiceSpec, admit

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


class EngineHost(enum.Enum):
    """Where a serving process steps its engine."""

    THREAD = "thread"  # a thread of the serving process
    PROCESS = "process"  # a process of its own, so that it never holds the HTTP side's GIL


# -- commands -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Add:
    id: int
    request_ids: list[str]
    choices: list[ChoiceSpec]
    exit_params: ExitParams | None


@dataclass(frozen=True, kw_only=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True, kw_only=True)
class Drain:
    deadline: float  # time.monotonic()


@dataclass(frozen=True, kw_only=True)
class Stop:
    pass


Command = Add | Abort | Drain | Stop


# -- reports ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Gauges:
    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks: int


@dataclass(frozen=True, kw_only=True)
class Reply:
    id: int
    gauges: Gauges
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    error: BaseException | None = None


@dataclass(frozen=True, kw_only=True)
class Stepped:
    gauges: Gauges
    outputs: list[RequestOutput]
    seconds: float
    prefilled: int
    at: float  # time.monotonic() when the step ended


@dataclass(frozen=True, kw_only=True)
class Failed:
    gauges: Gauges
    request_ids: list[str]
    message: str
    status: int


@dataclass(frozen=True, kw_only=True)
class Aborted:
    gauges: Gauges  # after the aborts of one round of commands (their KV blocks freed)


Report = Reply | Stepped | Failed | Aborted


class EngineCore:
    def __init__(self, engine: LLMEngine, emit: Callable[[Report], None], nice: int = 0) -> None:
        self.engine = engine
        self.nice = nice
        self._emit = emit
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._running: set[str] = set()  # request ids added and not finished or aborted
        self._stopping = False
        self._deadline: float | None = None
        self._closing = threading.Lock()
        self._closed = False

    def post(self, command: Command) -> bool:
        with self._closing:
            if self._closed:
                return False
            self._commands.append(command)
        self._wake.set()
        return True

    def run(self) -> None:
        message = "the server shut down before the request finished"
        if self.nice:  # Linux: a thread's own niceness (PRIO_PROCESS with its thread id)
            own = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, own, os.getpriority(os.PRIO_PROCESS, own) + self.nice)
        try:
            while not self._stopping:
                self._wake.clear()
                self._run_commands()
                if self._stopping:
                    break
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._fail_all(message)
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait(_IDLE_WAIT_S)
        except BaseException:
            log.exception("the engine thread crashed")
            message = "the engine thread crashed"
            raise
        finally:
            with self._closing:  # commands posted from now on are refused
                self._stopping = self._closed = True
            self._run_commands()
            self._fail_all(message)

    # -- commands -------------------------------------------------------------------------------

    def _run_commands(self) -> None:
        aborted = False
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, Add):
                self._add(cmd)
            elif isinstance(cmd, Abort):
                self._abort(cmd.request_ids)
                aborted = True
            elif isinstance(cmd, Drain):
                self._deadline = cmd.deadline
            else:
                self._stopping = True
        if aborted:
            self._emit(Aborted(gauges=self._gauges()))

    def _add(self, cmd: Add) -> None:
        try:
            prompts = admit(self.engine, cmd.request_ids, cmd.choices, cmd.exit_params)
        except Exception as e:  # the caller's to answer (a 400, or the engine's refusal)
            self._emit(Reply(id=cmd.id, gauges=self._gauges(), error=e))
            return
        self._running.update(cmd.request_ids)
        self._emit(Reply(id=cmd.id, gauges=self._gauges(), prompt_token_ids=prompts))

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid in self._running:
                self._running.discard(rid)
                self.engine.abort_request(rid)

    def _fail_all(self, message: str, status: int = 503) -> None:
        if not self._running:
            return
        ids = sorted(self._running)
        self._abort(ids)
        self._emit(Failed(gauges=self._gauges(), request_ids=ids, message=message, status=status))

    # -- steps ----------------------------------------------------------------------------------

    def _step(self) -> None:
        prefilling = self._prefilling()
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(f"engine error: {type(e).__name__}: {e}", 500)
            return
        took = time.perf_counter() - start
        mine = [replace(o, prompt_token_ids=[]) for o in outputs if o.request_id in self._running]
        for out in mine:
            if out.finished:
                self._running.discard(out.request_id)
        self._emit(
            Stepped(
                gauges=self._gauges(),
                outputs=mine,
                seconds=took,
                prefilled=_prefilled(prefilling),
                at=time.monotonic(),
            )
        )
        if not outputs:
            time.sleep(0.001)  # nothing schedulable right now; do not spin

    def _prefilling(self) -> list[tuple[Any, int]]:
        """The sequences with prompt tokens still to compute, and how many they have computed
        (``_prefilled`` after the step)."""
        sched = self.engine.scheduler
        return [
            (s, s.num_computed_tokens)
            for s in chain(sched.running, sched.waiting)
            if s.num_computed_tokens < s.num_prompt_tokens
        ]

    def _gauges(self) -> Gauges:
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        return Gauges(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks=bm.num_blocks,
        )


def _prefilled(before: list[tuple[Any, int]]) -> int:
    """Prompt tokens computed since ``EngineCore._prefilling`` took ``before`` (a preempted
    sequence, which starts again from 0, counts none)."""
    return sum(
        max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - done) for seq, done in before
    )
