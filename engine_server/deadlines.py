"""Engine steps awaited to their end or their deadline, and blocking checks on threads
of their own.

Apart from the refit rules because every refit step needs both, and neither is a
rule: an engine step (a load, a transfer phase) cannot be stopped half way, so a
caller that leaves must not stop the waiting either (``to_the_end``), yet no step
may hold the refit lock for good (its ``timeout_s``); and a check stuck in the
kernel (a hung network mount) must not keep a pool's thread or the process
(``in_daemon_thread``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Expired(Exception):
    """An engine step ran past its deadline; it may still be running, unawaited."""


async def to_the_end(step: Awaitable[T], timeout_s: float | None = None) -> T:
    """Run an engine step to its end even when the caller is cancelled (a client's
    deadline or disconnect): the lock stays held and the state stays true to what
    the engine did; the cancellation is raised afterwards. With ``timeout_s``,
    waiting stops there (``Expired``, the step left running): the caller says
    what that leaves, and the lock is released."""
    task = asyncio.ensure_future(step)
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    cancelled = False
    while not task.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            task.add_done_callback(_ended_late)
            raise Expired
        try:
            await asyncio.wait({task}, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the caller left, the cancellation wins
        raise asyncio.CancelledError
    return task.result()


def _ended_late(task: asyncio.Future[Any]) -> None:
    """A step given up on at its deadline ended after all: say how, once."""
    if task.cancelled():
        log.warning("a refit step given up on at its deadline was cancelled")
    elif task.exception() is not None:
        log.warning("a refit step given up on at its deadline failed: %s", task.exception())
    else:
        log.warning("a refit step given up on at its deadline ended after all")


def in_daemon_thread(work: Callable[[], T]) -> asyncio.Future[T]:
    """``work`` on a thread of its own, a daemon: a check stuck in the kernel (a
    hung network mount) then neither keeps a pool's thread for good nor keeps the
    process from exiting, as a thread of the default executor would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # given up on (the deadline, a cancelled caller)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result: T | None = work()
            error: BaseException | None = None
        except BaseException as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="refit-check", daemon=True).start()
    return future
