"""Child processes kept running: the one supervisor of every program we start
as a child (``engine_server.host``: the bridge beside a host's own engine;
``engine_worker``: the engine server and the bridge).

A ``ChildProcess`` owns one program's life:

- restarts: a child that dies is started again after a pause
  (``RestartPolicy``: 0.5 s doubling up to 10 s, each within +-20% so that a
  fleet's children do not retry in step, back to 0.5 s once a run has lasted
  a minute). Restarting cannot help where its first run refused its arguments
  (exit 2) or where the program cannot be started at all: the owner hears of
  it (``on_fatal``; a first start's failure is also raised by
  ``wait_started``), and an owner that does not ask keeps it restarting;
- its parent's death: each child runs in a session of its own (a terminal's
  Ctrl-C, or a ``killpg`` of the parent's group, reaches the parent, which
  stops its children in order) and, with ``arm_death_signal``, gets the
  kernel's parent-death signal armed before it runs (``launch.parent_death``;
  a threaded parent names itself in the child's environment instead);
- draining: ``stop()`` sends SIGTERM, waits, then kills; ``stop_in_order``
  stops several one after the other within one budget, each given what is
  left of it but at least a floor (the bridge before the engine server: its
  requests in flight need the engine server until they end);
- output: each line, prefixed ``[NAME PID] ``, passed through to the parent's
  stdout and stderr (``PassThrough``) or into its logging (``IntoLogging``,
  each line at the level it names);
- what a run leaves behind: ``after_exit`` clears it before the next run starts
  (the bridge's etcd leases: ``launch.leases``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from launch.parent_death import death_signal_setter

log = logging.getLogger(__name__)

# Exit status of a program that refused its command line (argparse's).
USAGE_ERROR = 2
# Exit status an owner is given for a child that could not be started at all.
START_FAILED = 1
# A line longer than this is passed on in pieces.
_LINE_LIMIT = 1 << 20
# How long stop() waits for a stopped child's last lines of output.
_OUTPUT_DRAIN_S = 5.0


@dataclass(frozen=True)
class RestartPolicy:
    """The pause before restart n is ``min(max_s, initial_s * 2**(n-1))`` times a
    random factor in [1-jitter, 1+jitter]; a child that ran ``reset_after_s``
    counts as healthy again (its next pause: about ``initial_s``)."""

    initial_s: float = 0.5
    max_s: float = 10.0
    jitter: float = 0.2
    reset_after_s: float = 60.0

    def delay(self, failures: int) -> float:
        base = min(self.max_s, self.initial_s * 2 ** max(0, failures - 1))
        return float(base * random.uniform(1 - self.jitter, 1 + self.jitter))


class Output(Protocol):
    """Where a child's output goes."""

    # Whether the child's stderr is sent down its stdout.
    merged: bool

    async def forward(self, process: asyncio.subprocess.Process, prefix: str) -> None:
        """Until the child closes its output."""
        ...


async def _lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """``reader``'s lines without their newline (one over the limit in pieces)."""
    pending = b""
    while chunk := await reader.read(1 << 16):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > _LINE_LIMIT:
            lines.append(pending)
            pending = b""
        for line in lines:
            yield line
    if pending:
        yield pending


class PassThrough:
    """Each line onto the parent's own stdout or stderr, as the child wrote it."""

    merged = False

    async def forward(self, process: asyncio.subprocess.Process, prefix: str) -> None:
        assert process.stdout is not None and process.stderr is not None
        await asyncio.gather(
            self._pump(process.stdout, sys.stdout.buffer, prefix.encode()),
            self._pump(process.stderr, sys.stderr.buffer, prefix.encode()),
        )

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, out: BinaryIO, prefix: bytes) -> None:
        async for line in _lines(reader):
            with contextlib.suppress(OSError, ValueError):  # a closed stream loses output only
                out.write(prefix + line + b"\n")
                out.flush()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL = re.compile(r"\b(TRACE|DEBUG|INFO|WARN|WARNING|ERROR|CRITICAL)\b")
_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


def _level(line: str) -> int:
    match = _LEVEL.search(line[:80])
    return _LEVELS[match.group(1)] if match else logging.INFO


class IntoLogging:
    """Each line (stdout and stderr together, colours removed) into ``logger``, at
    the level the line names near its start (INFO if none): a host's own
    logging then shows, filters and ships it."""

    merged = True

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    async def forward(self, process: asyncio.subprocess.Process, prefix: str) -> None:
        assert process.stdout is not None
        async for line in _lines(process.stdout):
            text = _ANSI.sub("", line.decode(errors="replace")).rstrip()
            if text:
                self.logger.log(_level(text), "%s%s", prefix, text)


