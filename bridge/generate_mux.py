"""GenerateMux: the bridge's ordinary completions multiplexed over one Generates
stream (``tagged_mux`` says how the stream is shared, bounded and failed).

A completion behaves like a Generate call: iterate it for its deltas (the last
one carries ``finished``); a failure raises the ``grpc.aio.AioRpcError`` the
call would have raised; ``cancel()`` it and the engine request is aborted
(iterating then raises CancelledError). Deltas that arrived while the consumer
was busy are handed over merged into one, so a slow consumer yields fewer,
larger chunks instead of falling further behind. On a paced stream (contract
revision 6) each delta handed over is reported taken, which lets the server
send the next: the consumer's pace sets how many tokens each delta carries.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import grpc

from bridge.tagged_mux import MuxStream, StreamKind, TaggedMux, result_error
from engine_contract.v1 import engine_pb2 as pb

GENERATES = StreamKind(
    "completion",
    pb.GeneratesRequest,
    "generate",
    "deltas",
    paced_field="paced",
    taken_field="taken",
)


class PendingGenerate:
    """A completion started on the stream; like a Generate call object."""

    __slots__ = ("_deltas", "_ended", "_error", "_on_cancel", "_on_taken", "_waiter")

    def __init__(
        self, on_cancel: Callable[[], None], on_taken: Callable[[], None] | None = None
    ) -> None:
        self._deltas: collections.deque[pb.GenerateResponse] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        # The last delta arrived (finished or failed), or the caller cancelled.
        self._ended = False
        self._error: BaseException | None = None
        self._on_cancel = on_cancel
        # Called for each delta handed over before the last (paced streams).
        self._on_taken = on_taken

    def __aiter__(self) -> PendingGenerate:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        deltas = self._deltas
        while not deltas:
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        delta = deltas.popleft()
        while deltas:  # arrived while the caller was busy: one chunk for all
            delta.MergeFrom(deltas.popleft())
        if not self._ended and self._on_taken is not None:
            self._on_taken()
        return delta

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def deliver(self, item: pb.GenerateDelta) -> bool:
        if self._ended:
            return True
        if item.HasField("response"):
            self._deltas.append(item.response)
            last = item.response.HasField("finished")
        else:
            self._error = result_error(item.error)
            last = True
        self._ended = last
        self._wake()
        return last

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if not self._ended:
            self._ended = True
            self._error = error
            self._wake()

    def done(self) -> bool:
        return self._ended

    def cancel(self) -> bool:
        """Abort the completion; iterating it then raises CancelledError."""
        if self._ended:
            return False
        self._ended = True
        self._deltas.clear()
        self._error = asyncio.CancelledError()
        self._wake()
        self._on_cancel()
        return True


class GenerateMux(TaggedMux[pb.GenerateRequest, PendingGenerate]):
    """Starts completions on a Generates stream it opens on demand (``open_stream``)."""

    kind = GENERATES

    @staticmethod
    def _pending(stream: MuxStream[PendingGenerate], tag: int) -> PendingGenerate:
        taken = (lambda: stream.taken(tag)) if stream.paced else None
        return PendingGenerate(lambda: stream.cancelled(tag), taken)
