"""TaggedMux: the bridge's requests multiplexed over one long-lived stream.

A gRPC call costs each side more CPU than a small request's own protobuf work,
so the bridge starts its requests on one stream instead, each under a tag:
starts queue up while a write is in flight and go out together, as the
server's answers do. ``Rollouts`` (one answer per tag, ``rollout_mux``) and
``Generates`` (deltas per tag, ``generate_mux``) are the two kinds; this module
is what they share. A request behaves like its own call would: it fails with a
``grpc.aio.AioRpcError`` carrying the status that call would have ended with,
and cancelling it aborts the engine request. A broken stream fails the
requests on it the way their calls would have failed (UNAVAILABLE when the
server went away), and the next request opens a new stream.

The server's announced limits are respected here rather than tripped over:
at most ``max_starts`` starts go in one message and at most ``max_in_flight``
requests run on the stream; the rest wait in the bridge, up to as many again,
and a request beyond that fails at once with RESOURCE_EXHAUSTED naming the
limit (retryable: Dynamo sends it to another worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import grpc

from bridge import metrics
from engine_contract.retry import LIMIT_TRAILER
from engine_contract.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

# Room for the framing a request message adds around each start and cancel.
_ITEM_OVERHEAD_BYTES = 32

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

OpenStream = Callable[[], Any]
"""Opens the stream: a ``grpc.aio.StreamStreamCall``."""


def rpc_error(code: grpc.StatusCode, details: str, limit: str = "") -> grpc.aio.AioRpcError:
    """An error like the one a failed call raises, so callers handle both alike
    (``limit``: the admission limit named in its trailing metadata)."""
    trailer = grpc.aio.Metadata((LIMIT_TRAILER, limit)) if limit else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailer, details=details)


def result_error(error: pb.RolloutError) -> grpc.aio.AioRpcError:
    code = _STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
    return rpc_error(code, error.message, error.limit)


class Pending(Protocol):
    """One request on the stream, as its kind answers it."""

    def deliver(self, item: Any) -> bool:
        """Take one of the server's items for this tag; True when it was the last."""
        ...

    def fail(self, error: grpc.aio.AioRpcError) -> None: ...

    def done(self) -> bool: ...


P = TypeVar("P", bound=Pending)
R = TypeVar("R")


@dataclass
class StreamLimits:
    """The engine server's announced limits on one stream (0: none)."""

    max_starts: int = 0
    max_in_flight: int = 0


@dataclass(frozen=True)
class StreamKind:
    """How one kind of stream frames its messages."""

    # What its requests are called in errors ("rollout", "completion").
    noun: str
    # The request message type, and the start's field holding a request.
    request_type: Any
    payload_field: str
    # The response message's repeated field of items.
    items_field: str
    # The server's limit on one stream, as it names it.
    running_limit: str = "max_rollouts_per_stream"
    # Paced requests (revision 6): the start's flag asking for it, and the request
    # message's field naming the tags whose last answer was taken ("": never paced).
    paced_field: str = ""
    taken_field: str = ""


