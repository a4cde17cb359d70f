"""NeMo RL's distributed refit, replayed over HTTP through the bridge's RL routes.

A vLLM engine server (the tiny model, ``--weight-transfer-config '{"backend":
"gloo"}'``) behind a bridge with ``--enable-rl`` and a Dynamo frontend. The
trainer is vLLM's own trainer-side engine for ``gloo`` driving the worker's
system port through ``DynamoWeightSyncClient``, which makes NeMo RL's calls:
``init_weights_update_group {"engine_rpc": "init_weight_transfer_engine",
"init_info": ...}`` once, then per step three ``update_weights_from_distributed``
calls (start with ``is_checkpoint_format``, update with ``update_info``, finish),
each ``allow_unpaused: true, reset_prefix_cache: false``, then
``pause_generation {"mode": "wait", "clear_cache": true}`` and
``resume_generation``. Rollouts through the frontend then equal a fresh engine
server's on the seed-1 checkpoint, tokens and logprobs bit for bit, under the
version sent. Phases out of order and a trainer that never connects
(``DYN_RL_INIT_WEIGHTS_TIMEOUT_S``) are error answers, and the weights serving
stay as they were.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import tiny_weights_dir
from harness.engine import (
    greedy_rollout,
    tiny_vllm_args,
    tokens_and_logprobs,
    weight_transfer_args,
)
from harness.http import http_json
from harness.nemo_rl import send_gloo_weights
from harness.ports import free_port, free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from rl_client import driver
from rl_client.weight_sync import DynamoWeightSyncClient, RouteError
from tests.e2e.e2e_stack import VLLM_STACK_MARKS

pytestmark = VLLM_STACK_MARKS

MODEL = "tiny-dist-refit"
LOOPBACK = "127.0.0.1"
INIT_TIMEOUT_S = 4
NEMO_FLAGS = {"allow_unpaused": True, "reset_prefix_cache": False}
VLLM_ARGS = (*tiny_vllm_args(max_model_len=512), "--block-size", "32")
# Shorter than a KV block: no prefix-cache hit can make two runs differ.
PROMPTS = [[(seed * 131 + i * 17) % 900 + 3 for i in range(20)] for seed in range(4)]

Outputs = list[tuple[list[int], list[float]]]


@dataclass
class DistStack:
    stack: Stack
    admin: str  # the bridge's system URL
    fresh_b: pb_grpc.EngineServiceStub  # vLLM started on the seed-1 checkpoint


@pytest.fixture(scope="module")
def dist_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[DistStack]:
    root = tmp_path_factory.mktemp("dist-refit")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        _, address = stack.start_engine(
            "engine",
            *VLLM_ARGS,
            *weight_transfer_args("gloo"),
            backend="vllm",
            timeout=300,
        )
        system_port = free_system_port()
        stack.start_bridge(
            "bridge",
            address,
            "--enable-rl",
            DYN_SYSTEM_PORT=str(system_port),
            DYN_RL_INIT_WEIGHTS_TIMEOUT_S=str(INIT_TIMEOUT_S),
        )
        _, fresh = group.engine_server(
            "fresh-b", "--model", str(tiny_weights_dir(1)), *VLLM_ARGS, backend="vllm", timeout=300
        )
        stack.start_frontend()
        stack.wait_models([MODEL], timeout=300)
        with grpc.insecure_channel(fresh) as channel:
            yield DistStack(
                stack, f"http://{LOOPBACK}:{system_port}", pb_grpc.EngineServiceStub(channel)
            )


def frontend_rollouts(ds: DistStack) -> tuple[Outputs, set[str | None]]:
    """Greedy rollouts through the frontend, one at a time; their versions."""

    async def run() -> list[driver.RolloutResult]:
        async with driver.RolloutClient(ds.stack.base_url, MODEL, timeout_s=120) as client:
            return [await client.rollout(p, greedy=True, max_tokens=16) for p in PROMPTS]

    results = asyncio.run(run())
    return [(r.token_ids, r.logprobs) for r in results], {r.weight_version for r in results}


def fresh_rollouts(ds: DistStack) -> Outputs:
    return [tokens_and_logprobs(greedy_rollout(ds.fresh_b, p, 16)) for p in PROMPTS]


def same(got: Outputs, expected: Outputs) -> None:
    """test_vllm_refit's comparison: tokens equal, logprobs bit for bit."""
    from tests.vllm_engine.test_vllm_refit import same as exactly

    exactly(got, expected)


