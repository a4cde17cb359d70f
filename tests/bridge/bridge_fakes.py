"""Fakes for the bridge's unit tests: a scriptable in-process engine server, a
KV publisher that records what it is given, and a Dynamo frontend that answers
what a test tells it to."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import engine_contract
from bridge import codec
from bridge.admin.rl_admin import RlAdmin
from bridge.tagged_mux import rpc_error
from engine_contract.refit_rules import PhaseRefusal
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server import tracing
from engine_server.errors import ServerError
from engine_server.generate_stream import GenerateStream
from engine_server.rollout_stream import RolloutStream
from rl_client.refit_rpc import RefitRpc

if TYPE_CHECKING:
    from bridge.engine import BridgeEngine


@dataclass
class FakeEngine(pb_grpc.EngineServiceServicer):
    """Answers like an engine server; tests change its fields to script failures."""

    contract_revision: int = engine_contract.CONTRACT_REVISION
    minimum_client_revision: int = engine_contract.MINIMUM_CLIENT_REVISION
    instance_id: str = "inst-1"
    # When set, Rollout/Generate fail with this status and message.
    fail_with: tuple[grpc.StatusCode, str] | None = None
    # Rollout waits for its abort (or its release) before answering.
    hold_rollout: bool = False
    generate_tokens: int = 4
    generate_delay_s: float = 0.0
    rollouts: list[pb.RolloutRequest] = field(default_factory=list)
    # Rollouts that came over a Rollouts stream, and the streams opened.
    streamed_rollouts: int = 0
    rollout_streams: int = 0
    generates: list[pb.GenerateRequest] = field(default_factory=list)
    # Generates streams opened.
    generate_streams: int = 0
    aborts: list[pb.AbortRequest] = field(default_factory=list)
    # Each request's trace headers as the server kept them (engine_server.tracing).
    traces: dict[str, Mapping[str, str] | None] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    kv_batches: asyncio.Queue[pb.KvEventBatch | None] = field(default_factory=asyncio.Queue)
    kv_requests: list[pb.SubscribeKvEventsRequest] = field(default_factory=list)
    # The refit state its server info and load answer (weights, label, paused).
    refit_state: pb.RefitState = field(default_factory=pb.RefitState)
    # GetLoad calls answered.
    loads: int = 0
    _released: dict[str, asyncio.Event] = field(default_factory=dict)
    # Held rollouts let go to finish as they would have (not aborted).
    _finish: set[str] = field(default_factory=set)

    def info(self) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            contract_revision=self.contract_revision,
            minimum_client_revision=self.minimum_client_revision,
            instance_id=self.instance_id,
            model_name="fake-model",
            engine_config=pb.EngineConfig(
                context_length=512,
                kv_block_size=4,
                total_kv_blocks=100,
                max_running_sequences=8,
                max_batched_tokens=256,
            ),
            eos_token_ids=[1],
            vocab_size=1000,
            backend_name="fake",
            refit_state=self.refit_state,
        )

    async def GetServerInfo(self, request: Any, context: Any) -> pb.GetServerInfoResponse:
        if request.client_revision and request.client_revision < self.minimum_client_revision:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "client too old")
        return self.info()

    async def Rollout(self, request: Any, context: Any) -> pb.RolloutResponse:
        tracing.bind(context)
        try:
            return await self._answer(request)
        except ServerError as e:
            await context.abort(e.code, str(e))
        raise AssertionError("unreachable: context.abort raises")

    async def Rollouts(self, request_iterator: Any, context: Any) -> None:
        """The real server's stream handling around this fake's answers."""

        self.rollout_streams += 1

        async def answer(request: pb.RolloutRequest, into: pb.RolloutResponse) -> None:
            self.streamed_rollouts += 1
            into.CopyFrom(await self._answer(request))

        stream = RolloutStream(answer, context, max_message_bytes=64 << 20, write_timeout_s=None)
        try:
            await stream.serve(request_iterator)
        except ServerError as e:
            await context.abort(e.code, str(e))

    def _start(self, request_id: str) -> None:
        """A request arrives: its trace headers are kept, then it fails as
        ``fail_with`` says or runs (until the caller discards it from ``running``)."""
        self.traces[request_id] = tracing.trace_headers()
        if self.fail_with is not None:
            failure = ServerError(self.fail_with[1])
            failure.code = self.fail_with[0]
            raise failure
        self.running.add(request_id)

    async def _answer(self, request: pb.RolloutRequest) -> pb.RolloutResponse:
        self.rollouts.append(request)
        self._start(request.request_id)
        try:
            if self.hold_rollout:
                event = self._released.setdefault(request.request_id, asyncio.Event())
                await event.wait()
                if request.request_id not in self._finish:
                    return pb.RolloutResponse(
                        request_id=request.request_id,
                        finish_reason=pb.FINISH_REASON_ABORTED,
                        instance_id=self.instance_id,
                    )
            tokens = [t + 1 for t in request.prompt_token_ids][: request.max_new_tokens or 3]
            return pb.RolloutResponse(
                request_id=request.request_id,
                token_ids=tokens,
                logprobs=[-0.5 * (i + 1) for i in range(len(tokens))],
                finish_reason=pb.FINISH_REASON_LENGTH,
                truncated=True,
                usage=pb.Usage(
                    prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(tokens)
                ),
                instance_id=self.instance_id,
            )
        finally:
            self.running.discard(request.request_id)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        tracing.bind(context)
        try:
            async for message in self._deltas(request):
                yield message
        except ServerError as e:
            await context.abort(e.code, str(e))

    async def Generates(self, request_iterator: Any, context: Any) -> None:
        """The real server's stream handling around this fake's completions."""
        self.generate_streams += 1
        stream = GenerateStream(
            self._deltas, context, max_message_bytes=64 << 20, write_timeout_s=None
        )
        try:
            await stream.serve(request_iterator)
        except ServerError as e:
            await context.abort(e.code, str(e))

    async def _deltas(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        self.generates.append(request)
        self._start(request.request_id)
        try:
            for i in range(self.generate_tokens):
                await asyncio.sleep(self.generate_delay_s)
                yield pb.GenerateResponse(token_ids=[10 + i], logprobs=[-1.0])
            yield pb.GenerateResponse(
                finished=pb.GenerateFinished(
                    finish_reason=pb.FINISH_REASON_LENGTH,
                    usage=pb.Usage(
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=self.generate_tokens,
                    ),
                    instance_id=self.instance_id,
                )
            )
        finally:
            self.running.discard(request.request_id)

    def release(self, request_id: str) -> None:
        """Let a held rollout finish as it would have."""
        self._finish.add(request_id)
        self._released.setdefault(request_id, asyncio.Event()).set()

    async def Abort(self, request: Any, context: Any) -> pb.AbortResponse:
        self.aborts.append(request)
        event = self._released.setdefault(request.request_id, asyncio.Event())
        event.set()
        return pb.AbortResponse(outcome=pb.ABORT_OUTCOME_ABORTED, aborted_count=1)

    async def SubscribeKvEvents(
        self, request: Any, context: Any
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        self.kv_requests.append(request)
        while True:
            batch = await self.kv_batches.get()
            if batch is None:
                return
            yield pb.SubscribeKvEventsResponse(batch=batch)

    async def GetLoad(self, request: Any, context: Any) -> pb.GetLoadResponse:
        self.loads += 1
        return pb.GetLoadResponse(running_requests=len(self.running), refit_state=self.refit_state)


class FakeServer:
    """A FakeEngine on 127.0.0.1:<free port> on the test's own event loop."""

    def __init__(self, engine: FakeEngine | None = None) -> None:
        self.engine = engine or FakeEngine()
        self.server = grpc.aio.server()
        pb_grpc.add_EngineServiceServicer_to_server(self.engine, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> FakeServer:
        await self.set_serving(True)
        await self.server.start()
        return self

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        await self.health.set(engine_contract.SERVICE_NAME, status)

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(grace=None)


@asynccontextmanager
async def bridge_on(server: FakeServer, **config: Any) -> AsyncIterator[BridgeEngine]:
    """A bridge in front of ``server`` (model path "/m", the other BridgeConfig
    fields from ``config``), started as Dynamo starts one (worker 1) and cleaned
    up when the block ends, however it ends."""
    # Imported here: the bridge's config and engine import Dynamo; the other fakes do not.
    from bridge.config import BridgeConfig
    from bridge.engine import BridgeEngine

    engine = BridgeEngine(BridgeConfig(engine_address=server.address, model_path="/m", **config))
    await engine.start(worker_id=1)
    try:
        yield engine
    finally:
        await engine.cleanup()


async def annotated_chunks(
    engine: BridgeEngine, annotation: str, ctx: str = "c1"
) -> list[dict[str, Any]]:
    """What ``engine`` answers a request of three prompt tokens carrying
    ``annotation`` (a rollout's spec, its weight version), as Dynamo hands it one."""
    from dynamo._core import Context  # Dynamo's: imported here, as in bridge_on

    request = {"token_ids": [5, 6, 7], "annotations": [annotation]}
    return [chunk async for chunk in engine.generate(request, context=Context(id=ctx))]


@dataclass
class RecordingPublisher:
    """Stands in for Dynamo's KvEventPublisher."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def publish_stored(self, **kwargs: Any) -> None:
        self.calls.append(("stored", kwargs))

    def publish_removed(self, block_hashes: list[int]) -> None:
        self.calls.append(("removed", {"block_hashes": list(block_hashes)}))

    def live_hashes(self) -> set[int]:
        """What the router believes this worker holds after all calls."""
        live: set[int] = set()
        for kind, kwargs in self.calls:
            if kind == "stored":
                live.update(kwargs["block_hashes"])
            else:
                live.difference_update(kwargs["block_hashes"])
        return live


def frontend_body(resp: pb.RolloutResponse) -> dict[str, Any]:
    """What the frontend answers: the chunk's engine_data as nvext.engine_data, via JSON."""
    chunk = codec.rollout_chunk(resp)
    body = {
        "id": "cmpl-1",
        "choices": [{"index": 0, "text": "", "finish_reason": chunk["finish_reason"]}],
        "usage": chunk["completion_usage"],
        "nvext": {"engine_data": chunk["engine_data"], "worker_id": {"decode_worker_id": 7}},
    }
    return json.loads(json.dumps(body, allow_nan=False))


async def serve_loopback(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serves app on a free loopback port; returns its runner (to clean up) and base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def fake_frontend(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    return await serve_loopback(app)


class FakeRegistration:
    """The worker's registration, doing nothing when RlAdmin leaves or rejoins it."""

    in_pool = True

    async def leave(self, why: str) -> None: ...

    async def rejoin(self, why: str) -> None: ...


def rl_admin(client: Any) -> RlAdmin:
    """RlAdmin over a fake engine client (one with a ``refit`` RefitRpc)."""
    return RlAdmin(lambda: client, FakeRegistration())  # type: ignore[arg-type]


class Scripts(Protocol):
    """A fake engine that answers each RPC by its name (``GetWeightVersion``...)."""

    async def handle(self, method: str, request: Any) -> Any: ...


class _ScriptedStub:
    """An engine stub whose every method is ``engine.handle(its name, request)``."""

    def __init__(self, engine: Scripts) -> None:
        self._engine = engine

    def __getattr__(self, method: str) -> Any:
        async def call(request: Any, timeout: float | None = None) -> Any:
            return await self._engine.handle(method, request)

        return call


def scripted_refit(engine: Scripts) -> RefitRpc:
    """The RefitRpc RlAdmin calls, each RPC answered by ``engine.handle``: a fake
    engine scripts the refit rules by method name, with no gRPC server."""
    return RefitRpc(_ScriptedStub(engine))  # type: ignore[arg-type]


# The weight-transfer phases, in their order.
TRANSFER_PHASES = ("StartWeightUpdate", "UpdateWeights", "FinishWeightUpdate")


def transfer_after(method: str, started: bool) -> bool:
    """Whether a weight update is in progress after ``method`` (one of
    ``TRANSFER_PHASES``) when one was (``started``) before it. A phase out of
    order is refused as the engine server refuses it: FAILED_PRECONDITION in
    ``PhaseRefusal``'s words."""
    if method == "StartWeightUpdate":
        if started:
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, PhaseRefusal.ALREADY_STARTED.value)
        return True
    if not started:
        raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, PhaseRefusal.NOT_STARTED.value)
    return method != "FinishWeightUpdate"