class MuxStream(Generic[P]):
    """One call and the requests waiting on it."""

    def __init__(
        self,
        kind: StreamKind,
        call: Any,
        max_message_bytes: int,
        limits: StreamLimits,
        paced: bool = False,
    ) -> None:
        self.kind = kind
        self.call = call
        self._limit = max_message_bytes
        self._limits = limits
        self.paced = paced and bool(kind.paced_field)
        # Tags whose last answer the caller took, to tell the server (paced streams).
        self._takens: list[int] = []
        self.pending: dict[int, P] = {}
        # Sent and not finished (nor cancelled): what the server holds for us.
        self._sent: set[int] = set()
        self._starts: list[tuple[int, int, Any, Mapping[str, str] | None]] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self.dead = False
        stream = f"{kind.noun}s"
        metrics.STREAMS_OPENED.labels(stream).inc()
        self._open_gauge = metrics.STREAMS_OPEN.labels(stream)
        self._open_gauge.inc()
        self._sent_per_message = metrics.STREAM_ITEMS_PER_MESSAGE.labels(stream, "sent")
        self._received_per_message = metrics.STREAM_ITEMS_PER_MESSAGE.labels(stream, "received")
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(), name=f"{kind.noun}s-reader")
        self._writer = loop.create_task(self._write_loop(), name=f"{kind.noun}s-writer")

    def start(self, tag: int, request: Any, pending: P, trace: Mapping[str, str] | None) -> P:
        size = request.ByteSize() + _ITEM_OVERHEAD_BYTES
        if trace:
            size += sum(len(k) + len(v) + _ITEM_OVERHEAD_BYTES for k, v in trace.items())
        if size > self._limit:
            raise rpc_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.kind.noun} request of {size} bytes is over the engine server's "
                f"message limit of {self._limit} bytes",
            )
        most = self._limits.max_in_flight
        if most and len(self._starts) >= most:
            limit = self.kind.running_limit
            raise rpc_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{limit}: {len(self._sent)} {self.kind.noun}s run on the engine server's "
                f"stream (its limit) and {len(self._starts)} more wait in the bridge; "
                "try again later or on another worker",
                limit,
            )
        self.pending[tag] = pending
        self._starts.append((size, tag, request, trace))
        self._wake.set()
        return pending

    def cancelled(self, tag: int) -> None:
        """The caller cancelled the request under ``tag``: abort it on the server."""
        if self.pending.pop(tag, None) is None or self.dead:
            return  # answered already, or the stream is gone
        for i, (_, unsent, _, _) in enumerate(self._starts):
            if unsent == tag:  # never sent: nothing to cancel on the server
                del self._starts[i]
                return
        self._sent.discard(tag)
        self._cancels.append(tag)
        self._wake.set()

    def taken(self, tag: int) -> None:
        """The caller took the last answer of the paced request under ``tag``: the
        server may send its next."""
        if self.paced and tag in self.pending and not self.dead:
            self._takens.append(tag)
            self._wake.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                # One loop turn first: starts that other requests make in this same
                # turn join the message (no timer: an idle stream writes at once).
                await asyncio.sleep(0)
                self._wake.clear()
                while self._cancels or self._takens or (self._starts and self._room()):
                    await self.call.write(self._take_batch())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Usually the call ended and the reader reports why. Whatever it was,
            # end the call, so that nothing waits on a stream nobody writes to.
            log.debug("%ss stream: write failed: %r", self.kind.noun, e)
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

    def _take_batch(self) -> Any:
        message = self.kind.request_type(cancel=self._cancels)
        self._cancels = []
        total = len(message.cancel) * 11
        if self._takens:
            getattr(message, self.kind.taken_field).extend(self._takens)
            total += len(self._takens) * 11
            self._takens = []
        n, room = 0, self._room()
        for size, _, _, _ in self._starts[:room]:
            if n and total + size > self._limit:
                break
            total += size
            n += 1
        batch, self._starts = self._starts[:n], self._starts[n:]
        add = message.start.add
        field = self.kind.payload_field
        paced = {self.kind.paced_field: True} if self.paced else {}
        for _, tag, request, trace in batch:
            add(tag=tag, trace_context=trace, **{field: request}, **paced)
            self._sent.add(tag)
        if batch:
            self._sent_per_message.observe(len(batch))
        return message

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError
        field = self.kind.items_field
        try:
            async for message in self.call:
                pending = self.pending
                items = getattr(message, field)
                self._received_per_message.observe(len(items))
                for item in items:
                    tag = item.tag
                    waiter = pending.get(tag)
                    if waiter is None:
                        self._sent.discard(tag)
                        continue  # cancelled meanwhile
                    if waiter.deliver(item):
                        del pending[tag]
                        self._sent.discard(tag)
                if self._starts:  # answers make room for what waits
                    self._wake.set()
            error = rpc_error(
                grpc.StatusCode.UNAVAILABLE, f"engine server ended the {self.kind.noun}s stream"
            )
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(
                grpc.StatusCode.CANCELLED, f"{self.kind.noun}s stream closed by the bridge"
            )
            self._fail(error)
            raise
        self._fail(error)

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        """The call is over: every request still waiting on it fails with its status."""
        if not self.dead:
            self._open_gauge.dec()
        self.dead = True
        self._writer.cancel()
        pending, self.pending = self.pending, {}
        if pending:
            log.info(
                "%ss stream ended (%s: %s): failing %d %ss",
                self.kind.noun,
                error.code().name,
                error.details(),
                len(pending),
                self.kind.noun,
            )
        for waiter in pending.values():
            if not waiter.done():
                waiter.fail(error)

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class TaggedMux(Generic[R, P]):
    """Starts requests on a stream it opens on demand (``open_stream``). A kind's
    subclass names its ``kind`` and how a started request is answered
    (``_pending``); the rest is the same for every kind."""

    kind: ClassVar[StreamKind]

    def __init__(self, open_stream: OpenStream, max_message_bytes: int) -> None:
        self._open = open_stream
        self.max_message_bytes = max_message_bytes
        self.limits = StreamLimits()
        # Start requests paced (streams opened from now on; the server must serve it).
        self.paced = False
        self._stream: MuxStream[P] | None = None
        self._next_tag = 1
        self._closed = False

    @staticmethod
    @abstractmethod
    def _pending(stream: MuxStream[P], tag: int) -> P:
        """The caller's handle on the request started under ``tag``."""

    def start(self, request: R, trace: Mapping[str, str] | None = None) -> P:
        """Start ``request``; raises AioRpcError at once when it cannot be sent."""
        if self._closed:
            raise grpc.aio.UsageError(f"the {self.kind.noun}s stream is closed")
        stream = self._stream
        if stream is None or stream.dead:
            stream = self._stream = MuxStream(
                self.kind, self._open(), self.max_message_bytes, self.limits, self.paced
            )
        tag = self._next_tag
        self._next_tag += 1
        return stream.start(tag, request, self._pending(stream, tag), trace)

    async def close(self) -> None:
        """End the stream (the server aborts what still runs on it). Idempotent."""
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
