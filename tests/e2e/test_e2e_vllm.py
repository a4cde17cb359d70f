"""The same path with the real vLLM engine server (CPU build here) behind the bridge,
one stack for the module: a rollout bit for bit the engine server's, completions and
chat, a client's disconnect reaching vLLM as an abort, and (first, while the
engine's counters hold only its own rollouts) vLLM's own series on the worker's
system port, where NeMo RL reads them.

dynamo.vllm publishes vLLM's registry in its worker's ``{system_url}/metrics``,
and NeMo RL's ``DynamoMetricsSampler`` reads ``vllm:*`` series there: one scrape
of the bridge's system port, read as that sampler's ``parse_prometheus_metrics``
reads it (``harness.nemo_rl.sampler_metrics``) and as Prometheus parses it.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import load, tiny_vllm_args
from harness.http import http_json, open_sse_stream
from harness.metrics import Samples, scrape
from harness.nemo_rl import sampler_metrics
from harness.ports import free_system_port
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client import driver
from tests.e2e.e2e_stack import VLLM_STACK_MARKS

pytestmark = VLLM_STACK_MARKS

MODEL = "tiny-vllm"
VLLM_ARGS = (*tiny_vllm_args(), "--max-new-tokens", "24")


METRIC_PROMPTS = [[5, 6, 7, 8 + i] for i in range(2)]


@dataclass(frozen=True)
class VllmStack:
    base_url: str
    address: str
    bridge: Proc
    system_url: str
    namespace: str


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[VllmStack]:
    root = tmp_path_factory.mktemp("vllm-stack")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL, "vllm-e2e")
        _, address = stack.start_engine("engine", *VLLM_ARGS, backend="vllm", timeout=300)
        port = free_system_port()
        bridge = stack.start_bridge(
            "bridge", address, "--log-level", "debug", DYN_SYSTEM_PORT=str(port)
        )
        stack.start_frontend()
        stack.wait_models([MODEL], timeout=300)
        yield VllmStack(
            stack.base_url, address, bridge, f"http://127.0.0.1:{port}", stack.namespace
        )


async def test_vllm_series_on_the_system_port_as_nemo_rl_reads_them(
    vllm_stack: VllmStack,
) -> None:
    # First in the module: vLLM's counters hold these rollouts only.
    async with driver.RolloutClient(vllm_stack.base_url, MODEL, timeout_s=120) as client:
        results = [await client.rollout(p, max_tokens=6) for p in METRIC_PROMPTS]
    generated = sum(len(r.token_ids) for r in results)

    def settled() -> Samples | None:
        # vLLM records a step's stats as it hands its outputs over.
        samples = scrape(f"{vllm_stack.system_url}/metrics")
        ok = samples.value("vllm:generation_tokens_total") == generated
        return samples if ok else None

    samples = wait_until(settled, 20, "vLLM's counters on the system port")
    assert samples is not None

    # What NeMo RL's sampler keeps of the vLLM series, under its names.
    seen = sampler_metrics(samples.text)
    assert seen["vllm_generation_tokens_total"] == generated > 0
    assert seen["vllm_prompt_tokens_total"] == sum(len(p) for p in METRIC_PROMPTS)
    assert seen["vllm_num_requests_running"] == 0
    assert seen["vllm_num_requests_waiting"] == 0
    assert 0 <= seen["vllm_kv_cache_usage_perc"] <= 1
    assert seen["vllm_inter_token_latency_seconds_count"] == generated - len(METRIC_PROMPTS)
    # Labelled as dynamo.vllm labels them: the worker's labels (those of the
    # bridge's own series), the model by its served name, the engine's own
    # labels winning (model_name, engine).
    [usage] = samples.labels("vllm:kv_cache_usage_perc")
    [bridge] = samples.labels("bridge_engine_server_info")
    worker = {k: v for k, v in bridge.items() if k.startswith("dynamo_") or k == "worker_id"}
    assert worker["dynamo_namespace"] == vllm_stack.namespace
    assert {"dynamo_component", "dynamo_endpoint"} <= worker.keys()
    assert usage.items() >= worker.items()
    assert usage["model_name"] == usage["model"] == MODEL and usage["engine"] == "0"
    # Dynamo's own series are still there, next to vLLM's.
    assert any(name.startswith("dynamo_component_") for name in samples.names())


def direct(address: str, prompt: list[int], request_id: str) -> pb.RolloutResponse:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        return stub.Rollout(
            pb.RolloutRequest(
                request_id=request_id, prompt_token_ids=prompt, greedy=True, max_new_tokens=16
            ),
            timeout=60,
        )


async def test_greedy_rollout_identical_to_the_engine_server(vllm_stack: VllmStack) -> None:
    base_url, address = vllm_stack.base_url, vllm_stack.address
    # Shorter than a KV block: no prefix-cache hit can make the two runs differ.
    prompt = [(i * 37) % 900 + 3 for i in range(20)]
    async with driver.RolloutClient(base_url, MODEL, timeout_s=120) as client:
        result = await client.rollout(prompt, greedy=True, max_tokens=16)
    expected = direct(address, prompt, "vllm-direct")
    assert result.token_ids == list(expected.token_ids) and len(result.token_ids) == 16
    assert [struct.pack("<d", x) for x in result.logprobs] == [
        struct.pack("<d", x) for x in expected.logprobs
    ]
    assert result.truncated and result.finish_reason == "length"


def test_completions_and_chat_are_served_by_vllm_through_the_bridge(
    vllm_stack: VllmStack,
) -> None:
    base_url = vllm_stack.base_url
    status, body = http_json(
        f"{base_url}/v1/completions",
        {
            "model": MODEL,
            "prompt": "Hello there",
            "max_tokens": 6,
            "ignore_eos": True,
            "logprobs": 1,
        },
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 6
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 6
    status, body = http_json(
        f"{base_url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] is not None


def test_client_disconnect_aborts(vllm_stack: VllmStack) -> None:
    base_url, address, bridge = vllm_stack.base_url, vllm_stack.address, vllm_stack.bridge

    def in_engine() -> int:
        now = load(address)
        return now.running_requests + now.waiting_requests + now.registered_requests

    body = {
        "model": MODEL,
        "prompt": "Once",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    # The frontend's and the socket's buffers can take all 1000 tokens unread: on
    # a loaded machine that stalls this process for seconds, the request may
    # have ended before the disconnect, leaving nothing to abort. Then try again.
    for _ in range(3):
        with open_sse_stream(base_url, body):
            held = in_engine() >= 1
        if held:
            break
        wait_until(lambda: in_engine() == 0, 15, "the finished request gone")
    assert held, "the request ended before the client went away, three times"
    started = time.monotonic()
    wait_until(lambda: in_engine() == 0, 15, "vLLM request aborted")
    assert time.monotonic() - started < 4
    # Dynamo called the bridge's abort(), which reached the engine server.
    wait_until(lambda: "ABORT_OUTCOME_" in bridge.log_tail(50_000), 5, "the bridge's abort")
