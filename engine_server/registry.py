"""Requests in flight on this server: admission of ids, aborts, and what finished.

The registry is the server's own view, kept apart from the engine's, so that a
duplicate id is refused before it reaches an engine that would merge the two
(vLLM aborts every request sharing an id), and so that Abort can tell
"aborted" from "already finished" from "never seen".
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine_server.errors import AbortedByPause, Draining, DuplicateRequest


class AbortOutcome(enum.Enum):
    ABORTED = "aborted"
    ALREADY_FINISHED = "already_finished"
    NOT_FOUND = "not_found"


@dataclass
class ActiveRequest:
    request_id: str
    abort_requested: bool = False
    # Aborted because the server is shutting down, not because anyone asked:
    # the caller gets a retryable error instead of a partial result.
    aborted_for_shutdown: bool = False
    # Aborted by PauseGeneration(ABORT): likewise a retryable error.
    aborted_for_pause: bool = False
    # The weight version a version-guarded request requires, set once it passed
    # the gate and the check (revision 8): from then on a weight change ends it.
    required_version: str | None = None
    # Ended by such a change: it answers what it made so far (WEIGHT_VERSION_CHANGED).
    weights_changed: bool = False
    # Set when the request has ended, whatever the reason.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by any abort (wakes a request waiting for a paused engine).
    interrupted: asyncio.Event = field(default_factory=asyncio.Event)

    def raise_if_ended(self) -> None:
        """Raise the error a request ended by the server (not by its client) answers."""
        if self.aborted_for_shutdown:
            raise Draining(
                "server shut down before the request finished (grace period over); "
                "retry it elsewhere"
            )
        if self.aborted_for_pause:
            raise AbortedByPause()


class RequestRegistry:
    """Tracks running requests by id; aborts go through ``engine_abort``."""

    def __init__(
        self, engine_abort: Callable[[str], Awaitable[None]], remember_finished: int
    ) -> None:
        self._engine_abort = engine_abort
        self._active: dict[str, ActiveRequest] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._remember_finished = remember_finished
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._active

    @contextmanager
    def track(self, request_id: str) -> Iterator[ActiveRequest]:
        """Register ``request_id`` for the duration of the block; refuse active duplicates."""
        if request_id in self._active:
            raise DuplicateRequest(request_id)
        entry = ActiveRequest(request_id)
        self._active[request_id] = entry
        self._idle.clear()
        try:
            yield entry
        finally:
            del self._active[request_id]
            entry.done.set()
            self._finished[request_id] = None
            self._finished.move_to_end(request_id)
            while len(self._finished) > self._remember_finished:
                self._finished.popitem(last=False)
            if not self._active:
                self._idle.set()

    async def abort(self, request_id: str) -> AbortOutcome:
        entry = self._active.get(request_id)
        if entry is None:
            if request_id in self._finished:
                return AbortOutcome.ALREADY_FINISHED
            return AbortOutcome.NOT_FOUND
        entry.abort_requested = True
        entry.interrupted.set()
        await self._engine_abort(request_id)
        return AbortOutcome.ABORTED

    async def abort_all(self, *, shutdown: bool = False) -> int:
        ids = list(self._active)
        for request_id in ids:
            entry = self._active.get(request_id)
            if entry is not None and shutdown:
                entry.aborted_for_shutdown = True
            await self.abort(request_id)
        return len(ids)

    def guarded(self) -> list[ActiveRequest]:
        """The version-guarded requests past the gate now."""
        return [e for e in self._active.values() if e.required_version is not None]

    def mark_all_for_pause(self) -> list[ActiveRequest]:
        """Every request registered now ends as aborted by a pause (the engine is
        told by the pause itself); returns them."""
        marked = list(self._active.values())
        for entry in marked:
            entry.aborted_for_pause = True
            entry.interrupted.set()
        return marked

    @staticmethod
    def unmark_for_pause(entries: list[ActiveRequest]) -> None:
        """The pause failed: those still running are not aborted by it."""
        for entry in entries:
            entry.aborted_for_pause = False
            if not entry.abort_requested and not entry.done.is_set():
                entry.interrupted.clear()

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight; False when the timeout passed first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
