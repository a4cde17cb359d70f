"""An engine server over gRPC, as tests see it: served in this process on its own
loop, its load (and waits on it), its health, its KV cache."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine_contract
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.base import EngineBackend
from engine_server.config import ServerConfig
from engine_server.server import EngineServerHandle
from harness.procs import Proc, ProcessGroup
from harness.waits import WaitTimeout, Watched, wait_until

T = TypeVar("T")
LoadPredicate = Callable[[pb.GetLoadResponse], bool]


def sim_cli_args(*extra: str) -> list[str]:
    """The engine-server command line (after ``python -m engine_server``) of a sim
    server on a free loopback port."""
    return ["--backend", "sim", "--listen", "127.0.0.1:0", *extra]


def long_sim_args(decode_step_ms: float) -> tuple[str, ...]:
    """Sim flags for requests that run long without ignore_eos (which would also switch
    off the frontend's stop strings): EOS is never the likeliest token."""
    return ("--eos-rate", "0", "--decode-step-ms", f"{decode_step_ms:g}")


def kv_sim_args(block: int) -> tuple[str, ...]:
    """Sim flags for KV-routing tests: ``block``-token KV blocks, EOS never the
    likeliest token, 1 ms decode steps."""
    return ("--block-size", str(block), "--eos-rate", "0", "--decode-step-ms", "1")


def tiny_vllm_args(max_model_len: int = 1024) -> list[str]:
    """vLLM engine flags for the tiny model on a CPU (or GPU): fp32, eager, a 64 MiB
    KV cache (after ``--backend vllm --model DIR``)."""
    return [
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(64 << 20),
    ]


def weight_transfer_args(backend: str) -> list[str]:
    """The engine-server flags that give vLLM's weight-transfer engine ``backend``
    ("gloo", "nccl") to trainers."""
    return ["--weight-transfer-config", json.dumps({"backend": backend})]


def tiny_vllm_server(
    group: ProcessGroup,
    name: str,
    model_dir: Path,
    *flags: str,
    max_model_len: int = 1024,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> tuple[Proc, str]:
    """A vLLM engine server (``tiny_vllm_args``, then ``flags``) of ``model_dir`` in
    ``group``, ``env`` added to this process's; (proc, address) once it has its address."""
    return group.engine_server(
        name,
        "--model",
        str(model_dir),
        *tiny_vllm_args(max_model_len),
        *flags,
        backend="vllm",
        env=env,
        timeout=timeout,
    )


class InProcessServer:
    """An engine server on its own event loop in a daemon thread of this process.

    Its own loop keeps it independent of pytest-asyncio's per-test loops, while
    still being in-process (real gRPC over a real socket).
    """

    def __init__(self, backend: EngineBackend, config: ServerConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._handle: EngineServerHandle | None = None
        self._backend = backend
        self._config = config

    @classmethod
    def from_cli(cls, *argv: str) -> InProcessServer:
        """The server ``python -m engine_server ARGV`` would run (not started yet)."""
        from engine_server import cli

        return cls(*cli.backend_and_config(cli.parse_args(list(argv))))

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def start(self, wait_ready: bool = True) -> InProcessServer:
        from engine_server.server import start_server

        self._handle = self.run(start_server(self._backend, self._config))
        if wait_ready:
            self.run(self._handle.wait_ready())
        return self

    @property
    def handle(self) -> EngineServerHandle:
        if self._handle is None:
            raise RuntimeError("start() first")
        return self._handle

    @property
    def address(self) -> str:
        return self.handle.address

    def stop(self, grace: float = 0) -> None:
        if self._handle is not None:
            self.run(self._handle.stop(grace))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class ClientMessages(Generic[T]):
    """The client side of a bidirectional stream, for a handler run without gRPC:
    put messages on ``queue``, then None to half-close; iterating yields them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[T | None] = asyncio.Queue()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[T]:
        while (message := await self.queue.get()) is not None:
            yield message


class StreamContext(Generic[T]):
    """The servicer context of a stream handler run without gRPC: records the
    messages written; while ``gate`` is clear, writes wait (a slow client, or one
    that stopped reading)."""

    def __init__(self) -> None:
        self.written: list[T] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def send_initial_metadata(self, metadata: object) -> None:
        pass

    async def write(self, message: T) -> None:
        await self.gate.wait()
        self.written.append(message)


# -- load --------------------------------------------------------------------


def idle(load: pb.GetLoadResponse) -> bool:
    """Nothing running, waiting or registered."""
    return (
        load.running_requests == 0 and load.waiting_requests == 0 and load.registered_requests == 0
    )


async def aiter_of(items: Iterable[T]) -> AsyncIterator[T]:
    """``items`` as an async iterator: a client's request stream, fed to a handler
    called in-process (``engine_server.refit_requests.update_from_tensors``)."""
    for item in items:
        yield item


async def nothing(*args: object) -> None:
    """A backend step that does nothing, put in place of one a test does not carry
    (a weight-transfer engine's phases on the sim, which has none)."""


def refit_state(
    version: str = "default",
    declared: bool = False,
    *,
    paused: bool = False,
    sleeping: bool = False,
    mixed: str = "",
    update_open: bool = False,
) -> pb.RefitState:
    """The refit state an engine server reports (in its info and its load), for
    fakes and the rules judged on it: serving ``version``, ``declared`` when a
    refit set it (else the start checkpoint's label), paused or asleep, its
    weights not whole (``mixed``: why) and a weight-transfer update open."""
    return pb.RefitState(
        weight_version=version,
        weight_version_declared=declared,
        paused=paused,
        sleeping=sleeping,
        weights_mixed=mixed,
        weight_update_open=update_open,
    )


def load(address: str) -> pb.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.EngineServiceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=5)


def wait_load(
    address: str,
    predicate: LoadPredicate,
    timeout: float = 5.0,
    what: str = "load",
    interval: float = 0.02,
) -> pb.GetLoadResponse:
    """Poll GetLoad until ``predicate(load)`` holds and return that load; WaitTimeout
    (with the last load) after ``timeout`` seconds."""
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        while True:
            last = stub.GetLoad(pb.GetLoadRequest(), timeout=5)
            if predicate(last):
                return last
            if time.monotonic() - started > timeout:
                raise WaitTimeout(f"{what}: not within {timeout}s; last load: {last}", last)
            time.sleep(interval)


async def wait_load_async(
    stub: pb_grpc.EngineServiceStub,
    predicate: LoadPredicate,
    timeout: float = 5.0,
    what: str = "load",
    interval: float = 0.02,
) -> pb.GetLoadResponse:
    """``wait_load`` on an asyncio stub (``grpc.aio``)."""
    started = time.monotonic()
    while True:
        last: pb.GetLoadResponse = await stub.GetLoad(pb.GetLoadRequest(), timeout=5)
        if predicate(last):
            return last
        if time.monotonic() - started > timeout:
            raise WaitTimeout(f"{what}: not within {timeout}s; last load: {last}", last)
        await asyncio.sleep(interval)


# -- rollouts --------------------------------------------------------------------


def prompt_of(n: int, seed: int) -> list[int]:
    """``n`` prompt tokens, the same for a ``seed`` wherever they are asked for (in
    the tiny model's vocabulary, clear of its special tokens), so that a test
    compares its paths on equal prompts without storing any."""
    return [(seed * 131 + i * 17) % 1000 + 3 for i in range(n)]


def greedy_rollout(
    stub: pb_grpc.EngineServiceStub,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    request_id: str = "",
    timeout: float = 60,
) -> pb.RolloutResponse:
    """One greedy Rollout of ``prompt`` straight from an engine server (under a fresh
    request id unless ``request_id`` is given)."""
    answer: pb.RolloutResponse = stub.Rollout(
        pb.RolloutRequest(
            request_id=request_id or f"greedy-{time.monotonic_ns()}",
            prompt_token_ids=prompt,
            greedy=True,
            max_new_tokens=max_new_tokens,
        ),
        timeout=timeout,
    )
    return answer


def tokens_and_logprobs(answer: pb.RolloutResponse) -> tuple[list[int], list[float]]:
    """A rollout's tokens and logprobs, as plain lists to compare bit for bit."""
    return list(answer.token_ids), list(answer.logprobs)


def version_spans(answer: pb.RolloutResponse) -> list[tuple[str, int, int]]:
    """A rollout's weight-version spans as (version, start, end)."""
    return [(s.version, s.start, s.end) for s in answer.weight_versions]


# -- clients that stop reading ------------------------------------------------------

# A sim server with room for one very long completion, made with no delay.
FLOOD_SIM_ARGS = ("--zero-delay", "--context-length", "32768", "--num-kv-blocks", "2100")


def flood_generate(request_id: str, max_tokens: int) -> pb.GenerateRequest:
    """A Generate of deltas of one token with 20 top logprobs (~400 bytes each), EOS
    ignored: for thousands of tokens, far more than the socket and HTTP/2 windows
    hold, so the server's writes block once the client stops reading."""
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(range(10, 42)),
        stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True),
        output=pb.OutputOptions(logprobs=20),
    )


def own_channel(address: str, *options: tuple[str, int]) -> grpc.aio.Channel:
    """A channel on its own connection (local subchannel pool): a stalled stream
    must not share flow-control windows with the control calls."""
    return grpc.aio.insecure_channel(
        address, options=[("grpc.use_local_subchannel_pool", 1), *options]
    )


# -- health and the KV cache -----------------------------------------------------


def health_status(address: str, service: str = engine_contract.SERVICE_NAME) -> int:
    """The server's gRPC health status for ``service`` (raises when it does not answer)."""
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(answer.status)


def wait_serving(address: str, timeout: float, procs: Sequence[Watched] = ()) -> None:
    """Until the engine server at ``address`` says SERVING (its engine is ready)."""

    def serving() -> bool:
        try:
            return health_status(address) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    wait_until(serving, timeout, f"{address} SERVING", procs, interval=0.5)


def snapshot_blocks(address: str) -> int:
    """Blocks in the engine's KV cache, from a SubscribeKvEvents snapshot."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        call = stub.SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(include_snapshot=True), timeout=10
        )
        blocks = 0
        try:
            for response in call:
                batch = response.batch
                blocks += sum(
                    len(e.stored.block_hashes) for e in batch.events if e.HasField("stored")
                )
                if not batch.HasField("snapshot") or batch.snapshot.last:
                    break
        finally:
            call.cancel()
        return blocks
