"""The same path with the real vLLM engine server (CPU build here) behind the bridge."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import load, tiny_vllm_args
from harness.http import http_json, open_sse_stream
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client import driver
from tests.e2e.e2e_stack import VLLM_STACK_MARKS

pytestmark = VLLM_STACK_MARKS

MODEL = "tiny-vllm"
VLLM_ARGS = (*tiny_vllm_args(), "--max-new-tokens", "24")


@pytest.fixture(scope="module")
def vllm_stack(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[tuple[str, str, Proc]]:
    root = tmp_path_factory.mktemp("vllm-stack")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL, "vllm-e2e")
        _, address = stack.start_engine("engine", *VLLM_ARGS, backend="vllm", timeout=300)
        bridge = stack.start_bridge("bridge", address, "--log-level", "debug")
        stack.start_frontend()
        stack.wait_models([MODEL], timeout=300)
        yield stack.base_url, address, bridge


def direct(address: str, prompt: list[int], request_id: str) -> pb.RolloutResponse:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        return stub.Rollout(
            pb.RolloutRequest(
                request_id=request_id, prompt_token_ids=prompt, greedy=True, max_new_tokens=16
            ),
            timeout=60,
        )


async def test_greedy_rollout_identical_to_the_engine_server(
    vllm_stack: tuple[str, str, Proc],
) -> None:
    base_url, address, _ = vllm_stack
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
    vllm_stack: tuple[str, str, Proc],
) -> None:
    base_url, _, _ = vllm_stack
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


def test_client_disconnect_aborts(vllm_stack: tuple[str, str, Proc]) -> None:
    base_url, address, bridge = vllm_stack

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
