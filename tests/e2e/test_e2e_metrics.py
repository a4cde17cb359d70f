"""Metrics and one trace across the three real processes: Dynamo's frontend, the
bridge and the engine server.

Known traffic through the frontend, then scrapes of the engine server's
``--metrics-port`` and of the bridge's worker ``/metrics`` (Dynamo's system
port, fronted by the bridge's own server) with the counts checked exactly, and
one request followed by its id through the three logs.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from harness.metrics import Samples, scrape
from harness.ports import free_port, free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client import driver

pytestmark = pytest.mark.dynamo

ROLLOUTS = 6
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def prompt(i: int) -> list[int]:
    """Long enough (40 tokens) to fill KV blocks, so that KV events flow."""
    return [(i * 97 + k * 13) % 900 + 3 for k in range(40)]


def start(
    tmp_path: Path,
    group: ProcessGroup,
    model_dir: Path,
    bridge_args: tuple[str, ...] = (),
    **env: str,
) -> tuple[Stack, str, str]:
    """The stack, the engine server's metrics URL, the bridge's (``env``: Dynamo's)."""
    stack = Stack.new(tmp_path, group, model_dir, "tiny")
    stack.env.update(env)
    engine_port = free_port()
    _, address = stack.start_engine(
        "engine", "--metrics-port", str(engine_port), "--log-level", "debug"
    )
    system_port = free_system_port()
    stack.start_bridge(
        "bridge", address, "--log-level", "debug", *bridge_args, DYN_SYSTEM_PORT=str(system_port)
    )
    stack.start_frontend()
    stack.wait_models(["tiny"], timeout=90)
    return (
        stack,
        f"http://127.0.0.1:{engine_port}/metrics",
        f"http://127.0.0.1:{system_port}/metrics",
    )


async def test_the_engine_and_bridge_metrics_count_exactly_the_traffic_sent(
    tmp_path: Path, model_dir: Path
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        stack, engine_url, bridge_url = start(tmp_path, group, model_dir)
        before = scrape(bridge_url)
        async with driver.RolloutClient(stack.base_url, "tiny", timeout_s=60) as client:
            results = await asyncio.gather(
                *(client.rollout(prompt(i), max_tokens=8) for i in range(ROLLOUTS))
            )

        def relayed() -> tuple[Samples, Samples] | None:
            # The engine emits its events as it steps; the relay follows within moments.
            engine, bridge = scrape(engine_url), scrape(bridge_url)
            emitted = engine.value("engine_server_kv_events_total")
            if emitted and bridge.value("bridge_kv_events_relayed_total") == emitted:
                return engine, bridge
            return None

        engine, bridge = wait_until(relayed, 10, "KV events relayed")

    generated = sum(len(r.token_ids) for r in results)
    # Engine server: the rollouts and nothing else (the bridge sends no probes).
    assert engine.value("engine_server_requests_total", kind="rollout") == ROLLOUTS
    assert engine.value("engine_server_request_duration_seconds_count", kind="rollout") == ROLLOUTS
    assert engine.value("engine_server_prompt_tokens_total", kind="rollout") == 40 * ROLLOUTS
    assert engine.value("engine_server_generation_tokens_total", kind="rollout") == generated
    assert engine.value("engine_server_rpc_calls_total", method="Rollout") == 0  # all streamed
    assert engine.value("engine_server_stream_items_per_message_sum", stream="rollouts") == ROLLOUTS
    assert engine.value("engine_server_kv_events_total") > 0
    assert engine.value("engine_server_kv_subscribers") == 1
    assert engine.value("engine_server_kv_snapshots_total") == 1

    # Bridge, inside Dynamo's /metrics (with Dynamo's labels added).
    hop = "bridge_engine_request_duration_seconds_count"
    assert bridge.value(hop, kind="rollout", transport="stream") == ROLLOUTS
    assert before.value(hop, kind="rollout") == 0
    assert bridge.value(hop, kind="completion") == 0
    assert bridge.value("bridge_engine_stream_items_per_message_sum", stream="rollouts",
                        direction="sent") == ROLLOUTS  # fmt: skip
    assert bridge.value("bridge_engine_stream_items_per_message_sum", stream="rollouts",
                        direction="received") == ROLLOUTS  # fmt: skip
    assert bridge.value("bridge_engine_streams_opened_total", stream="rollouts") == 1
    assert bridge.value("bridge_engine_streams_open", stream="rollouts") == 1
    assert bridge.value("bridge_kv_snapshots_applied_total") == 1
    assert bridge.value("bridge_kv_resubscriptions_total") == 0
    assert bridge.value("bridge_engine_reconnects_total") == 0
    # Live batches carry the engine's emit time: each one's lag is measured.
    live = engine.value("engine_server_kv_batches_total")
    assert bridge.value("bridge_kv_relay_lag_seconds_count") == live > 0
    [server] = bridge.labels("bridge_engine_server_info")
    [engine_server] = engine.labels("engine_server_info")
    assert server["instance_id"] == engine_server["instance_id"]
    assert server["dynamo_namespace"] == stack.namespace and server["model_name"] == "tiny"


@pytest.mark.parametrize(
    ("kind", "transport"),
    [("rollout", "stream"), ("rollout", "unary"), ("completion", "stream")],
)
def test_one_request_id_and_trace_id_appear_in_all_three_logs(
    tmp_path: Path, model_dir: Path, kind: str, transport: str
) -> None:
    """Dynamo's request id in the frontend's log (INFO), the bridge's and the engine
    server's (DEBUG); the W3C trace id sent with the request in all three, whether
    the request went as its own call (its metadata) or on a multiplexed stream (its
    start's trace_context, contract revision 5)."""
    with ProcessGroup(tmp_path / "logs") as group:
        # Dynamo hands a backend the trace context only with its OTel layer on
        # (JSONL logs, or OTEL_EXPORT_ENABLED=1 with a collector).
        flag = "--rollout-transport" if kind == "rollout" else "--generate-transport"
        stack, _, _ = start(tmp_path, group, model_dir, (flag, transport), DYN_LOGGING_JSONL="1")
        if kind == "rollout":
            payload = driver.build_rollout_body("tiny", prompt(1), max_tokens=4)
        else:
            payload = {"model": "tiny", "prompt": prompt(1), "max_tokens": 4}
        request = urllib.request.Request(
            f"{stack.base_url}/v1/completions",
            json.dumps(payload).encode(),
            {"Content-Type": "application/json", "traceparent": TRACEPARENT},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.load(response)
        # The completion's id is Dynamo's request id (and the engine request's here).
        dynamo_id = answer["id"].removeprefix("cmpl-")
        logs = {p.name: p.log_path for p in stack.procs}

        def seen() -> bool:
            return all(dynamo_id in log.read_text() for log in logs.values())

        wait_until(seen, 10, f"{dynamo_id} in every log")
    frontend = [json.loads(line) for line in logs["frontend-0"].read_text().splitlines()
                if line.startswith("{")]  # fmt: skip
    bridge = logs["bridge"].read_text()
    engine = logs["engine"].read_text()
    assert any(
        record.get("message") == "request received"
        and record.get("request_id") == dynamo_id
        and record.get("trace_id") == TRACE_ID
        for record in frontend
    )
    # The same trace (Dynamo's span under it: another span id).
    traceparent = f"traceparent 00-{TRACE_ID}-"
    assert f"request {dynamo_id}: engine request {dynamo_id}, {traceparent}" in bridge
    line = next(line for line in engine.splitlines() if f"{kind} {dynamo_id} started" in line)
    assert f"traceparent=00-{TRACE_ID}-" in line, line
    # A unary call's metadata also names Dynamo's request id (a stream start's
    # request already does).
    assert (f"x-request-id={dynamo_id}" in line) == (transport == "unary"), line
