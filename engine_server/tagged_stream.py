"""TaggedStream: many requests over one bidirectional call, answered in batches.

A gRPC call costs each side far more CPU than the protobuf work of a small
request, so a busy client multiplexes its requests over one stream, each under
a tag of its choosing. Each started request runs as its own task (as its own
call would); what it answers queues up while a write is in flight and goes out
together in the next message, so the busier the stream, the more requests share
each write. ``Rollouts`` (one answer per tag) and ``Generates`` (deltas per tag)
are the two kinds; this module is what they share.

Bounded whatever the client sends: at most ``max_running`` requests run on one
stream and ``max_starts`` of one message are taken; every start past either
fails alone, RESOURCE_EXHAUSTED naming the limit (retryable), without a task. A
message's starts are read in slices that yield to the event loop, and answers
go out in messages of at most ``MAX_ITEMS_PER_MESSAGE``, so one huge message
never holds up the server's other calls.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Generic, Required, TypedDict, TypeVar

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_server import tracing
from engine_server.config import Limits
from engine_server.errors import (
    CapacityExceeded,
    Draining,
    InvalidRequest,
    ServerError,
    StreamStalled,
)
from engine_server.handlers import Undecodable
from engine_server.metrics import (
    ABORT_CLIENT_CANCEL,
    ABORT_WATCHDOG,
    STREAM_ITEMS_PER_MESSAGE,
)

log = logging.getLogger(__name__)

# Room for a response's own framing around each item (a tag and a length
# prefix), so that a batch of items that fit stays under the limit.
ITEM_OVERHEAD_BYTES = 32
# Bounds one write's encoding time (the loop serves every call meanwhile).
MAX_ITEMS_PER_MESSAGE = 256
# Starts handled between two yields to the event loop.
_STARTS_PER_SLICE = 32

RequestT = TypeVar("RequestT")
ItemT = TypeVar("ItemT")


class Queued(Generic[ItemT]):
    """An answer waiting for the next write, with its encoded size (which grows
    while deltas are merged into it)."""

    __slots__ = ("item", "size", "tag")

    def __init__(self, tag: int, item: ItemT, size: int) -> None:
        self.tag = tag
        self.item = item
        self.size = size


class StreamLimits(TypedDict, total=False):
    """What bounds one stream: ``TaggedStream``'s keyword arguments, which its
    subclasses take as they are."""

    max_message_bytes: Required[int]
    write_timeout_s: Required[float | None]
    max_running: int
    max_starts: int


class TaggedStream(Generic[RequestT, ItemT]):
    """Serves one multiplexed call: ``await stream.serve(requests)``.

    Raises ServerError to end the call with that status (a stalled client, or
    the server shutting down); every request still running is cancelled, which
    aborts its engine request, whatever ends the call. Subclasses say what a
    start carries, how one request is answered, and how answers are framed.
    """

    # The request message's name, for errors about undecodable input.
    request_name = ""
    # What running requests are called in refusals ("rollouts", "completions").
    noun = ""

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        *,
        max_message_bytes: int,
        write_timeout_s: float | None,
        max_running: int = Limits.max_rollouts_per_stream,
        max_starts: int = Limits.max_starts_per_message,
    ) -> None:
        self._max_running = max_running
        self._max_starts = max_starts
        self._context = context
        self._limit = max_message_bytes - ITEM_OVERHEAD_BYTES
        self._write_timeout_s = write_timeout_s
        self._running: dict[int, asyncio.Task[ItemT | None]] = {}
        self._cancelled: set[int] = set()
        self._out: collections.deque[Queued[ItemT]] = collections.deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._stalled = False
        self._per_message = STREAM_ITEMS_PER_MESSAGE.labels(self.noun)

    # -- what subclasses provide ---------------------------------------------

    # The start message's field holding the request ("rollout", "generate").
    payload_field = ""
    # An item: a message with ``tag`` and ``error`` (an engine_contract RolloutError).
    item_type: Any = None
    # A response: a message whose ``items_field`` holds the items.
    response_type: Any = None
    items_field = ""

    async def _answer(self, tag: int, request: RequestT) -> ItemT | None:
        """Run one request; its last answer, or None when it queued its answers
        itself (``_queue``). Raises ServerError to fail it with that status."""
        raise NotImplementedError

    def _error(self, tag: int, code: grpc.StatusCode, message: str, limit: str = "") -> ItemT:
        error = pb.RolloutError(code=code.value[0], message=message, limit=limit)
        item: ItemT = self.item_type(tag=tag, error=error)
        return item

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Stop taking requests; end the call with UNAVAILABLE once those running are
        answered (the server is shutting down)."""
        self._closing = True
        self._wake.set()

    async def serve(self, requests: AsyncIterator[Any]) -> None:
        # Headers now, on their own: were they to go with a first write that a
        # client never reads, the status that ends the call (the watchdog's
        # ABORTED) could not be sent behind them (TOO_MANY_OPERATIONS).
        await self._context.send_initial_metadata(())
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        reader.add_done_callback(lambda _: self._wake.set())
        try:
            await self._write_loop(reader)
        finally:
            reader.cancel()
            tasks = list(self._running.values())
            # The call ended under them: its client went away, or the watchdog
            # (those cancelled by tag and still ending were counted already).
            ended = len(tasks) - len(self._cancelled)
            for task in tasks:
                task.cancel()
            if ended > 0:
                (ABORT_WATCHDOG if self._stalled else ABORT_CLIENT_CANCEL).inc(ended)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    # -- reading -----------------------------------------------------------

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        async for message in requests:
            if self._closing:
                return
            if isinstance(message, Undecodable):  # which requests it meant is unknowable
                raise InvalidRequest(self.request_name, str(message))
            self._on_message(message)
            starts, cancels = message.start, message.cancel
            # Cancels of requests already running first: a client at its
            # max_rollouts_per_stream cancels some and starts others in one message.
            later = [tag for tag in cancels if not self._cancel(tag)]
            taken = min(len(starts), self._max_starts)
            for first in range(0, taken, _STARTS_PER_SLICE):
                if first:
                    await asyncio.sleep(0)
                for index in range(first, min(first + _STARTS_PER_SLICE, taken)):
                    self._start_one(starts[index])
            if taken < len(starts):
                await self._refuse_excess(starts, taken)
            for tag in later:  # started by this very message
                self._cancel(tag)

    def _cancel(self, tag: int) -> bool:
        """Cancel a running request; False when none runs under ``tag``."""
        running = self._running.get(tag)
        if running is None or running.done():
            return False
        self._cancelled.add(tag)
        running.cancel()
        ABORT_CLIENT_CANCEL.inc()
        return True

    async def _refuse_excess(self, starts: Sequence[Any], taken: int) -> None:
        """Every start past max_starts_per_message fails alone; one error for all of
        them, so a flood costs a tag and a reference each."""
        refusal = CapacityExceeded(
            "max_starts_per_message",
            self._max_starts,
            f"this message holds {len(starts)} starts; those past the first "
            f"{self._max_starts} are refused",
        )
        error = pb.RolloutError(
            code=refusal.code.value[0], message=str(refusal), limit=refusal.limit
        )
        size = error.ByteSize() + 16  # the tag and the framing
        item = self.item_type
        for first in range(taken, len(starts), _STARTS_PER_SLICE * 2):
            for index in range(first, min(first + _STARTS_PER_SLICE * 2, len(starts))):
                tag = starts[index].tag
                self._out.append(Queued(tag, item(tag=tag, error=error), size))
            self._wake.set()
            await asyncio.sleep(0)

    def _on_message(self, message: Any) -> None:
        """A request message arrived (before its starts and cancels are handled)."""

    def _start_one(self, start: Any) -> None:
        self._start(start.tag, getattr(start, self.payload_field), start.trace_context)

    def _start(self, tag: int, request: RequestT, trace: Mapping[str, str]) -> None:
        if tag in self._running:
            self._emit(
                tag,
                self._error(
                    tag,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tag: {tag} is already running on this stream",
                ),
            )
        elif len(self._running) - len(self._cancelled) >= self._max_running:
            # (cancelled ones still ending free their slot at once)
            refusal = CapacityExceeded(
                "max_rollouts_per_stream",
                self._max_running,
                f"{len(self._running)} {self.noun} are running on this stream",
            )
            self._emit(tag, self._error(tag, refusal.code, str(refusal), refusal.limit))
        else:
            task = asyncio.get_running_loop().create_task(self._one(tag, request, trace))
            self._running[tag] = task
            task.add_done_callback(functools.partial(self._finished, tag))

    async def _one(self, tag: int, request: RequestT, trace: Mapping[str, str]) -> ItemT | None:
        if trace:  # the task's own context: this request's alone
            tracing.use_start(trace)
        try:
            return await self._answer(tag, request)
        except ServerError as e:
            return self._error(tag, e.code, str(e), e.limit)

    def _finished(self, tag: int, task: asyncio.Task[ItemT | None]) -> None:
        # A done callback rather than code in _one: a task cancelled before it
        # first ran never enters _one, yet its tag must be answered.
        del self._running[tag]
        asked = tag in self._cancelled
        self._cancelled.discard(tag)
        result: ItemT | None
        if task.cancelled():
            if not asked:
                return  # the stream is ending: nobody is left to answer
            result = self._error(
                tag,
                grpc.StatusCode.CANCELLED,
                "cancelled by the client; the engine request was aborted",
            )
        elif (exc := task.exception()) is not None:
            log.error("request on a %s stream failed", self.request_name, exc_info=exc)
            result = self._error(tag, grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
        else:
            result = task.result()
        if result is not None:
            self._emit(tag, result)

    def _emit(self, tag: int, item: ItemT) -> None:
        size = item.ByteSize()  # type: ignore[attr-defined]
        if size > self._limit:
            item = self._error(
                tag,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"answer of {size} bytes is over the server's message limit "
                f"({self._limit + ITEM_OVERHEAD_BYTES} bytes, --max-message-bytes)",
            )
            size = item.ByteSize()  # type: ignore[attr-defined]
        self._queue(Queued(tag, item, size))

    def _queue(self, queued: Queued[ItemT]) -> None:
        self._out.append(queued)
        self._wake.set()

    # -- writing -----------------------------------------------------------

    async def _write_loop(self, reader: asyncio.Task[None]) -> None:
        while True:
            await self._wake.wait()
            # One loop turn before taking the batch: answers that other tasks make
            # ready in this same turn (an engine step ends many requests' steps at
            # once) join it. No timer: an idle stream still writes at once.
            await asyncio.sleep(0)
            self._wake.clear()
            while self._out:
                await self._write(self._take_batch())
                # Other calls between two large writes (and, under load, time for
                # answers to gather: ``_pause_after_write``).
                await asyncio.sleep(self._pause_after_write())
            if reader.done() or self._closing:
                if reader.done() and not reader.cancelled() and (exc := reader.exception()):
                    raise exc
                if not self._running and not self._out:
                    if self._closing:
                        raise Draining(f"server is shutting down; send new {self.noun} elsewhere")
                    return  # the client half-closed and everything is answered

    def _take_batch(self) -> Any:
        out = self._out
        message = self.response_type()
        items = getattr(message, self.items_field)
        total = 0
        while out and len(items) < MAX_ITEMS_PER_MESSAGE:
            size = out[0].size + ITEM_OVERHEAD_BYTES
            if items and total + size > self._limit:
                break
            total += size
            queued = out.popleft()
            self._taken(queued)
            items.append(queued.item)
        self._per_message.observe(len(items))
        return message

    def _pause_after_write(self) -> float:
        """Seconds the writer waits after a write before taking the next batch."""
        return 0.0

    def _taken(self, queued: Queued[ItemT]) -> None:
        """``queued`` is going out now (nothing may be merged into it any more)."""

    async def _write(self, message: Any) -> None:
        timeout = self._write_timeout_s
        if timeout is None:
            await self._context.write(message)
            return
        try:
            async with asyncio.timeout(timeout):
                await self._context.write(message)
        except TimeoutError:
            self._stalled = True
            raise StreamStalled(timeout, f"every {self.noun[:-1]} still running on it") from None
