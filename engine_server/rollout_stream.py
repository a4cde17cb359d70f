"""One Rollouts stream: many rollouts over one call, answered in batches.

A gRPC call costs each side far more CPU than the protobuf work of a small
rollout, so a busy client multiplexes its rollouts over one stream. Each
started rollout runs as its own task (as a Rollout call would); finished ones
queue up while a write is in flight and go out together in the next message,
so the busier the stream, the more rollouts share each write.

Bounded whatever the client sends: at most ``max_rollouts`` run on one stream
and ``max_starts`` of one message are taken; every start past either fails
alone, RESOURCE_EXHAUSTED naming the limit (retryable), without a task. A
message's starts are read in slices that yield to the event loop, and answers
go out in messages of at most ``MAX_RESULTS_PER_MESSAGE``, so one huge message
never holds up the server's other calls.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_server.config import Limits
from engine_server.errors import (
    CapacityExceeded,
    Draining,
    InvalidRequest,
    ServerError,
    StreamStalled,
)
from engine_server.handlers import Undecodable

log = logging.getLogger(__name__)

RunRollout = Callable[[pb.RolloutRequest, pb.RolloutResponse], Awaitable[object]]
"""Answers one rollout into the given response, or raises ServerError
(``ServerCore.rollout``)."""

# Room for a RolloutsResponse's own framing around its results (a tag and a
# length prefix each), so that a batch of results that fit stays under the limit.
_RESULT_OVERHEAD_BYTES = 32
# Bounds one write's encoding time (the loop serves every call meanwhile).
MAX_RESULTS_PER_MESSAGE = 256
# Starts handled between two yields to the event loop.
_STARTS_PER_SLICE = 32


def _error(tag: int, code: grpc.StatusCode, message: str, limit: str = "") -> pb.RolloutResult:
    return pb.RolloutResult(
        tag=tag, error=pb.RolloutError(code=code.value[0], message=message, limit=limit)
    )


def _refused(tag: int, refusal: ServerError) -> pb.RolloutResult:
    return _error(tag, refusal.code, str(refusal), refusal.limit)


class RolloutStream:
    """Serves one Rollouts call: ``await RolloutStream(...).serve(requests)``.

    Raises ServerError to end the call with that status (a stalled client, or
    the server shutting down); every rollout still running is cancelled, which
    aborts its engine request, whatever ends the call.
    """

    def __init__(
        self,
        rollout: RunRollout,
        context: grpc.aio.ServicerContext,
        *,
        max_message_bytes: int,
        write_timeout_s: float | None,
        max_rollouts: int = Limits.max_rollouts_per_stream,
        max_starts: int = Limits.max_starts_per_message,
    ) -> None:
        self._rollout = rollout
        self._max_rollouts = max_rollouts
        self._max_starts = max_starts
        self._context = context
        self._limit = max_message_bytes - _RESULT_OVERHEAD_BYTES
        self._write_timeout_s = write_timeout_s
        self._running: dict[int, asyncio.Task[pb.RolloutResult]] = {}
        self._cancelled: set[int] = set()
        self._out: collections.deque[tuple[int, pb.RolloutResult]] = collections.deque()
        self._wake = asyncio.Event()
        self._closing = False

    def close(self) -> None:
        """Stop taking rollouts; end the call with UNAVAILABLE once those running are
        answered (the server is shutting down)."""
        self._closing = True
        self._wake.set()

    async def serve(self, requests: AsyncIterator[pb.RolloutsRequest]) -> None:
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
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    # -- reading -----------------------------------------------------------

    async def _read(self, requests: AsyncIterator[pb.RolloutsRequest]) -> None:
        async for message in requests:
            if self._closing:
                return
            if isinstance(message, Undecodable):  # which rollouts it meant is unknowable
                raise InvalidRequest("RolloutsRequest", str(message))
            # Cancels of rollouts already running first: a client at its
            # max_rollouts_per_stream cancels some and starts others in one message.
            later = [tag for tag in message.cancel if not self._cancel(tag)]
            starts = message.start
            taken = min(len(starts), self._max_starts)
            for first in range(0, taken, _STARTS_PER_SLICE):
                if first:
                    await asyncio.sleep(0)
                for index in range(first, min(first + _STARTS_PER_SLICE, taken)):
                    self._start(starts[index])
            if taken < len(starts):
                await self._refuse_excess(starts, taken)
            for tag in later:  # started by this very message
                self._cancel(tag)

    def _cancel(self, tag: int) -> bool:
        """Cancel a running rollout; False when none runs under ``tag``."""
        running = self._running.get(tag)
        if running is None or running.done():
            return False
        self._cancelled.add(tag)
        running.cancel()
        return True

    async def _refuse_excess(self, starts: Sequence[pb.RolloutStart], taken: int) -> None:
        """Every start past max_starts_per_message fails alone; one message for all
        of them, so a flood costs a tag and a reference each."""
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
        for first in range(taken, len(starts), _STARTS_PER_SLICE * 2):
            for index in range(first, min(first + _STARTS_PER_SLICE * 2, len(starts))):
                self._out.append((size, pb.RolloutResult(tag=starts[index].tag, error=error)))
            self._wake.set()
            await asyncio.sleep(0)

    def _start(self, start: pb.RolloutStart) -> None:
        tag = start.tag
        if tag in self._running:
            self._emit(
                _error(
                    tag,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tag: {tag} is already running on this stream",
                )
            )
        elif len(self._running) - len(self._cancelled) >= self._max_rollouts:
            # (cancelled ones still ending free their slot at once)
            self._emit(
                _refused(
                    tag,
                    CapacityExceeded(
                        "max_rollouts_per_stream",
                        self._max_rollouts,
                        f"{len(self._running)} rollouts are running on this stream",
                    ),
                )
            )
        else:
            task = asyncio.get_running_loop().create_task(self._one(tag, start.rollout))
            self._running[tag] = task
            task.add_done_callback(functools.partial(self._finished, tag))

    async def _one(self, tag: int, request: pb.RolloutRequest) -> pb.RolloutResult:
        result = pb.RolloutResult(tag=tag)
        try:
            await self._rollout(request, result.response)
        except ServerError as e:
            return _refused(tag, e)
        return result

    def _finished(self, tag: int, task: asyncio.Task[pb.RolloutResult]) -> None:
        # A done callback rather than code in _one: a task cancelled before it
        # first ran never enters _one, yet its tag must be answered.
        del self._running[tag]
        asked = tag in self._cancelled
        self._cancelled.discard(tag)
        if task.cancelled():
            if not asked:
                return  # the stream is ending: nobody is left to answer
            result = _error(
                tag,
                grpc.StatusCode.CANCELLED,
                "cancelled by the client; the engine request was aborted",
            )
        elif (exc := task.exception()) is not None:
            log.error("rollout on stream failed", exc_info=exc)
            result = _error(tag, grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
        else:
            result = task.result()
        self._emit(result)

    def _emit(self, result: pb.RolloutResult) -> None:
        size = result.ByteSize()
        if size > self._limit:
            result = _error(
                result.tag,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"answer of {size} bytes is over the server's message limit "
                f"({self._limit + _RESULT_OVERHEAD_BYTES} bytes, --max-message-bytes)",
            )
            size = result.ByteSize()
        self._out.append((size, result))
        self._wake.set()

    # -- writing -----------------------------------------------------------

    async def _write_loop(self, reader: asyncio.Task[None]) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._out:
                await self._write(self._take_batch())
                await asyncio.sleep(0)  # other calls between two large writes
            if reader.done() or self._closing:
                if reader.done() and not reader.cancelled() and (exc := reader.exception()):
                    raise exc
                if not self._running and not self._out:
                    if self._closing:
                        raise Draining("server is shutting down; send new rollouts elsewhere")
                    return  # the client half-closed and everything is answered

    def _take_batch(self) -> pb.RolloutsResponse:
        out = self._out
        message = pb.RolloutsResponse()
        results = message.results
        total = 0
        while out and len(results) < MAX_RESULTS_PER_MESSAGE:
            size = out[0][0] + _RESULT_OVERHEAD_BYTES
            if results and total + size > self._limit:
                break
            total += size
            results.append(out.popleft()[1])
        return message

    async def _write(self, message: pb.RolloutsResponse) -> None:
        timeout = self._write_timeout_s
        if timeout is None:
            await self._context.write(message)
            return
        try:
            async with asyncio.timeout(timeout):
                await self._context.write(message)
        except TimeoutError:
            raise StreamStalled(timeout, "every rollout still running on it") from None
