"""Two child processes with independent lifecycles.

Each child (the engine server, the bridge) is restarted on its own when it
dies, with backoff: 0.5 s doubling up to 10 s, back to 0.5 s once a run has
lasted a minute. Neither restart touches the other child: the bridge reconnects
to a restarted engine server by itself, and the engine server does not care
about its bridge.

Every child is started in its own session (a terminal's Ctrl-C, or a
``killpg`` of the launcher's group, reaches the launcher, which drains both)
with a parent-death signal: when the launcher dies, even by SIGKILL, the
kernel sends each child SIGTERM, and each drains and exits. The launcher stops
them one after the other (``stop_in_order``): the bridge first, since its
requests in flight need the engine server until they end.

Output: each child's stdout and stderr pass through to the launcher's stdout
and stderr, line by line, each line prefixed ``[engine-server PID] `` or
``[bridge PID] ``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

log = logging.getLogger("engine_worker")

_PR_SET_PDEATHSIG = 1
# A line longer than this is passed on in pieces.
_LINE_LIMIT = 1 << 20
USAGE_ERROR = 2


@dataclass(frozen=True)
class Backoff:
    """The pause before restart n is ``min(max_s, initial_s * 2**(n-1))``; a child
    that ran ``reset_after_s`` counts as healthy again (next pause: ``initial_s``)."""

    initial_s: float = 0.5
    max_s: float = 10.0
    reset_after_s: float = 60.0

    def delay(self, failures: int) -> float:
        return float(min(self.max_s, self.initial_s * 2 ** max(0, failures - 1)))


def death_signal_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` arming SIGTERM on the launcher's death (Linux), or None.
    libc is loaded here, in the parent: the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the signal was armed
            os._exit(1)

    return arm


class Child:
    """One program, run until ``stop()``, restarted with backoff when it dies."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        backoff: Backoff,
        on_fatal: Callable[[int], None],
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.backoff = backoff
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = None
        self._on_fatal = on_fatal
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def pid(self) -> int | None:
        process = self.process
        return process.pid if process is not None and process.returncode is None else None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def _spawn(self) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=death_signal_setter(),
        )

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            started = time.monotonic()
            try:
                process = await self._spawn()
            except OSError as e:
                failures += 1
                pause = self.backoff.delay(failures)
                log.error("starting %s failed (%s); trying again in %.1fs", self.name, e, pause)
                await self._pause(pause)
                continue
            self.process = process
            log.info("%s started (pid %d)", self.name, process.pid)
            assert process.stdout is not None and process.stderr is not None
            prefix = f"[{self.name} {process.pid}] ".encode()
            await asyncio.gather(
                _pump(process.stdout, sys.stdout.buffer, prefix),
                _pump(process.stderr, sys.stderr.buffer, prefix),
            )
            code = await process.wait()
            if self._stopping:
                log.info("%s (pid %d) stopped with %s", self.name, process.pid, code)
                return
            ran = time.monotonic() - started
            if code == USAGE_ERROR and self.restarts == 0 and ran < self.backoff.reset_after_s:
                # Its first run refused the configuration: restarting cannot help.
                log.error("%s (pid %d) refused its arguments (exit 2)", self.name, process.pid)
                self._on_fatal(USAGE_ERROR)
                return
            failures = 1 if ran >= self.backoff.reset_after_s else failures + 1
            self.restarts += 1
            pause = self.backoff.delay(failures)
            log.error(
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
        """No more restarts; SIGTERM the child now."""
        self._stopping = True
        self._wake.set()
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM, up to ``timeout_s`` to exit, then SIGKILL."""
        self.terminate()
        process = self.process
        if process is not None and process.returncode is None:
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                log.error(
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), 5)  # its output's last lines
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def stop_in_order(children: Sequence[Child], budget_s: float, floor_s: float) -> None:
    """Stop ``children`` one after the other, all within ``budget_s`` (the worker's
    15 s under NeMo RL), each given what is left of it but at least ``floor_s``,
    so that one that hangs still leaves the next a chance to drain."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    for child in children:
        await child.stop(max(deadline - loop.time(), floor_s))


async def _pump(reader: asyncio.StreamReader, out: BinaryIO, prefix: bytes) -> None:
    """``reader``'s lines onto ``out``, each prefixed."""
    pending = b""
    while chunk := await reader.read(1 << 16):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > _LINE_LIMIT:
            lines.append(pending)
            pending = b""
        if lines:
            _write(out, b"".join(prefix + line + b"\n" for line in lines))
    if pending:
        _write(out, prefix + pending + b"\n")


def _write(out: BinaryIO, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):  # a closed stream loses output, not children
        out.write(data)
        out.flush()
