"""Where the engine core runs: a thread of the serving process, or a process of its own.

Contract: ``host_for(kind, engine, nice)`` is a ``ThreadHost`` or a ``ProcessHost`` for an
``engine_core.EngineCore`` over ``engine``. ``start(loop, on_report)`` (on the asyncio event
loop's thread) starts the core; every report reaches ``on_report`` on that loop's thread, in
order. ``post(command)`` hands a command over (False once the core has ended: the caller
answers it as a shutdown); ``alive`` says whether the core still runs; ``stop(timeout)`` ends
it (the core fails what still runs, and those reports are handled before ``stop`` returns
where the host can wait for them) and waits up to ``timeout`` seconds. ``on_end`` (set before
``start``) is called once, on the loop, when a process host sees its engine process gone.

Why a process. In one process, the event loop that answers 429s, ``/health`` and streams takes
turns with the engine's Python for the interpreter's lock: under a burst every answer waits
behind engine steps. The process host forks the serving process once its engine is built
(the child inherits the engine as it is, nothing is loaded twice) and the two talk over two
pipes of pickled ``engine_core`` commands and reports; the child drops the parent's sockets
and signal handlers, steps the engine on a fresh thread (a forked thread may carry an OpenMP
pool that the child cannot use) and exits when the parent's pipe closes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Protocol

from eeserve.engine.llm_engine import LLMEngine
from eeserve.server.engine_core import Command, EngineCore, EngineHost, Report, Stop

log = logging.getLogger(__name__)

OnReport = Callable[[Report], None]


class Host(Protocol):
    on_end: Callable[[], None] | None

    def start(self, loop: asyncio.AbstractEventLoop, on_report: OnReport) -> None: ...
    def post(self, command: Command) -> bool: ...
    @property
    def alive(self) -> bool: ...
    @property
    def started(self) -> bool: ...
    def stop(self, timeout: float) -> None: ...


def host_for(kind: EngineHost, engine: LLMEngine, nice: int) -> ThreadHost | ProcessHost:
    return ThreadHost(engine, nice) if kind is EngineHost.THREAD else ProcessHost(engine, nice)


class ThreadHost:
    """The core on a thread of this process; reports reach the loop by ``call_soon_threadsafe``."""

    def __init__(self, engine: LLMEngine, nice: int) -> None:
        self.engine = engine
        self.nice = nice
        self.on_end: Callable[[], None] | None = None
        self.thread: threading.Thread | None = None
        self._core: EngineCore | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_report: OnReport) -> None:
        def emit(report: Report) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(on_report, report)

        self._core = EngineCore(self.engine, emit, self.nice)
        self.thread = threading.Thread(target=self._core.run, name="eeserve-engine", daemon=True)
        self.thread.start()

    def post(self, command: Command) -> bool:
        return self._core is not None and self._core.post(command)

    @property
    def started(self) -> bool:
        return self.thread is not None

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self, timeout: float) -> None:
        self.post(Stop())
        if self.thread is not None:
            self.thread.join(timeout)


class ProcessHost:
    """The core in a forked process; reports come back through a pipe the loop reads."""

    def __init__(self, engine: LLMEngine, nice: int) -> None:
        self.engine = engine
        self.nice = nice
        self.on_end: Callable[[], None] | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self._commands: Connection | None = None
        self._reports: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_report: OnReport | None = None
        self._open = False

    def start(self, loop: asyncio.AbstractEventLoop, on_report: OnReport) -> None:
        ctx = multiprocessing.get_context("fork")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._reports, reports_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_child,
            args=(self.engine, self.nice, commands_in, reports_out, self._commands, self._reports),
            name="eeserve-engine",
            daemon=True,
        )
        self.process.start()
        commands_in.close()
        reports_out.close()
        self._loop, self._on_report, self._open = loop, on_report, True
        loop.add_reader(self._reports.fileno(), self._readable)
        # uvloop sets a watched descriptor non-blocking; a report longer than the pipe's buffer
        # must be read whole, and the engine process writes the rest of it at once.
        os.set_blocking(self._reports.fileno(), True)

    def post(self, command: Command) -> bool:
        if not self._open or self._commands is None:
            return False
        try:
            self._commands.send(command)
        except OSError:  # the engine process is gone; its end is seen on the report pipe
            return False
        return True

    @property
    def started(self) -> bool:
        return self.process is not None

    @property
    def alive(self) -> bool:
        return self._open

    def stop(self, timeout: float) -> None:
        """Stop the engine process, handling its last reports (the failures of what still ran)
        here, and wait for it to exit (killed after ``timeout`` seconds)."""
        if self.process is None:
            return
        self.post(Stop())
        end = time.monotonic() + timeout
        while self._open and self._reports is not None:
            if not self._reports.poll(max(0.0, end - time.monotonic())):
                break
            self._read_one()
        self._close()
        self.process.join(max(0.0, end - time.monotonic()))
        if self.process.is_alive():
            log.warning("the engine process did not stop within %g s: killed", timeout)
            self.process.kill()
            self.process.join()

    def _readable(self) -> None:
        while self._open and self._reports is not None and self._reports.poll():
            self._read_one()

    def _read_one(self) -> None:
        assert self._reports is not None and self._on_report is not None
        try:
            report = self._reports.recv()
        except (EOFError, OSError):
            self._close()
            return
        self._on_report(report)

    def _close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._loop is not None and self._reports is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._reports.fileno())
        for conn in (self._commands, self._reports):
            if conn is not None:
                conn.close()
        if self.on_end is not None:
            self.on_end()


# -- the engine process -------------------------------------------------------------------------


def _child(
    engine: LLMEngine,
    nice: int,
    commands: Connection,
    reports: Connection,
    *parent_ends: Connection,
) -> None:
    """The engine process: the core on a fresh thread, commands read on this one."""
    # What the serving process left on the heap is never collected here: its finalizers (a
    # Ray replica's object references among them) are the parent's to run, and pages the
    # collector does not touch stay shared with the parent.
    gc.freeze()
    for conn in parent_ends:
        conn.close()
    _detach(keep=(commands.fileno(), reports.fileno()))

    def emit(report: Report) -> None:
        reports.send(report)

    core = EngineCore(engine, emit, nice)

    def run() -> None:
        code = 0
        try:
            core.run()
        except BaseException:
            code = 1
        finally:
            reports.close()  # the parent sees the end
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # the reader below may be blocked in recv

    threading.Thread(target=run, name="eeserve-engine", daemon=True).start()
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):  # the serving process is gone: stop
            command = Stop()
        if not core.post(command) or isinstance(command, Stop):
            break
    threading.Event().wait()  # the core's thread ends the process


def _detach(keep: tuple[int, ...]) -> None:
    """Drop what the serving process had set up for itself: its signal handlers (a Ctrl-C is the
    parent's to handle; it stops the child through the pipe) and its sockets (the listener must
    close when the parent closes it, and connections end when the parent ends them)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, already closed