def route(ds: DistStack, name: str, body: Any) -> dict[str, Any]:
    status, answer = http_json(f"{ds.admin}/engine/{name}", body)
    assert status == 200, (name, status, answer)
    assert isinstance(answer, dict)
    return answer


def version(ds: DistStack) -> Any:
    return route(ds, "get_weight_version", {})["version"]


@contextmanager
def serving_unchanged(ds: DistStack) -> Iterator[None]:
    """The block leaves the weights serving as they were: the version label, and the
    frontend's rollouts (bit for bit) and their versions."""
    before, versions = frontend_rollouts(ds)
    label = version(ds)
    yield
    assert version(ds) == label
    after, after_versions = frontend_rollouts(ds)
    same(after, before)
    assert after_versions == versions


def test_nemo_rl_refit_over_the_routes_serves_the_new_checkpoint(dist_stack: DistStack) -> None:
    ds = dist_stack
    before, _ = frontend_rollouts(ds)
    reference = fresh_rollouts(ds)
    assert before != reference  # the two checkpoints really differ

    client = DynamoWeightSyncClient(ds.admin, weight_version="dist-b", timeout_s=120)
    send_gloo_weights(tiny_weights_dir(1), client, world_size=2)
    assert route(ds, "pause_generation", {"mode": "wait", "clear_cache": True})["status"] == "ok"
    assert route(ds, "resume_generation", {})["status"] == "ok"
    assert version(ds) == "dist-b"
    after, versions = frontend_rollouts(ds)
    same(after, reference)
    assert versions == {"dist-b"}


def test_phases_out_of_order_and_unknown_are_errors_and_change_nothing(
    dist_stack: DistStack,
) -> None:
    ds = dist_stack
    update_info = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[1]]}
    with serving_unchanged(ds):
        for body, words in (
            ({"engine_rpc": "update_weights", "update_info": update_info}, "out of order"),
            ({"engine_rpc": "finish_weight_update", "weight_version": "never"}, "out of order"),
            ({"engine_rpc": "start_draft_weight_update"}, "is not one this worker runs"),
            ({"engine_rpc": "start_weight_update", "is_checkpoint_format": False}, "not supported"),
        ):
            answer = route(ds, "update_weights_from_distributed", {**body, **NEMO_FLAGS})
            assert answer["status"] == "error" and words in answer["message"], (body, answer)
            assert "start_weight_update" in answer["message"] or "not supported" in words


def test_a_trainer_that_never_connects_times_out_and_the_worker_keeps_serving(
    dist_stack: DistStack,
) -> None:
    ds = dist_stack
    client = DynamoWeightSyncClient(ds.admin, timeout_s=120)
    info = {
        "master_address": LOOPBACK,
        "master_port": free_port(),  # nobody listens: the trainer never comes
        "rank_offset": 1,
        "world_size": 2,
    }
    with serving_unchanged(ds):
        started = time.monotonic()
        with pytest.raises(RouteError) as failed:
            client.init_weight_transfer_engine(info)
        took = time.monotonic() - started
    message = str(failed.value)
    assert f"did not finish within {INIT_TIMEOUT_S} s (DYN_RL_INIT_WEIGHTS_TIMEOUT_S)" in message
    assert "shut down" in message and "keeps serving its old weights" in message
    # The bridge's wait, then the teardown (the engine's rendezvous gives up at the
    # same deadline: the engine server gave it to the gloo init info).
    assert took < INIT_TIMEOUT_S + 12, took
    answer = route(ds, "destroy_weights_update_group", {})
    assert answer["status"] == "ok", answer
