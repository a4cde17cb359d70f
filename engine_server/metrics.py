"""The engine server's Prometheus metrics, and the endpoint serving them.

Every metric object lives here, created once per process in prometheus_client's
default registry: vLLM registers its own ``vllm:`` metrics there too (when its
stats are on, the default), so one endpoint serves both, with the process
collectors. Hot paths call a few pre-bound children (``.labels()`` resolved at
import), never anything per token; state (requests running, subscribers, paused,
weight version) is read from the server at scrape time by ``ServerCollector``.

Times per request, split as the server can honestly see them: **queue** is the
time from the request's arrival in the core until the engine was handed it
(admission and a paused engine's gate); **engine** from then until the last
output, which includes the engine's own scheduler queue (no backend reports
that apart: ``EngineOutput`` carries no timestamps); **total** both.

The endpoint is a minimal HTTP server on the server's own event loop (no thread
reading the server's state while the loop changes it): ``GET /metrics``.

``engine_series`` is the engine's own part of the registry (``GetEngineMetrics``):
what a Dynamo worker of that engine publishes, so that the bridge can publish it
in its worker's ``/metrics`` wherever this server runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_contract.metric_buckets import LATENCY_BUCKETS, PER_MESSAGE_BUCKETS
from engine_contract.v1 import engine_pb2 as pb

if TYPE_CHECKING:
    from engine_server.core import ServerCore

log = logging.getLogger(__name__)
# No ``*_created`` series: they double a scrape and no dashboard here reads them.
disable_created_metrics()


RPC_CALLS = Counter(
    "engine_server_rpc_calls",
    "Contract RPCs ended, by method and gRPC status code (a stream counts once)",
    ["method", "code"],
)
REQUESTS = Counter(
    "engine_server_requests",
    "Rollouts and completions answered by the engine, by finish reason",
    ["kind", "finish_reason"],
)
QUEUE_SECONDS = Histogram(
    "engine_server_request_queue_seconds",
    "Time from a request's arrival until the engine was handed it (admission, pause gate)",
    ["kind"],
    buckets=LATENCY_BUCKETS,
)
ENGINE_SECONDS = Histogram(
    "engine_server_request_engine_seconds",
    "Time in the engine until the last output (includes the engine's scheduler queue)",
    ["kind"],
    buckets=LATENCY_BUCKETS,
)
TOTAL_SECONDS = Histogram(
    "engine_server_request_duration_seconds",
    "Time from a request's arrival in the server until its last output",
    ["kind"],
    buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter(
    "engine_server_prompt_tokens", "Prompt tokens of answered requests", ["kind"]
)
GENERATION_TOKENS = Counter(
    "engine_server_generation_tokens", "Tokens generated for answered requests", ["kind"]
)
ABORTS = Counter(
    "engine_server_aborts",
    "Engine requests aborted, by cause: client_cancel (a cancelled call or a stream's "
    "cancel or end), abort_rpc, drain (shutdown grace over), watchdog (a stalled "
    "stream), pause (PauseGeneration ABORT), weight_change (a version-guarded request "
    "whose weights changed under it)",
    ["cause"],
)
WEIGHT_VERSION_REFUSALS = Counter(
    "engine_server_weight_version_refusals",
    "Version-guarded requests refused, nothing generated: the weights serving carry "
    "another label (drivers asking for a version this server does not serve)",
)
KV_EVENTS = Counter("engine_server_kv_events", "KV events the engine emitted")
KV_BATCHES = Counter("engine_server_kv_batches", "KV-event batches numbered by the hub")
KV_EVICTIONS = Counter(
    "engine_server_kv_replay_evictions",
    "KV-event batches pushed out of the replay buffer (resuming past them takes a snapshot)",
)
KV_SNAPSHOTS = Counter(
    "engine_server_kv_snapshots", "KV snapshots served to subscribers (one per snapshot)"
)
KV_BATCHES_PER_MESSAGE = Histogram(
    "engine_server_kv_batches_per_message",
    "KV-event batches per SubscribeKvEvents message",
    buckets=PER_MESSAGE_BUCKETS,
)
STREAM_ITEMS_PER_MESSAGE = Histogram(
    "engine_server_stream_items_per_message",
    "Answers (rollouts) or deltas (completions) per message written on a multiplexed stream",
    ["stream"],
    buckets=PER_MESSAGE_BUCKETS,
)

# The engine's own families: those dynamo.vllm forwards from prometheus_client's
# registry into its worker's /metrics (its ``engine_metric_prefixes``).
ENGINE_PREFIXES = ("vllm:", "lmcache:")

ABORT_CLIENT_CANCEL = ABORTS.labels("client_cancel")
ABORT_RPC = ABORTS.labels("abort_rpc")
ABORT_DRAIN = ABORTS.labels("drain")
ABORT_WATCHDOG = ABORTS.labels("watchdog")
ABORT_PAUSE = ABORTS.labels("pause")
ABORT_WEIGHT_CHANGE = ABORTS.labels("weight_change")

_FINISH_NAMES = [
    (value, pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower())
    for value in pb.FinishReason.values()
]


class RequestKind:
    """One kind's children, bound once: ``finished()`` is the whole per-request cost."""

    def __init__(self, kind: str) -> None:
        self._queue = QUEUE_SECONDS.labels(kind)
        self._engine = ENGINE_SECONDS.labels(kind)
        self._total = TOTAL_SECONDS.labels(kind)
        self._prompt = PROMPT_TOKENS.labels(kind)
        self._generated = GENERATION_TOKENS.labels(kind)
        self._by_reason = {value: REQUESTS.labels(kind, name) for value, name in _FINISH_NAMES}

    def finished(
        self, arrived: float, engine_from: float | None, finish_reason: int, usage: pb.Usage
    ) -> None:
        """``arrived``/``engine_from``: ``time.perf_counter()`` readings (None: the
        engine never ran it)."""
        now = time.perf_counter()
        self._total.observe(now - arrived)
        if engine_from is not None:
            self._queue.observe(engine_from - arrived)
            self._engine.observe(now - engine_from)
        self._prompt.inc(usage.prompt_tokens)
        self._generated.inc(usage.completion_tokens)
        self._by_reason[finish_reason].inc()


