"""The contract's RPCs over gRPC: decode, call the core, encode.

What a request means lives in ``ServerCore``; this module adds only what gRPC
needs: the status boundary (``status.rpc``), the write watchdog on server
streams (a client that stops reading must not keep engine requests alive), the
``Rollouts`` and ``Generates`` streams, and the call's response headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server import tracing
from engine_server.admission import check_id_length
from engine_server.core import ServerCore
from engine_server.errors import CapacityExceeded, StreamStalled
from engine_server.generate_stream import GenerateStream
from engine_server.metrics import ABORT_WATCHDOG, engine_series
from engine_server.refit_requests import json_object, update_from_tensors
from engine_server.rollout_stream import RolloutStream
from engine_server.status import rpc
from engine_server.tagged_stream import TaggedStream

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def refit_rpc(
    method: Callable[[EngineServicer, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[EngineServicer, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """``rpc`` for the refit cycle: every step needs the engine up, so each call is
    UNAVAILABLE until it is (checked first, inside the status boundary)."""

    @functools.wraps(method)
    async def when_serving(
        self: EngineServicer, request: Req, context: grpc.aio.ServicerContext
    ) -> Resp:
        self._core.serving()
        return await method(self, request, context)

    return rpc(when_serving)


class EngineServicer(pb_grpc.EngineServiceServicer):
    def __init__(self, core: ServerCore) -> None:
        self._core = core
        self._streams: set[TaggedStream[Any, Any]] = set()

    @rpc
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        return self._core.server_info(request.client_revision)

    @rpc
    async def Rollout(
        self, request: pb.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> pb.RolloutResponse:
        tracing.bind(context)
        return await self._core.rollout(request)

    @rpc
    async def Rollouts(
        self,
        request_iterator: AsyncIterator[pb.RolloutsRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        limits = self._stream_limits()
        await self._serve(RolloutStream(self._core.rollout, context, **limits), request_iterator)

    @rpc
    async def Generates(
        self,
        request_iterator: AsyncIterator[pb.GeneratesRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        limits = self._stream_limits()
        config = self._core.config
        stream = GenerateStream(
            self._core.generate,
            context,
            hold_s=config.delta_hold_ms / 1000,
            hold_from=config.delta_hold_from,
            **limits,
        )
        await self._serve(stream, request_iterator)

    def _stream_limits(self) -> dict[str, Any]:
        """What bounds a multiplexed stream, from the server's config."""
        config = self._core.config
        return {
            "max_message_bytes": config.limits.max_message_bytes,
            "write_timeout_s": config.stream_write_timeout_s,
            "max_running": config.limits.max_rollouts_per_stream,
            "max_starts": config.limits.max_starts_per_message,
        }

    async def _serve(self, stream: TaggedStream[Any, Any], requests: AsyncIterator[Any]) -> None:
        """Serve one multiplexed call, closable at shutdown while it runs."""
        self._streams.add(stream)
        try:
            await stream.serve(requests)
        finally:
            self._streams.discard(stream)

    def close_streams(self) -> None:
        """Shutting down: Rollouts and Generates streams answer what runs on them,
        then end."""
        for stream in self._streams:
            stream.close()

    @rpc
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Explicit writes, each bounded by the watchdog: a client that stops
        # reading would otherwise park the write (HTTP/2 flow control) and keep
        # the engine request alive for as long as the connection lives. Headers
        # first, on their own, so that the watchdog's status can always follow.
        tracing.bind(context)
        await context.send_initial_metadata(())
        async with contextlib.aclosing(self._core.generate(request)) as messages:
            async for message in messages:
                await self._write(context, message)

    async def _write(
        self,
        context: grpc.aio.ServicerContext,
        message: pb.GenerateResponse | pb.SubscribeKvEventsResponse,
        ended: str = "the engine request",
    ) -> None:
        """One stream write, bounded by ``stream_write_timeout_s`` (None: unbounded).
        A timer per write (asyncio.timeout: no extra task), nothing more."""
        timeout = self._core.config.stream_write_timeout_s
        if timeout is None:
            await context.write(message)
            return
        try:
            async with asyncio.timeout(timeout):
                await context.write(message)
        except TimeoutError:
            if isinstance(message, pb.GenerateResponse):
                ABORT_WATCHDOG.inc()
            raise StreamStalled(timeout, ended) from None

    @rpc
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return await self._core.abort(request)

    @rpc
    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        core = self._core
        limits = core.config.limits
        check_id_length("expected_instance_id", request.expected_instance_id, limits)
        if core.hub.subscribers >= limits.max_kv_subscribers:
            raise CapacityExceeded(
                "max_kv_subscribers",
                limits.max_kv_subscribers,
                f"{core.hub.subscribers} KV-event subscriptions are open",
            )
        # Counted from here (not from the first read), so that many subscribers
        # arriving at once cannot all pass the check above.
        async with contextlib.aclosing(core.hub.subscribe(request)) as stream:
            # Headers once the position is fixed, so that a client may wait for
            # them before it makes the engine emit what it wants to see; and
            # now, because the stream may stay quiet for long.
            await context.send_initial_metadata(())
            async for message in stream:
                await self._write(context, message, "the subscription")

    @rpc
    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        return pb.ResetPrefixCacheResponse(reset=await self._core.reset_prefix_cache())

    @rpc
    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadResponse:
        return self._core.load()

    @rpc
    async def GetEngineMetrics(
        self, request: pb.GetEngineMetricsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetEngineMetricsResponse:
        # On the loop, as the metrics endpoint: a few milliseconds for vLLM's families.
        return pb.GetEngineMetricsResponse(text=engine_series())

    # -- the refit cycle (RefitControl holds its rules; WeightUpdates its ways in) --

    @refit_rpc
    async def PauseGeneration(
        self, request: pb.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PauseGenerationResponse:
        return await self._core.refit.pause(request)

    @refit_rpc
    async def ResumeGeneration(
        self, request: pb.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResumeGenerationResponse:
        return await self._core.refit.resume()

    @refit_rpc
    async def IsPaused(
        self, request: pb.IsPausedRequest, context: grpc.aio.ServicerContext
    ) -> pb.IsPausedResponse:
        return pb.IsPausedResponse(paused=self._core.refit.paused is not None)

    @refit_rpc
    async def UpdateWeightsFromPath(
        self, request: pb.UpdateWeightsFromPathRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsFromPathResponse:
        return await self._core.updates.update_from_path(request)

    @refit_rpc
    async def UpdateWeightsFromTensors(
        self,
        request_iterator: AsyncIterator[pb.UpdateWeightsFromTensorsRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.UpdateWeightsFromTensorsResponse:
        return await update_from_tensors(self._core, request_iterator)

    @refit_rpc
    async def InitWeightTransferEngine(
        self, request: pb.InitWeightTransferEngineRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitWeightTransferEngineResponse:
        info = json_object("init_info_json", request.init_info_json)
        timeout_s = request.timeout_ms / 1000 if request.HasField("timeout_ms") else None
        await self._core.updates.init_weight_transfer(info, timeout_s or None)
        return pb.InitWeightTransferEngineResponse()

    @refit_rpc
    async def StartWeightUpdate(
        self, request: pb.StartWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartWeightUpdateResponse:
        await self._core.updates.start_weight_update(request.options)
        return pb.StartWeightUpdateResponse()

    @refit_rpc
    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        info = json_object("update_info_json", request.update_info_json, arrays=True)
        await self._core.updates.update_weights(info)
        return pb.UpdateWeightsResponse()

    @refit_rpc
    async def FinishWeightUpdate(
        self, request: pb.FinishWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> pb.FinishWeightUpdateResponse:
        return await self._core.updates.finish_weight_update(request)

    @refit_rpc
    async def ShutdownWeightTransferEngine(
        self, request: pb.ShutdownWeightTransferEngineRequest, context: grpc.aio.ServicerContext
    ) -> pb.ShutdownWeightTransferEngineResponse:
        await self._core.updates.shutdown_weight_transfer()
        return pb.ShutdownWeightTransferEngineResponse()

    @refit_rpc
    async def GetWeightVersion(
        self, request: pb.GetWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetWeightVersionResponse:
        state = self._core.refit.state()
        return pb.GetWeightVersionResponse(
            weight_version=state.weight_version,
            declared=state.weight_version_declared,
            weight_changes=state.weight_changes,
            weights_mixed=state.weights_mixed,
            weight_update_open=state.weight_update_open,
        )

    @refit_rpc
    async def UpdateWeightVersion(
        self, request: pb.UpdateWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightVersionResponse:
        expect = (
            request.expect_weight_changes if request.HasField("expect_weight_changes") else None
        )
        return await self._core.refit.update_version(request.weight_version, expect)

    @refit_rpc
    async def Sleep(
        self, request: pb.SleepRequest, context: grpc.aio.ServicerContext
    ) -> pb.SleepResponse:
        await self._core.refit.sleep(request)
        return pb.SleepResponse()

    @refit_rpc
    async def WakeUp(
        self, request: pb.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> pb.WakeUpResponse:
        return pb.WakeUpResponse(awake=await self._core.refit.wake_up(list(request.tags)))

    @refit_rpc
    async def IsSleeping(
        self, request: pb.IsSleepingRequest, context: grpc.aio.ServicerContext
    ) -> pb.IsSleepingResponse:
        return pb.IsSleepingResponse(sleeping=self._core.refit.sleeping)
