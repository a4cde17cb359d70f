"""EngineClient: the bridge's one long-lived gRPC channel to one engine server.

No Dynamo here. Request RPCs (Rollout, Generate) fail fast when the server is
unreachable, so Dynamo can migrate the request at once; control RPCs carry
deadlines; the start-up wait and the KV-event stream use ``wait_for_ready``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine_contract
from bridge.generate_mux import GenerateMux, PendingGenerate
from bridge.rollout_mux import PendingRollout, RolloutMux, StreamLimits
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from launch.config_flags import flag
from rl_client.refit_rpc import RefitRpc
from rl_client.tls import TlsOptions, aio_channel, diagnose

log = logging.getLogger(__name__)

MIB = 1024 * 1024


class Health(enum.Enum):
    SERVING = "serving"
    # It answers, but serves nothing now: starting, draining, asleep.
    NOT_SERVING = "not serving"
    # No answer: down, wedged (SIGSTOP), or gone with its host.
    UNREACHABLE = "unreachable"


class EngineNotReadyError(RuntimeError):
    """The engine server did not become ready within the start-up wait."""


class EngineTlsError(EngineNotReadyError):
    """The TLS handshake with the engine server fails (``rl_client.tls.diagnose`` says why)."""


class IncompatibleServerError(RuntimeError):
    """The engine server speaks a contract revision this bridge cannot use."""


@dataclass(frozen=True)
class ClientOptions:
    # Fields with flag(...) metadata are the bridge's flags (bridge.config), each
    # with its environment variable (BRIDGE_ and the flag: BRIDGE_ABORT_TIMEOUT_S).
    max_message_bytes: int = field(
        default=64 * MIB,
        metadata=flag("Largest gRPC message sent or received, bytes."),
    )
    # Pings find a dead peer during a long unary Rollout that sends nothing; the
    # engine server allows pings every 10 s, also without calls.
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    # Reconnect quickly after an engine-server restart: gRPC's reconnect backoff
    # (x1.6 per attempt, +-20% jitter) starts at initial and is capped here (its
    # default cap is 120 s). A loopback or LAN connection attempt is cheap; a
    # low cap lets the bridge serve again well within a second of the restarted
    # server being ready.
    initial_reconnect_backoff_s: float = 0.1
    max_reconnect_backoff_s: float = 0.5
    # Deadline of the health probe Dynamo's canary triggers.
    health_timeout_s: float = 1.0
    # Deadline of GetEngineMetrics, asked at each scrape of the worker's /metrics
    # (past it the scrape goes without the engine's series).
    metrics_timeout_s: float = 1.0
    control_timeout_s: float = field(
        default=10.0, metadata=flag("Deadline of control RPCs, seconds.")
    )
    abort_timeout_s: float = field(default=5.0, metadata=flag("Deadline of Abort RPCs, seconds."))
    # TLS to the engine server (None: plaintext, for loopback and unix sockets).
    tls: TlsOptions | None = None
    # Pace streamed completions: the engine server sends a completion's next delta
    # once the bridge has handed the last to Dynamo, so each carries what came
    # meanwhile. False: every delta as it comes.
    paced_generates: bool = field(
        default=True,
        metadata=flag(
            "On a Generates stream, 'on' has the engine server send a completion's "
            "next delta once the bridge has handed the last to Dynamo, so each delta "
            "carries the tokens made meanwhile (fewer, larger deltas: less CPU per "
            "token in every process on the way); 'off' sends every delta as it comes.",
            name="--generate-pacing",
            choices={"on": True, "off": False},
        ),
    )

    def channel_options(self) -> list[tuple[str, int | str]]:
        tls = self.tls.channel_options() if self.tls else []
        return [
            *tls,
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_reconnect_backoff_ms", int(self.max_reconnect_backoff_s * 1000)),
            ("grpc.initial_reconnect_backoff_ms", int(self.initial_reconnect_backoff_s * 1000)),
            # The bridge decides itself what to retry.
            ("grpc.enable_retries", 0),
        ]


def check_compatible(info: pb.GetServerInfoResponse, address: str) -> None:
    """Fail closed outside the revisions both sides accept."""
    if info.contract_revision < engine_contract.MINIMUM_SERVER_REVISION:
        raise IncompatibleServerError(
            f"engine server at {address} implements contract revision "
            f"{info.contract_revision}, but this bridge needs at least revision "
            f"{engine_contract.MINIMUM_SERVER_REVISION}: upgrade the engine server"
        )
    if engine_contract.CONTRACT_REVISION < info.minimum_client_revision:
        raise IncompatibleServerError(
            f"engine server at {address} accepts clients from contract revision "
            f"{info.minimum_client_revision}, but this bridge implements revision "
            f"{engine_contract.CONTRACT_REVISION}: upgrade the bridge"
        )


class EngineClient:
    """Typed calls on one channel. ``close()`` is idempotent."""

    def __init__(self, address: str, options: ClientOptions | None = None) -> None:
        self.address = address
        self.options = options or ClientOptions()
        self._channel: grpc.aio.Channel | None = aio_channel(
            address, self.options.tls, self.options.channel_options()
        )
        self._stub = pb_grpc.EngineServiceStub(self._channel)
        # The refit cycle's RPCs, typed. No deadline: a WAIT pause lasts until the
        # requests in flight finish, and a large checkpoint takes its time to load.
        self.refit = RefitRpc(self._stub)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._rollouts = RolloutMux(
            lambda: self._stub.Rollouts(wait_for_ready=False), self.options.max_message_bytes
        )
        self._generates = GenerateMux(
            lambda: self._stub.Generates(wait_for_ready=False), self.options.max_message_bytes
        )

    @property
    def paced_generates(self) -> bool:
        """Whether completions started from now on are paced."""
        return self._generates.paced

    def use_server_limits(self, info: pb.GetServerInfoResponse) -> None:
        """Keep the rollouts and completions streams within the server's announced
        limits: message size, starts per message, requests on a stream; pace
        completions unless the options say not to (``paced_generates``)."""
        self._generates.paced = self.options.paced_generates
        limits = info.limits
        for mux in (self._rollouts, self._generates):
            if limits.max_message_bytes > 0:
                mux.max_message_bytes = min(
                    self.options.max_message_bytes, limits.max_message_bytes
                )
            mux.limits = StreamLimits(
                max_starts=limits.max_starts_per_message,
                max_in_flight=limits.max_rollouts_per_stream,
            )

    async def wait_ready(self, timeout_s: float) -> pb.GetServerInfoResponse:
        """Wait for GetServerInfo to succeed (UNAVAILABLE until the engine is up), then
        check the contract revision. Raises EngineNotReadyError or IncompatibleServerError."""
        deadline = time.monotonic() + timeout_s
        delay = 0.1
        last = "no answer"
        # A server already up that fails our handshake says so now, not after a call's
        # whole deadline of waiting for a connection that cannot come.
        await self._refuse_on_tls_failure()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineNotReadyError(
                    f"engine server at {self.address} not ready after {timeout_s:.0f}s ({last})"
                )
            try:
                info = await self._stub.GetServerInfo(
                    pb.GetServerInfoRequest(client_revision=engine_contract.CONTRACT_REVISION),
                    timeout=min(remaining, self.options.control_timeout_s),
                    wait_for_ready=True,
                )
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise IncompatibleServerError(
                        f"engine server at {self.address} refused this bridge "
                        f"(contract revision {engine_contract.CONTRACT_REVISION}): {e.details()}"
                    ) from e
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = f"{e.code().name}: {e.details()}"
                await self._refuse_on_tls_failure()
                log.debug("engine server at %s not ready yet: %s", self.address, last)
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 2.0)
                continue
            check_compatible(info, self.address)
            return info

    async def _refuse_on_tls_failure(self) -> None:
        """With TLS, a server that answers but fails the handshake will not accept us
        later either: raise EngineTlsError saying why rather than wait."""
        tls = self.options.tls
        if tls is None:
            return
        reason = await asyncio.to_thread(diagnose, self.address, tls)
        if reason is not None:
            raise EngineTlsError(
                f"TLS to the engine server at {self.address} fails ({tls.describe()}): {reason}"
            )

    async def health(self) -> Health:
        """The engine server's health for the contract's service now (fails fast:
        no waiting for a connection): UNREACHABLE when it does not answer."""
        try:
            answer = await self._health.Check(
                health_pb2.HealthCheckRequest(service=engine_contract.SERVICE_NAME),
                timeout=self.options.health_timeout_s,
                wait_for_ready=False,
            )
        except grpc.aio.AioRpcError:
            return Health.UNREACHABLE
        if answer.status == health_pb2.HealthCheckResponse.SERVING:
            return Health.SERVING
        return Health.NOT_SERVING

    async def serving(self) -> bool:
        """Whether the engine server answers SERVING now."""
        return await self.health() is Health.SERVING

    async def server_info(self) -> pb.GetServerInfoResponse:
        return await self._stub.GetServerInfo(
            pb.GetServerInfoRequest(client_revision=engine_contract.CONTRACT_REVISION),
            timeout=self.options.control_timeout_s,
        )

    def rollout(
        self, request: pb.RolloutRequest, metadata: grpc.aio.Metadata | None = None
    ) -> grpc.aio.UnaryUnaryCall:
        """The call object, so that an abort can cancel it; await it for the answer.
        ``metadata``: the request's trace context (``traceparent``, ``x-request-id``)."""
        return self._stub.Rollout(request, wait_for_ready=False, metadata=metadata)

    def stream_rollout(
        self, request: pb.RolloutRequest, trace: Mapping[str, str] | None = None
    ) -> PendingRollout:
        """A rollout on the shared Rollouts stream; await it for the answer, cancel()
        to abort. Fails like the Rollout call would (``grpc.aio.AioRpcError``).
        ``trace``: the request's W3C trace context (``traceparent``, ``tracestate``)."""
        return self._rollouts.start(request, trace)

    def generate(
        self, request: pb.GenerateRequest, metadata: grpc.aio.Metadata | None = None
    ) -> grpc.aio.UnaryStreamCall:
        return self._stub.Generate(request, wait_for_ready=False, metadata=metadata)

    def stream_generate(
        self, request: pb.GenerateRequest, trace: Mapping[str, str] | None = None
    ) -> PendingGenerate:
        """A completion on the shared Generates stream; iterate it for its deltas,
        cancel() to abort. Fails like the Generate call would. ``trace``: as for
        ``stream_rollout``."""
        return self._generates.start(request, trace)

    async def abort(self, request_id: str, instance_id: str = "") -> pb.AbortResponse:
        return await self._stub.Abort(
            pb.AbortRequest(request_id=request_id, instance_id=instance_id),
            timeout=self.options.abort_timeout_s,
        )

    async def abort_all(self) -> pb.AbortResponse:
        """Every request the engine server runs, aborted (vLLM's ``/abort_requests``
        without ids: the RL routes, ``bridge.admin.rl_admin``)."""
        return await self._stub.Abort(
            pb.AbortRequest(all=True), timeout=self.options.abort_timeout_s
        )

    def subscribe_kv_events(self, request: pb.SubscribeKvEventsRequest) -> grpc.aio.UnaryStreamCall:
        return self._stub.SubscribeKvEvents(request, wait_for_ready=True)

    async def get_load(self) -> pb.GetLoadResponse:
        return await self._stub.GetLoad(pb.GetLoadRequest(), timeout=self.options.control_timeout_s)

    async def get_engine_metrics(self, timeout_s: float) -> str:
        """The engine's own Prometheus series as exposition text (revision 9);
        fails fast (no wait for a connection): a scrape waits on it."""
        answer = await self._stub.GetEngineMetrics(
            pb.GetEngineMetricsRequest(), timeout=timeout_s, wait_for_ready=False
        )
        return answer.text

    async def close(self) -> None:
        await self._rollouts.close()
        await self._generates.close()
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(grace=None)