ROLLOUT = RequestKind("rollout")
GENERATE = RequestKind("generate")


class RpcCounter:
    """One method's ``engine_server_rpc_calls_total`` children, by code, bound on first use."""

    def __init__(self, method: str) -> None:
        self._method = method
        self._children: dict[grpc.StatusCode, Counter] = {}

    def ended(self, code: grpc.StatusCode) -> None:
        child = self._children.get(code)
        if child is None:
            child = self._children[code] = RPC_CALLS.labels(self._method, code.name)
        child.inc()


class ServerCollector(Collector):
    """State read from one server at scrape time: nothing to update on the hot path."""

    def __init__(self, core: ServerCore) -> None:
        self._core = core

    def collect(self) -> Iterable[Metric]:
        core = self._core
        load = core.load()
        for name, value, doc in (
            ("engine_server_requests_running", load.running_requests, "Requests the engine runs"),
            ("engine_server_requests_waiting", load.waiting_requests, "Requests the engine queues"),
            (
                "engine_server_requests_registered",
                load.registered_requests,
                "Requests registered in the server (admitted, not yet ended)",
            ),
            ("engine_server_kv_blocks_used", load.kv_blocks_used, "KV-cache blocks in use"),
            ("engine_server_kv_subscribers", core.hub.subscribers, "Open KV-event subscriptions"),
            (
                "engine_server_paused",
                int(core.refit.paused is not None),
                "1 while generation is paused (PauseGeneration, --start-paused)",
            ),
            ("engine_server_draining", int(core.draining), "1 while the server drains"),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        version = InfoMetricFamily("engine_server_weight_version", "The weights serving now")
        version.add_metric([], {"version": core.refit.version})
        yield version
        info = core.info
        server = InfoMetricFamily("engine_server", "This engine server (a new instance per start)")
        server.add_metric(
            [],
            {
                "instance_id": core.instance_id,
                "backend": info.backend_name if info else "",
                "backend_version": info.backend_version if info else "",
                "model": info.model_name if info else "",
            },
        )
        yield server


class MetricsEndpoint:
    """``GET /metrics`` on the server's loop; ``start()`` binds, ``close()`` stops."""

    def __init__(
        self, core: ServerCore, host: str, port: int, registry: CollectorRegistry = REGISTRY
    ) -> None:
        self._host = host
        self._port = port
        self._registry = registry
        self._collector = ServerCollector(core)
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        try:
            self._server = await asyncio.start_server(self._handle, self._host, self._port)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {self._host}:{self._port}: {e}") from e
        self._registry.register(self._collector)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"http://{host if ':' not in host else f'[{host}]'}:{port}/metrics"
        log.info("metrics on %s", self.address)
        return self.address

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._registry.unregister(self._collector)
        server.close()
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            status, body, kind = self._answer(head.split(b"\r\n", 1)[0].split())
            writer.write(
                b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n" % (status, kind.encode(), len(body))
            )
            if not head.startswith(b"HEAD"):
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            writer.close()

    def _answer(self, request_line: list[bytes]) -> tuple[bytes, bytes, str]:
        if len(request_line) < 2 or request_line[0] not in (b"GET", b"HEAD"):
            return b"405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        if request_line[1].split(b"?", 1)[0] not in (b"/metrics", b"/"):
            return b"404 Not Found", b"GET /metrics\n", "text/plain"
        return b"200 OK", generate_latest(self._registry), CONTENT_TYPE_LATEST


class _Only(Collector):
    """The families of ``registry`` whose names start with ``prefixes``."""

    def __init__(self, registry: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        self._registry = registry
        self._prefixes = prefixes

    def collect(self) -> Iterable[Metric]:
        return (m for m in self._registry.collect() if m.name.startswith(self._prefixes))

    def describe(self) -> Iterable[Metric]:
        return []


def engine_series(
    registry: CollectorRegistry = REGISTRY, prefixes: tuple[str, ...] = ENGINE_PREFIXES
) -> str:
    """The engine's families of ``registry`` as exposition text (``GetEngineMetrics``),
    read now; empty when it has none (the simulated engine)."""
    only = CollectorRegistry(auto_describe=False)
    only.register(_Only(registry, prefixes))
    return generate_latest(only).decode()


def samples(registry: CollectorRegistry = REGISTRY) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample as (name, labels, value) (tests, tools)."""
    for metric in registry.collect():
        for sample in metric.samples:
            yield sample.name, sample.labels, sample.value
