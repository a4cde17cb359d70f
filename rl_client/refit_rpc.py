"""The contract's refit RPCs, one typed method each: how the bridge and trainers call them.

``RefitRpc`` wraps an ``EngineServiceStub``. The bridge's ``EngineClient`` hands
it its own channel (``EngineClient.refit``); a trainer opens one with
``RefitRpc.connect``, TLS as the bridge's (the same ``rl_client.tls.TlsOptions``).
Requests and answers are the contract's messages. A refusal is the engine
server's gRPC status (``grpc.aio.AioRpcError``), and its message is the answer
to pass on: the engine server alone holds the refit rules
(``engine_contract.refit_rules``). No deadline unless ``timeout_s``: a WAIT
pause lasts until the requests in flight end, a large checkpoint loads for its
time.

No vllm, torch or Dynamo here: a trainer with the ``driver`` extra imports it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine_contract
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from rl_client.tls import TlsOptions, aio_channel

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

TensorUpdate = (
    Iterable[pb.UpdateWeightsFromTensorsRequest] | AsyncIterable[pb.UpdateWeightsFromTensorsRequest]
)


class RefitRpc:
    """The refit cycle's RPCs on one channel. ``close()`` closes the channel only
    when ``connect`` opened it."""

    def __init__(
        self,
        stub: pb_grpc.EngineServiceStub,
        *,
        timeout_s: float | None = None,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self._stub = stub
        self.timeout_s = timeout_s
        self._channel = channel
        self._health = health_pb2_grpc.HealthStub(channel) if channel is not None else None

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        tls: TlsOptions | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout_s: float | None = None,
    ) -> RefitRpc:
        """A channel of its own to the engine server at ``address``; call from the
        event loop that will use it."""
        options: list[tuple[str, int | str]] = [
            *(tls.channel_options() if tls else []),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        channel = aio_channel(address, tls, options)
        return cls(pb_grpc.EngineServiceStub(channel), timeout_s=timeout_s, channel=channel)

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    # -- what the server is and whether it serves -------------------------------

    async def server_info(
        self, request: pb.GetServerInfoRequest | None = None
    ) -> pb.GetServerInfoResponse:
        """Its info: the checkpoint it started on (``model_path``), its refit state."""
        return await self._stub.GetServerInfo(
            pb.GetServerInfoRequest() if request is None else request, timeout=self.timeout_s
        )

    async def health(self) -> int:
        """The gRPC health status of the contract's service (``HealthCheckResponse``'s
        values): NOT_SERVING while asleep, draining, or its weights unknown. Needs the
        channel (``connect``, or ``channel=``)."""
        if self._health is None:
            raise RuntimeError("health needs the channel: RefitRpc.connect, or channel=")
        answer = await self._health.Check(
            health_pb2.HealthCheckRequest(service=engine_contract.SERVICE_NAME),
            timeout=self.timeout_s,
        )
        return int(answer.status)

    # -- pause and resume -------------------------------------------------------

    async def pause_generation(
        self, request: pb.PauseGenerationRequest
    ) -> pb.PauseGenerationResponse:
        return await self._stub.PauseGeneration(request, timeout=self.timeout_s)

    async def resume_generation(
        self, request: pb.ResumeGenerationRequest | None = None
    ) -> pb.ResumeGenerationResponse:
        return await self._stub.ResumeGeneration(
            pb.ResumeGenerationRequest() if request is None else request, timeout=self.timeout_s
        )

    async def is_paused(self, request: pb.IsPausedRequest | None = None) -> pb.IsPausedResponse:
        return await self._stub.IsPaused(
            pb.IsPausedRequest() if request is None else request, timeout=self.timeout_s
        )

    async def reset_prefix_cache(
        self, request: pb.ResetPrefixCacheRequest | None = None
    ) -> pb.ResetPrefixCacheResponse:
        return await self._stub.ResetPrefixCache(
            pb.ResetPrefixCacheRequest() if request is None else request, timeout=self.timeout_s
        )

    # -- weight updates -----------------------------------------------------------

    async def update_weights_from_path(
        self, request: pb.UpdateWeightsFromPathRequest
    ) -> pb.UpdateWeightsFromPathResponse:
        return await self._stub.UpdateWeightsFromPath(request, timeout=self.timeout_s)

    async def update_weights_from_tensors(
        self, requests: TensorUpdate
    ) -> pb.UpdateWeightsFromTensorsResponse:
        """The manifest first, then the chunks (``engine_contract.tensors.update_requests``)."""
        return await self._stub.UpdateWeightsFromTensors(requests, timeout=self.timeout_s)

    # -- weight-transfer engines (vLLM's NCCL, the engine server's gloo) ----------

    async def init_weight_transfer_engine(
        self, request: pb.InitWeightTransferEngineRequest
    ) -> pb.InitWeightTransferEngineResponse:
        return await self._stub.InitWeightTransferEngine(request, timeout=self.timeout_s)

    async def start_weight_update(
        self, request: pb.StartWeightUpdateRequest | None = None
    ) -> pb.StartWeightUpdateResponse:
        return await self._stub.StartWeightUpdate(
            pb.StartWeightUpdateRequest() if request is None else request, timeout=self.timeout_s
        )

    async def update_weights(self, request: pb.UpdateWeightsRequest) -> pb.UpdateWeightsResponse:
        return await self._stub.UpdateWeights(request, timeout=self.timeout_s)

    async def finish_weight_update(
        self, request: pb.FinishWeightUpdateRequest | None = None
    ) -> pb.FinishWeightUpdateResponse:
        return await self._stub.FinishWeightUpdate(
            pb.FinishWeightUpdateRequest() if request is None else request, timeout=self.timeout_s
        )

    async def shutdown_weight_transfer_engine(
        self, request: pb.ShutdownWeightTransferEngineRequest | None = None
    ) -> pb.ShutdownWeightTransferEngineResponse:
        return await self._stub.ShutdownWeightTransferEngine(
            pb.ShutdownWeightTransferEngineRequest() if request is None else request,
            timeout=self.timeout_s,
        )

    # -- versions -----------------------------------------------------------------

    async def get_weight_version(
        self, request: pb.GetWeightVersionRequest | None = None
    ) -> pb.GetWeightVersionResponse:
        return await self._stub.GetWeightVersion(
            pb.GetWeightVersionRequest() if request is None else request, timeout=self.timeout_s
        )

    async def update_weight_version(
        self, request: pb.UpdateWeightVersionRequest
    ) -> pb.UpdateWeightVersionResponse:
        return await self._stub.UpdateWeightVersion(request, timeout=self.timeout_s)

    # -- sleep ----------------------------------------------------------------------

    async def sleep(self, request: pb.SleepRequest) -> pb.SleepResponse:
        return await self._stub.Sleep(request, timeout=self.timeout_s)

    async def wake_up(self, request: pb.WakeUpRequest | None = None) -> pb.WakeUpResponse:
        return await self._stub.WakeUp(
            pb.WakeUpRequest() if request is None else request, timeout=self.timeout_s
        )

    async def is_sleeping(
        self, request: pb.IsSleepingRequest | None = None
    ) -> pb.IsSleepingResponse:
        return await self._stub.IsSleeping(
            pb.IsSleepingRequest() if request is None else request, timeout=self.timeout_s
        )
