"""What a new user meets first, through the real frontend: a base checkpoint without a
chat template is served (completions and rollouts), the driver's batch output, and a
prompt past the context."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine_contract.v1 import engine_pb2 as pb
from harness.env import dynamo_env
from harness.http import http_json
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from rl_client import driver
from rl_client.batch import generate_batch
from tests.e2e.e2e_stack import assert_same, direct_rollout

pytestmark = pytest.mark.dynamo

BASE = "base"


@pytest.fixture(scope="module")
def base_model_dir() -> Path:
    return tiny_model_dir("base")


@pytest.fixture(scope="module")
def base_stack(tmp_path_factory: pytest.TempPathFactory, base_model_dir: Path) -> Iterator[Stack]:
    """The bridge started as the README says, with no endpoint-type flag."""
    root = tmp_path_factory.mktemp("base-stack")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, base_model_dir, BASE)
        _, address = stack.start_engine("engine")
        stack.start_bridge("bridge", address, namespace="ns-base")
        stack.start_frontend()
        stack.wait_models([BASE], timeout=60)
        yield stack


def test_the_model_has_no_chat_template(base_model_dir: Path) -> None:
    assert not (base_model_dir / "chat_template.jinja").exists()
    assert "chat_template" not in (base_model_dir / "tokenizer_config.json").read_text()


async def test_base_checkpoint_serves_rollouts_and_completions(base_stack: Stack) -> None:
    async with driver.RolloutClient(base_stack.base_url, BASE, timeout_s=30) as client:
        result = await client.rollout([5, 6, 7], greedy=True, max_tokens=6)
    assert 1 <= len(result.token_ids) <= 6 and len(result.logprobs) == len(result.token_ids)
    status, body = http_json(
        f"{base_stack.base_url}/v1/completions",
        {"model": BASE, "prompt": "Once upon", "max_tokens": 4},
    )
    assert status == 200 and body["choices"][0]["text"], body


def test_chat_is_not_registered_and_the_bridge_says_why(base_stack: Stack) -> None:
    status, _ = http_json(
        f"{base_stack.base_url}/v1/chat/completions",
        {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 404
    log = base_stack.group.get("bridge").log_tail(200_000)
    assert "registering endpoint types completions: the model has no chat template" in log


def test_asking_for_chat_without_a_template_is_refused(base_stack: Stack, tmp_path: Path) -> None:
    bridge = base_stack.group.bridge(
        "bridge-chat",
        "127.0.0.1:1",
        base_stack.model_dir,
        BASE,
        "ns-chat",
        dynamo_env(tmp_path / "kv"),
        "--endpoint-types",
        "chat,completions",
    )
    assert bridge.wait_exit(60) == 2
    assert "includes chat, but the model at" in bridge.log_tail()
    assert "has no chat template" in bridge.log_tail()


async def test_batch_output_equals_the_rollouts_row_by_row(stack: Stack) -> None:
    """Greedy sim rollouts with routed experts (4 layers, top 2 of 8 experts)."""
    prompts = [[(7 * i + 3 * j) % 900 + 3 for j in range(4 + 5 * i)] for i in range(6)]
    input_ids = np.full((len(prompts), 40), 2, dtype=np.int64)
    for i, prompt in enumerate(prompts):
        input_ids[i, : len(prompt)] = prompt
    lengths = np.array([len(p) for p in prompts])
    async with driver.RolloutClient(stack.base_url, stack.model, timeout_s=60) as client:
        out = await generate_batch(
            client,
            input_ids,
            lengths,
            pad_token_id=2,
            greedy=True,
            max_new_tokens=12,
            concurrency=4,
            num_routed_experts=8,
        )
    width = 40 + int(out.generation_lengths.max())
    assert out.output_ids.shape == out.logprobs.shape == (6, width)
    assert out.routed_experts is not None and out.routed_experts.dtype == np.int8
    assert out.routed_experts.shape == (6, width, 4, 2)
    for i, prompt in enumerate(prompts):
        direct = direct_rollout(
            stack, prompt, greedy=True, request_id=f"batch-direct-{i}", max_new_tokens=12
        )
        assert_same(out.results[i], direct)
        n_in, n_gen = len(prompt), len(direct.token_ids)
        assert out.output_ids[i, :n_in].tolist() == prompt
        assert out.output_ids[i, n_in : n_in + n_gen].tolist() == list(direct.token_ids)
        assert (out.output_ids[i, n_in + n_gen :] == 2).all()
        assert out.logprobs[i, n_in : n_in + n_gen].tolist() == [
            float(np.float32(x)) for x in direct.logprobs
        ]
        assert (out.logprobs[i, :n_in] == 0).all() and (out.logprobs[i, n_in + n_gen :] == 0).all()
        assert (
            out.generation_lengths[i] == n_gen and out.unpadded_sequence_lengths[i] == n_in + n_gen
        )
        assert out.truncated[i] == direct.truncated
        routes = np.frombuffer(direct.routed_experts.data, dtype=np.uint8).reshape(
            tuple(direct.routed_experts.shape)
        )
        expected = n_in + n_gen - 1
        assert (out.routed_experts[i, :expected] == routes[:expected]).all()
        assert (out.routed_experts[i, expected:] == np.arange(2)).all()
        assert out.r3_routed_experts_expected_routes[i] == expected
        assert out.r3_routed_experts_actual_routes[i] == direct.r3_stats.actual_routes
        assert out.r3_routed_experts_missing_routes[i] == direct.r3_stats.missing_routes


async def test_a_prompt_past_the_context_generates_nothing(stack: Stack) -> None:
    channel, stub = stack.engine_stub()
    with channel:
        context = stub.GetServerInfo(pb.GetServerInfoRequest()).engine_config.context_length
    prompt = [7] * (context + 5)
    async with driver.RolloutClient(stack.base_url, stack.model, timeout_s=60) as client:
        result = await client.rollout(prompt, greedy=True)
    assert result.token_ids == [] and result.logprobs == []
    assert result.finish_reason == "length" and not result.truncated
    assert result.usage["prompt_tokens"] == context + 5
