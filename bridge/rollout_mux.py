"""RolloutMux: the bridge's rollouts multiplexed over one Rollouts stream
(``tagged_mux`` says how the stream is shared, bounded and failed).

A rollout behaves like a Rollout call: await it for the answer or a
``grpc.aio.AioRpcError`` carrying the status the call would have ended with;
``cancel()`` it (or cancel the task awaiting it) and the engine request is
aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

from bridge.tagged_mux import (
    MuxStream,
    StreamKind,
    StreamLimits,
    TaggedMux,
    result_error,
)
from bridge.tagged_mux import rpc_error as rpc_error
from engine_contract.v1 import engine_pb2 as pb

__all__ = ["PendingRollout", "RolloutMux", "StreamLimits", "rpc_error"]

ROLLOUTS = StreamKind("rollout", pb.RolloutsRequest, "rollout", "results")


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

    def deliver(self, result: pb.RolloutResult) -> bool:
        future = self._future
        if not future.done():
            if result.HasField("response"):
                future.set_result(result.response)
            else:
                future.set_exception(result_error(result.error))
        return True

    def fail(self, error: Exception) -> None:
        if not self._future.done():
            self._future.set_exception(error)


class RolloutMux(TaggedMux[pb.RolloutRequest, PendingRollout]):
    """Starts rollouts on a Rollouts stream it opens on demand (``open_stream``)."""

    kind = ROLLOUTS

    @staticmethod
    def _pending(stream: MuxStream[PendingRollout], tag: int) -> PendingRollout:
        future: asyncio.Future[pb.RolloutResponse] = asyncio.get_running_loop().create_future()
        # Answered ones left the stream's pending already; one still there when its
        # future is done was cancelled by its caller (abort, or the awaiting task).
        future.add_done_callback(lambda _: stream.cancelled(tag))
        return PendingRollout(future)
