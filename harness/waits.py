"""Polling until something holds. Every wait takes a timeout and raises
``WaitTimeout`` (a ``TimeoutError``) when it runs out, never returns quietly;
and ``Sampler``, for the order in which things happened."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, Self, TypeVar

T = TypeVar("T")
S = TypeVar("S")


class Watched(Protocol):
    """A process a wait gives up on early when it dies (``harness.procs.Proc``)."""

    name: str

    def check_alive(self) -> None: ...

    def log_tail(self, chars: int = ...) -> str: ...


class WaitTimeout(TimeoutError):
    """A wait ran out; ``last`` is the last value it saw (a load, a status, ...)."""

    def __init__(self, message: str, last: object = None) -> None:
        super().__init__(message)
        self.last = last


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    procs: Sequence[Watched] = (),
    interval: float = 0.1,
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that. Raises
    at once (RuntimeError with its log) when one of ``procs`` died, and WaitTimeout
    (with their logs) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in procs:
            proc.check_alive()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name} ---\n{p.log_tail(2000)}" for p in procs)
            raise WaitTimeout(f"{what}: not within {timeout}s\n{logs}", value)
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01
) -> T:
    """``wait_until`` on an event loop: the loop runs between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"{what}: not within {timeout}s", value)
        await asyncio.sleep(interval)


async def wait_until_probe_async(
    probe: Callable[[], Awaitable[T]],
    timeout: float,
    what: str,
    interval: float = 0.05,
    done: Callable[[T], object] = bool,
) -> T:
    """``wait_until_async`` for a probe that is awaited (a gRPC or HTTP call): until
    ``done(await probe())`` holds (by default: the answer is truthy), and return that
    answer. The WaitTimeout names the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"{what}: not within {timeout}s; last: {value!r:.1000}", value)
        await asyncio.sleep(interval)


async def settle(count: Callable[[], int], quiet_s: float = 0.2, within_s: float = 5.0) -> None:
    """Wait until ``count()`` (e.g. KV batches received) stops changing for ``quiet_s``.

    Not a wait for a condition: something that never goes quiet is the caller's
    to judge, so this returns after ``within_s`` either way."""
    deadline = time.monotonic() + within_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


class Sampler(Generic[S]):
    """``take()`` every ``interval_s`` on a thread of its own while in its block,
    the samples kept in order: for checks on the order of two things other
    processes do (a worker listed before its engine was ready), which a wait for
    the final state cannot see. ``on_close`` runs after the last sample."""

    def __init__(
        self,
        take: Callable[[], S],
        interval_s: float = 0.01,
        on_close: Callable[[], object] | None = None,
    ) -> None:
        self.samples: list[S] = []
        self._take, self._interval_s, self._on_close = take, interval_s, on_close
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        if self._on_close is not None:
            self._on_close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._take())
            self._stop.wait(self._interval_s)
