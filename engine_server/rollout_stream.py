"""One Rollouts stream: many rollouts over one call, answered in batches.

A gRPC call costs each side far more CPU than the protobuf work of a small
rollout, so a busy client multiplexes its rollouts over one stream. Each
started rollout runs as its own task (as a Rollout call would); finished ones
queue up while a write is in flight and go out together in the next message,
so the busier the stream, the more rollouts share each write.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_server.errors import Draining, ServerError, StreamStalled

log = logging.getLogger(__name__)

RunRollout = Callable[[pb.RolloutRequest, pb.RolloutResponse], Awaitable[object]]
"""Answers one rollout into the given response, or raises ServerError
(``ServerCore.rollout``)."""

# Room for a RolloutsResponse's own framing around its results (a tag and a
# length prefix each), so that a batch of results that fit stays under the limit.
_RESULT_OVERHEAD_BYTES = 32


def _error(tag: int, code: grpc.StatusCode, message: str) -> pb.RolloutResult:
    return pb.RolloutResult(tag=tag, error=pb.RolloutError(code=code.value[0], message=message))


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
    ) -> None:
        self._rollout = rollout
        self._context = context
        self._limit = max_message_bytes - _RESULT_OVERHEAD_BYTES
        self._write_timeout_s = write_timeout_s
        self._running: dict[int, asyncio.Task[pb.RolloutResult]] = {}
        self._cancelled: set[int] = set()
        self._out: list[tuple[int, pb.RolloutResult]] = []
        self._wake = asyncio.Event()
        self._closing = False

    def close(self) -> None:
        """Stop taking rollouts; end the call with UNAVAILABLE once those running are
        answered (the server is shutting down)."""
        self._closing = True
        self._wake.set()

    async def serve(self, requests: AsyncIterator[pb.RolloutsRequest]) -> None:
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
        loop = asyncio.get_running_loop()
        async for message in requests:
            if self._closing:
                return
            for start in message.start:
                tag = start.tag
                if tag in self._running:
                    self._emit(
                        _error(
                            tag,
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"tag: {tag} is already running on this stream",
                        )
                    )
                    continue
                task = loop.create_task(self._one(tag, start.rollout))
                self._running[tag] = task
                task.add_done_callback(functools.partial(self._finished, tag))
            for tag in message.cancel:
                running = self._running.get(tag)
                if running is not None and not running.done():
                    self._cancelled.add(tag)
                    running.cancel()

    async def _one(self, tag: int, request: pb.RolloutRequest) -> pb.RolloutResult:
        result = pb.RolloutResult(tag=tag)
        try:
            await self._rollout(request, result.response)
        except ServerError as e:
            return _error(tag, e.code, str(e))
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
            if reader.done() or self._closing:
                if reader.done() and not reader.cancelled() and (exc := reader.exception()):
                    raise exc
                if not self._running and not self._out:
                    if self._closing:
                        raise Draining("server is shutting down; send new rollouts elsewhere")
                    return  # the client half-closed and everything is answered

    def _take_batch(self) -> pb.RolloutsResponse:
        out = self._out
        total = 0
        n = 0
        for size, _ in out:
            if n and total + size + _RESULT_OVERHEAD_BYTES > self._limit:
                break
            total += size + _RESULT_OVERHEAD_BYTES
            n += 1
        batch, self._out = out[:n], out[n:]
        return pb.RolloutsResponse(results=[result for _, result in batch])

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
