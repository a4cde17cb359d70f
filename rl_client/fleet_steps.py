"""How the fleet cycle (``rl_client.fleet_cycle``) runs its steps: one step on every
worker at once, each within the step's deadline, its time and any failure written
into the worker's entry of the report; and a step run to its end though its caller
is cancelled meanwhile (a commit, an undo). No Dynamo import here: trainers install
only the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from rl_client.refit_report import WorkerRefit, error_text

__all__ = ["each_worker", "to_its_end"]


async def each_worker(
    entries: Iterable[WorkerRefit],
    stage: str,
    limit: float | None,
    step: Callable[[WorkerRefit], Awaitable[None]],
) -> None:
    """Run ``step`` on every entry at once, each within ``limit``; its time and any
    failure are written into the entry."""

    async def guarded(entry: WorkerRefit) -> None:
        started = time.monotonic()
        timer = asyncio.timeout(limit)
        try:
            async with timer:
                await step(entry)
        except TimeoutError as e:
            if timer.expired():
                entry.note_failure(
                    stage, f"did not answer within its {stage} deadline of {limit:g} s"
                )
            else:
                entry.note_failure(stage, error_text(e))
        except Exception as e:
            entry.note_failure(stage, error_text(e))
        finally:
            elapsed = time.monotonic() - started
            setattr(entry, f"{stage}_s", getattr(entry, f"{stage}_s") + elapsed)

    await asyncio.gather(*(guarded(e) for e in entries))


T = TypeVar("T")


async def to_its_end(step: Awaitable[T]) -> tuple[T, bool]:
    """``step`` run to its end even when the caller is cancelled meanwhile, and
    whether it was: the caller raises the cancellation once it has acted on the
    result (a record written, an undo finished).

    A cancellation that lands as the step ends (its result set, the caller not yet
    woken) still returns the result: a refit cancelled so, its record written, was
    reported as not committed (a CI-style run's chaos test, 2026-12-07)."""
    task = asyncio.ensure_future(step)
    cancelled = False
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError:
            if task.done():
                if task.cancelled() or task.exception() is not None:
                    raise
                return task.result(), True
            cancelled = True