class ChildProcess:
    """One program, run until ``stop()``, restarted when it dies (module docs)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        output: Output,
        restart: RestartPolicy | None = None,
        arm_death_signal: bool = False,
        on_fatal: Callable[[int], None] | None = None,
        logger: logging.Logger = log,
        first: asyncio.subprocess.Process | None = None,
        after_exit: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """``first``: a process already running the program, started as ``_spawn``
        starts one (its own session, stdout and stderr piped apart, the death
        signal armed as asked), adopted as the first run (stopped by ``stop()``
        from now on); restarts run ``argv``. ``after_exit``: awaited with the exit
        status each time a run has exited, before the next starts (what the run
        left behind, cleared)."""
        if first is not None and output.merged:
            raise ValueError("an adopted process's stderr is a pipe of its own: not merged")
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.output = output
        self.restart = restart or RestartPolicy()
        self.arm_death_signal = arm_death_signal
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = first
        self._on_fatal = on_fatal
        self._log = logger
        self._first = first
        self._after_exit = after_exit
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._started = asyncio.Event()
        # Clear while a process is being spawned: stop() waits for it, so that a
        # child started just as it was asked to stop is stopped too.
        self._not_spawning = asyncio.Event()
        self._not_spawning.set()

    @property
    def pid(self) -> int | None:
        process = self.process
        return process.pid if process is not None and process.returncode is None else None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def wait_started(self) -> None:
        """Until the first process runs; raises what prevented it."""
        assert self._task is not None
        started = asyncio.ensure_future(self._started.wait())
        await asyncio.wait({started, self._task}, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if not self._started.is_set():
            self._task.result()  # raises the start's failure
            raise RuntimeError(f"the {self.name} supervisor ended before the {self.name} started")

    async def _spawn(self) -> asyncio.subprocess.Process:
        pipe = asyncio.subprocess.PIPE
        return await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=pipe,
            stderr=asyncio.subprocess.STDOUT if self.output.merged else pipe,
            start_new_session=True,  # the parent's terminal signals are the parent's
            preexec_fn=death_signal_setter() if self.arm_death_signal else None,
        )

    def _fatal(self, code: int) -> bool:
        """Tell the owner restarting cannot help; False when it did not ask."""
        if self._on_fatal is None:
            return False
        self._on_fatal(code)
        return True

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            started = time.monotonic()
            self._not_spawning.clear()
            try:
                process = self._first or await self._spawn()
                self._first = None
            except OSError as e:
                self._not_spawning.set()
                if not self._started.is_set():
                    self._log.error("starting %s failed: %s", self.name, e)
                    self._fatal(START_FAILED)
                    raise  # the owner hears it (wait_started)
                failures += 1
                pause = self.restart.delay(failures)
                self._log.error(
                    "starting %s failed (%s); trying again in %.1fs", self.name, e, pause
                )
                await self._pause(pause)
                continue
            except BaseException:
                self._not_spawning.set()
                raise
            self.process = process
            self._not_spawning.set()
            self._started.set()
            self._log.info("%s started (pid %d)", self.name, process.pid)
            if self._stopping:  # terminate() came while it was being spawned
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
            await self.output.forward(process, f"[{self.name} {process.pid}] ")
            code = await process.wait()
            if self._after_exit is not None:
                try:
                    await self._after_exit(code)
                except Exception:  # its own failure: the child is still restarted
                    self._log.exception("clearing up after %s failed", self.name)
            if self._stopping:
                self._log.info("%s (pid %d) stopped with %s", self.name, process.pid, code)
                return
            ran = time.monotonic() - started
            if code == USAGE_ERROR and self.restarts == 0 and ran < self.restart.reset_after_s:
                # Its first run refused the configuration: restarting cannot help.
                if self._fatal(USAGE_ERROR):
                    self._log.error(
                        "%s (pid %d) refused its arguments (exit 2)", self.name, process.pid
                    )
                    return
            failures = 1 if ran >= self.restart.reset_after_s else failures + 1
            self.restarts += 1
            pause = self.restart.delay(failures)
            self._log.error(
                "%s (pid %d) exited with %s after %.1fs; restart %d in %.1fs",
                self.name,
                process.pid,
                code,
                ran,
                self.restarts,
                pause,
            )
            await self._pause(pause)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def terminate(self) -> None:
        """No more restarts; SIGTERM the child now (signal-handler safe)."""
        self._stopping = True
        self._wake.set()
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM, up to ``timeout_s`` to exit, then SIGKILL (a child being spawned
        as it is called included)."""
        self.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._not_spawning.wait(), timeout_s)
        process = self.process
        if process is not None and process.returncode is None:
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                self._log.error(
                    "%s (pid %d) did not stop in %.0fs: killing it",
                    self.name,
                    process.pid,
                    timeout_s,
                )
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        task, self._task = self._task, None
        if task is not None:
            await asyncio.wait({task}, timeout=_OUTPUT_DRAIN_S)  # its last lines of output
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def stop_in_order(children: Sequence[ChildProcess], budget_s: float, floor_s: float) -> None:
    """Stop ``children`` one after the other, all within ``budget_s``, each given
    what is left of it but at least ``floor_s``, so that one that hangs still
    leaves the next a chance to drain."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    for child in children:
        await child.stop(max(deadline - loop.time(), floor_s))
