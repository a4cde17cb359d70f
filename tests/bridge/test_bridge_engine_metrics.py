"""The engine's own series (vLLM's ``vllm:``) on the worker's system port /metrics.

A real SystemServer on loopback in front of a stand-in for Dynamo's system
server, and a fake engine server whose GetEngineMetrics answers what the engine
server's ``engine_series`` makes of a registry holding vLLM-like metrics (and
one that is not the engine's). Read back both as Prometheus parses the scrape and
as NeMo RL's DynamoMetricsSampler does (``harness.nemo_rl.sampler_metrics``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
import grpc
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import engine_contract
from bridge.admin.system_server import SystemPort, SystemServer
from bridge.client import EngineClient
from bridge.engine_metrics import EngineSeries
from engine_contract.v1 import engine_pb2 as pb
from engine_server.metrics import engine_series
from harness.metrics import Samples
from harness.nemo_rl import sampler_metrics
from harness.ports import free_system_port
from tests.bridge.bridge_fakes import FakeEngine, FakeServer, serve_loopback

pytestmark = pytest.mark.serial

DYNAMO_TEXT = (
    "# HELP dynamo_component_requests_total Requests\n"
    "# TYPE dynamo_component_requests_total counter\n"
    'dynamo_component_requests_total{dynamo_namespace="ns"} 3\n'
)
LABELS = {
    "dynamo_namespace": "ns",
    "dynamo_component": "backend",
    "dynamo_endpoint": "generate",
    "model": "served",
    "model_name": "served",
    "worker_id": "1a2b",
}


def vllm_registry() -> CollectorRegistry:
    """vLLM's metrics as its PrometheusStatLogger names them, and one of the server's."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "", labels, registry=registry).labels("tiny", "0").set(2)
    Gauge("vllm:kv_cache_usage_perc", "", labels, registry=registry).labels("tiny", "0").set(0.25)
    Counter("vllm:generation_tokens", "", labels, registry=registry).labels("tiny", "0").inc(40)
    Counter("vllm:prompt_tokens", "", labels, registry=registry).labels("tiny", "0").inc(12)
    itl = Histogram("vllm:inter_token_latency_seconds", "", labels, registry=registry)
    itl.labels("tiny", "0").observe(0.05)
    Counter("engine_server_prompt_tokens", "not the engine's", registry=registry).inc()
    return registry


@dataclasses.dataclass
class MetricsEngine(FakeEngine):
    """A fake engine server that serves GetEngineMetrics."""

    metrics_text: str = ""
    metrics_delay_s: float = 0.0
    metrics_calls: int = 0

    async def GetEngineMetrics(self, request: Any, context: Any) -> pb.GetEngineMetricsResponse:
        self.metrics_calls += 1
        await asyncio.sleep(self.metrics_delay_s)
        return pb.GetEngineMetricsResponse(text=self.metrics_text)


@dataclasses.dataclass
class Dynamo:
    """Dynamo's system server stand-in: what /metrics was asked with."""

    url: str
    port: int
    encodings: list[str] = dataclasses.field(default_factory=list)


