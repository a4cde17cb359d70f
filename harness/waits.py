"""Polling until something holds. Every wait takes a timeout and raises
``WaitTimeout`` (a ``TimeoutError``) when it runs out, never returns quietly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")


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
