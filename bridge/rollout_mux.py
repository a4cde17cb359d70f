"""RolloutMux: the bridge's rollouts multiplexed over one Rollouts stream.

A gRPC call costs each side more CPU than a small rollout's own protobuf work,
so the bridge starts rollouts on one long-lived stream instead: starts queue up
while a write is in flight and go out together, as the server's answers do.
A rollout behaves like a Rollout call: await it for the answer or a
``grpc.aio.AioRpcError`` carrying the status the call would have ended with;
``cancel()`` it (or cancel the task awaiting it) and the engine request is
aborted. A broken stream fails the rollouts on it the way their calls would
have failed (UNAVAILABLE when the server went away), and the next rollout
opens a new stream.

The server's announced limits are respected here rather than tripped over:
at most ``max_starts`` starts go in one message and at most ``max_in_flight``
rollouts run on the stream; the rest wait in the bridge, up to as many again,
and a rollout beyond that fails at once with RESOURCE_EXHAUSTED naming the
limit (retryable: Dynamo sends it to another worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import grpc

from engine_contract.retry import LIMIT_TRAILER
from engine_contract.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

# Room for the framing a RolloutsRequest adds around each start and cancel.
_ITEM_OVERHEAD_BYTES = 32

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

OpenStream = Callable[[], "grpc.aio.StreamStreamCall[pb.RolloutsRequest, pb.RolloutsResponse]"]


def rpc_error(code: grpc.StatusCode, details: str, limit: str = "") -> grpc.aio.AioRpcError:
    """An error like the one a failed call raises, so callers handle both alike
    (``limit``: the admission limit named in its trailing metadata)."""
    trailer = grpc.aio.Metadata((LIMIT_TRAILER, limit)) if limit else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailer, details=details)


def _result_error(error: pb.RolloutError) -> grpc.aio.AioRpcError:
    code = _STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
    return rpc_error(code, error.message, error.limit)


class PendingRollout:
    """A rollout started on the stream; like a Rollout call object."""

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[pb.RolloutResponse]) -> None:
        self._future = future

    def __await__(self) -> Generator[Any, None, pb.RolloutResponse]:
        return self._future.__await__()

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Abort the rollout; awaiting it then raises CancelledError."""
        return self._future.cancel()


class _Stream:
    """One Rollouts call and the rollouts waiting on it."""

    def __init__(self, call: Any, max_message_bytes: int, limits: StreamLimits) -> None:
        self.call = call
        self._limit = max_message_bytes
        self._limits = limits
        self.pending: dict[int, asyncio.Future[pb.RolloutResponse]] = {}
        # Sent and not answered (nor cancelled): what the server holds for us.
        self._sent: set[int] = set()
        self._starts: list[tuple[int, int, pb.RolloutRequest]] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self.dead = False
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(), name="rollouts-reader")
        self._writer = loop.create_task(self._write_loop(), name="rollouts-writer")

    def start(self, tag: int, request: pb.RolloutRequest) -> PendingRollout:
        size = request.ByteSize() + _ITEM_OVERHEAD_BYTES
        if size > self._limit:
            raise rpc_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"rollout request of {size} bytes is over the engine server's message "
                f"limit of {self._limit} bytes",
            )
        most = self._limits.max_in_flight
        if most and len(self._starts) >= most:
            raise rpc_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"max_rollouts_per_stream: {len(self._sent)} rollouts run on the engine "
                f"server's stream (its limit) and {len(self._starts)} more wait in the bridge; "
                "try again later or on another worker",
                "max_rollouts_per_stream",
            )
        future: asyncio.Future[pb.RolloutResponse] = asyncio.get_running_loop().create_future()
        self.pending[tag] = future
        future.add_done_callback(lambda f: self._on_done(tag, f))
        self._starts.append((size, tag, request))
        self._wake.set()
        return PendingRollout(future)

    def _on_done(self, tag: int, future: asyncio.Future[pb.RolloutResponse]) -> None:
        # Answered futures left ``pending`` already; one still there was cancelled
        # by its caller (abort, or the awaiting task cancelled).
        if self.pending.pop(tag, None) is None or self.dead:
            return
        for i, (_, unsent, _) in enumerate(self._starts):
            if unsent == tag:  # never sent: nothing to cancel on the server
                del self._starts[i]
                return
        self._sent.discard(tag)
        self._cancels.append(tag)
        self._wake.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._cancels or (self._starts and self._room()):
                    await self.call.write(self._take_batch())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Usually the call ended and the reader reports why. Whatever it was,
            # end the call, so that nothing waits on a stream nobody writes to.
            log.debug("rollouts stream: write failed: %r", e)
            self.call.cancel()

    def _room(self) -> int:
        """Starts the next message may carry under the server's limits."""
        limits = self._limits
        room = len(self._starts)
        if limits.max_starts:
            room = min(room, limits.max_starts)
        if limits.max_in_flight:
            room = min(room, max(0, limits.max_in_flight - len(self._sent)))
        return room

    def _take_batch(self) -> pb.RolloutsRequest:
        message = pb.RolloutsRequest(cancel=self._cancels)
        self._cancels = []
        total = len(message.cancel) * 11
        n, room = 0, self._room()
        for size, _, _ in self._starts[:room]:
            if n and total + size > self._limit:
                break
            total += size
            n += 1
        batch, self._starts = self._starts[:n], self._starts[n:]
        add = message.start.add
        for _, tag, request in batch:
            add(tag=tag, rollout=request)
            self._sent.add(tag)
        return message

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError
        try:
            async for message in self.call:
                pending = self.pending
                for result in message.results:
                    self._sent.discard(result.tag)
                    future = pending.pop(result.tag, None)
                    if future is None or future.done():
                        continue  # cancelled meanwhile
                    if result.HasField("response"):
                        future.set_result(result.response)
                    else:
                        future.set_exception(_result_error(result.error))
                if self._starts:  # answers make room for what waits
                    self._wake.set()
            error = rpc_error(
                grpc.StatusCode.UNAVAILABLE, "engine server ended the rollouts stream"
            )
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "rollouts stream closed by the bridge")
            self._fail(error)
            raise
        self._fail(error)

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        """The call is over: every rollout still waiting on it fails with its status."""
        self.dead = True
        self._writer.cancel()
        pending, self.pending = self.pending, {}
        if pending:
            log.info(
                "rollouts stream ended (%s: %s): failing %d rollouts",
                error.code().name,
                error.details(),
                len(pending),
            )
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._reader, self._writer, return_exceptions=True)


@dataclass
class StreamLimits:
    """The engine server's announced limits on one stream (0: none)."""

    max_starts: int = 0
    max_in_flight: int = 0


class RolloutMux:
    """Starts rollouts on a Rollouts stream it opens on demand (``open_stream``)."""

    def __init__(self, open_stream: OpenStream, max_message_bytes: int) -> None:
        self._open = open_stream
        self.max_message_bytes = max_message_bytes
        self.limits = StreamLimits()
        self._stream: _Stream | None = None
        self._next_tag = 1
        self._closed = False

    def start(self, request: pb.RolloutRequest) -> PendingRollout:
        """Start a rollout; raises AioRpcError at once when it cannot be sent."""
        if self._closed:
            raise grpc.aio.UsageError("the rollouts stream is closed")
        stream = self._stream
        if stream is None or stream.dead:
            stream = self._stream = _Stream(self._open(), self.max_message_bytes, self.limits)
        tag = self._next_tag
        self._next_tag += 1
        return stream.start(tag, request)

    async def close(self) -> None:
        """End the stream (the server aborts what still runs on it). Idempotent."""
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