@asynccontextmanager
async def dynamo() -> AsyncIterator[Dynamo]:
    seen: list[str] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Accept-Encoding", ""))
        return web.Response(
            text=DYNAMO_TEXT, content_type="text/plain", headers={"X-From": "dynamo"}
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner, url = await serve_loopback(app)
    try:
        yield Dynamo(url, runner.addresses[0][1], seen)
    finally:
        await runner.cleanup()


@dataclasses.dataclass
class Port:
    """The system port's URL, its engine series, and what stands behind them."""

    url: str
    series: EngineSeries
    upstream: Dynamo
    engine: FakeServer


@asynccontextmanager
async def system_port(engine: FakeEngine, timeout_s: float = 1.0) -> AsyncIterator[Port]:
    """A SystemServer in front of ``engine`` (a fake engine server) and Dynamo's stand-in."""
    async with dynamo() as upstream, FakeServer(engine) as server:
        client = EngineClient(server.address)
        info = engine.info()
        series = EngineSeries(lambda: (client, info), timeout_s)
        series.labels = dict(LABELS)
        port = free_system_port()
        system = SystemServer(
            SystemPort("127.0.0.1", port, upstream.port), {}, extra_metrics=series.text
        )
        await system.start()
        try:
            yield Port(f"http://127.0.0.1:{port}", series, upstream, server)
        finally:
            await system.stop()
            await client.close()


async def get(url: str, **headers: str) -> tuple[int, str, CIMultiDictProxy[str]]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as r:
        return r.status, await r.text(), r.headers


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bridge.engine_metrics"]


def test_engine_series_keeps_only_the_engines_families() -> None:
    text = engine_series(vllm_registry())
    names = {name.split("{")[0] for name in text.splitlines() if not name.startswith("#")}
    assert "vllm:generation_tokens_total" in names and "vllm:kv_cache_usage_perc" in names
    assert not any(name.startswith("engine_server") for name in names)
    assert engine_series(CollectorRegistry()) == ""


async def test_the_engines_series_follow_dynamos_with_the_workers_labels() -> None:
    engine = MetricsEngine(metrics_text=engine_series(vllm_registry()))
    async with system_port(engine) as port:
        status, text, headers = await get(f"{port.url}/metrics", **{"Accept-Encoding": "gzip"})
        # Anything else passes through as before, without the engine asked.
        health, _, _ = await get(f"{port.url}/health")
    assert status == 200 and health == 200 and engine.metrics_calls == 1
    assert headers["X-From"] == "dynamo"
    # Asked uncompressed, so that the text could be added.
    assert port.upstream.encodings == ["identity"]
    samples = Samples.parse(text)  # one valid exposition: no family twice
    assert samples.value("dynamo_component_requests_total") == 3
    [usage] = samples.labels("vllm:kv_cache_usage_perc")
    # Dynamo's labels added; the engine's own win (model_name), as in dynamo.vllm.
    assert usage == {**LABELS, "model_name": "tiny", "engine": "0"}
    assert samples.labels("engine_server_prompt_tokens_total") == []
    # What NeMo RL's sampler keeps of it.
    assert sampler_metrics(text) == {
        "vllm_num_requests_running": 2,
        "vllm_kv_cache_usage_perc": 0.25,
        "vllm_generation_tokens_total": 40,
        "vllm_prompt_tokens_total": 12,
        "vllm_inter_token_latency_seconds_count": 1,
        "vllm_inter_token_latency_seconds_sum": 0.05,
    }


async def test_unimplemented_slow_or_unparsable_engines_leave_dynamos_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "bridge.engine_metrics")
    # A server that claims the revision but lacks the RPC: UNIMPLEMENTED.
    async with system_port(FakeEngine()) as port:
        assert (await get(f"{port.url}/metrics"))[:2] == (200, DYNAMO_TEXT)
        assert (await get(f"{port.url}/metrics"))[:2] == (200, DYNAMO_TEXT)
    # One that answers after the deadline: the scrape waits the deadline only.
    slow = MetricsEngine(metrics_text=engine_series(vllm_registry()), metrics_delay_s=5)
    async with system_port(slow, timeout_s=0.3) as port:
        started = time.perf_counter()
        status, text, _ = await get(f"{port.url}/metrics")
        took = time.perf_counter() - started
    assert (status, text) == (200, DYNAMO_TEXT) and took < 2, took
    async with system_port(MetricsEngine(metrics_text="vllm:x{ 1\n")) as port:
        assert (await get(f"{port.url}/metrics"))[:2] == (200, DYNAMO_TEXT)
    lines = said(caplog)
    assert len(lines) == 3, lines
    assert "UNIMPLEMENTED" in lines[0]
    assert "GetEngineMetrics took over 0.3 s" in lines[1]
    assert "not Prometheus text" in lines[2]


async def test_a_dead_engine_server_costs_no_more_than_the_deadline() -> None:
    engine = MetricsEngine(metrics_text=engine_series(vllm_registry()))
    async with system_port(engine, timeout_s=3) as port:
        first = Samples.parse((await get(f"{port.url}/metrics"))[1])
        assert first.value("vllm:generation_tokens_total") == 40
        # The server gone: its address refuses at once (no wait for it to be back).
        await port.engine.server.stop(grace=None)
        started = time.perf_counter()
        status, text, _ = await get(f"{port.url}/metrics")
        took = time.perf_counter() - started
    assert (status, text) == (200, DYNAMO_TEXT) and took < 2, took


def test_nothing_is_asked_before_a_server_is_linked() -> None:
    series = EngineSeries(lambda: (None, None))
    assert asyncio.run(series.text()) == ""


async def test_a_lasting_failure_is_logged_again_only_after_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    info = pb.GetServerInfoResponse(contract_revision=engine_contract.CONTRACT_REVISION)
    failures = [grpc.StatusCode.UNAVAILABLE] * 6

    class Down:
        async def get_engine_metrics(self, timeout_s: float) -> str:
            if not failures:
                return "vllm:x 1\n"
            raise grpc.aio.AioRpcError(
                failures.pop(), grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
            )

    down = cast(EngineClient, Down())
    series = EngineSeries(lambda: (down, info), log_every_s=0.5)
    caplog.set_level(logging.INFO, "bridge.engine_metrics")
    for _ in range(5):
        assert await series.text() == ""
    await asyncio.sleep(0.6)
    assert await series.text() == ""
    assert await series.text() == "# HELP vllm:x \n# TYPE vllm:x untyped\nvllm:x 1.0\n"
    lines = said(caplog)
    assert len(lines) == 3, lines
    assert "UNAVAILABLE: down" in lines[0]
    assert "(4 scrapes since the last line)" in lines[1]
    assert "back" in lines[2]
