"""The contract's RPCs over gRPC: decode, call the core, encode.

What a request means lives in ``ServerCore``; this module adds only what gRPC
needs: the status boundary (``status.rpc``), the write watchdog on server
streams (a client that stops reading must not keep engine requests alive), the
``Rollouts`` streams, and the call's response headers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.core import ServerCore
from engine_server.errors import StreamStalled
from engine_server.rollout_stream import RolloutStream
from engine_server.status import rpc, rpc_stream


class EngineServicer(pb_grpc.EngineServiceServicer):
    def __init__(self, core: ServerCore) -> None:
        self._core = core
        self._streams: set[RolloutStream] = set()

    @rpc
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        return self._core.server_info(request.client_revision)

    @rpc
    async def Rollout(
        self, request: pb.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> pb.RolloutResponse:
        return await self._core.rollout(request)

    @rpc
    async def Rollouts(
        self,
        request_iterator: AsyncIterator[pb.RolloutsRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        config = self._core.config
        stream = RolloutStream(
            self._core.rollout,
            context,
            max_message_bytes=config.limits.max_message_bytes,
            write_timeout_s=config.stream_write_timeout_s,
        )
        self._streams.add(stream)
        try:
            await stream.serve(request_iterator)
        finally:
            self._streams.discard(stream)

    def close_streams(self) -> None:
        """Shutting down: Rollouts streams answer what runs on them, then end."""
        for stream in self._streams:
            stream.close()

    @rpc
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Explicit writes, each bounded by the watchdog: a client that stops
        # reading would otherwise park the write (HTTP/2 flow control) and keep
        # the engine request alive for as long as the connection lives.
        async with contextlib.aclosing(self._core.generate(request)) as messages:
            async for message in messages:
                await self._write(context, message)

    async def _write(self, context: grpc.aio.ServicerContext, message: pb.GenerateResponse) -> None:
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
            raise StreamStalled(timeout) from None

    @rpc
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return await self._core.abort(request)

    @rpc_stream
    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        stream = self._core.hub.subscribe(request)
        # Headers once the position is fixed, so that a client may wait for
        # them before it makes the engine emit what it wants to see; and now,
        # because the stream may stay quiet for long.
        await context.send_initial_metadata(())
        async for message in stream:
            yield message

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
