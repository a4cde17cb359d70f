"""One Rollouts stream: many rollouts over one call, one answer each, in batches
(``tagged_stream`` says how the stream is shared and bounded)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Unpack

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_server.tagged_stream import MAX_ITEMS_PER_MESSAGE, StreamLimits, TaggedStream

__all__ = ["MAX_RESULTS_PER_MESSAGE", "RolloutStream", "RunRollout"]

RunRollout = Callable[[pb.RolloutRequest, pb.RolloutResponse], Awaitable[object]]
"""Answers one rollout into the given response, or raises ServerError
(``ServerCore.rollout``)."""

MAX_RESULTS_PER_MESSAGE = MAX_ITEMS_PER_MESSAGE


class RolloutStream(TaggedStream[pb.RolloutRequest, pb.RolloutResult]):
    """Serves one Rollouts call: ``await RolloutStream(...).serve(requests)``."""

    request_name = "RolloutsRequest"
    noun = "rollouts"
    payload_field = "rollout"
    item_type = pb.RolloutResult
    response_type = pb.RolloutsResponse
    items_field = "results"

    def __init__(
        self,
        rollout: RunRollout,
        context: grpc.aio.ServicerContext,
        **limits: Unpack[StreamLimits],
    ) -> None:
        super().__init__(context, **limits)
        self._rollout = rollout

    async def _answer(self, tag: int, request: pb.RolloutRequest) -> pb.RolloutResult:
        result = pb.RolloutResult(tag=tag)
        await self._rollout(request, result.response)
        return result
