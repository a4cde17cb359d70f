"""The shared end-to-end stack (two models, each on its own simulated engine server
and bridge, behind one Dynamo frontend) and the checks that compare what comes
through it with what the engine server answers directly."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from engine_contract.v1 import engine_pb2 as pb
from harness.engine import long_sim_args
from harness.env import importable, token_in_token_out_env
from harness.procs import ProcessGroup
from harness.stack import Stack
from rl_client import driver

# The vLLM engine server (CPU build here) behind a bridge and a Dynamo frontend.
VLLM_STACK_MARKS = [
    pytest.mark.dynamo,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not importable("vllm"), reason="vLLM not installed"),
]

MODEL = "tiny"
# A second model on its own engine server whose EOS is never the likeliest token,
# for requests that must run long without ignore_eos (which would also switch
# off the frontend's stop strings).
LONG_MODEL = "tiny-long"
BRIDGE_ARGS = ("--log-level", "debug")
# Routed experts on, so that rollouts carry them; EOS most likely at 5% of
# positions, so that some greedy rollouts end on EOS.
SIM_ARGS = (
    "--routed-experts",
    "4,2,8",
    "--eos-rate",
    "0.05",
    "--decode-step-ms",
    "2",
    "--max-new-tokens",
    "48",
)
LONG_SIM_ARGS = long_sim_args(decode_step_ms=2)


def start_stack(root: Path, model_dir: Path, group: ProcessGroup) -> Stack:
    """Two models, each on its own sim engine server and bridge, behind one frontend."""
    stack = Stack.new(root, group, model_dir, MODEL)
    for model, args in ((MODEL, SIM_ARGS), (LONG_MODEL, LONG_SIM_ARGS)):
        _, address = stack.start_engine(f"engine-{model}", *args, model=model)
        stack.start_bridge(
            f"bridge-{model}", address, *BRIDGE_ARGS, model=model, namespace=f"ns-{model}"
        )
    stack.start_frontend(env=token_in_token_out_env())  # also /inference/v1/generate
    stack.wait_models([MODEL, LONG_MODEL], timeout=60)
    return stack


def direct_rollout(
    stack: Stack,
    prompt: list[int],
    *,
    greedy: bool,
    request_id: str,
    stop_strings: tuple[str, ...] = (),
    max_new_tokens: int | None = None,
) -> pb.RolloutResponse:
    """The same rollout asked of the engine server itself."""
    channel, stub = stack.engine_stub()
    with channel:
        request = pb.RolloutRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            greedy=greedy,
            stop_strings=list(stop_strings),
        )
        if max_new_tokens is not None:
            request.max_new_tokens = max_new_tokens
        return stub.Rollout(request, timeout=30)


async def bridged_rollout(stack: Stack, prompt: list[int], **kwargs: Any) -> driver.RolloutResult:
    async with driver.RolloutClient(stack.base_url, stack.model, timeout_s=60) as client:
        return await client.rollout(prompt, **kwargs)


def assert_same(result: driver.RolloutResult, direct: pb.RolloutResponse) -> None:
    """Field by field; logprobs compared bit for bit."""
    assert result.token_ids == list(direct.token_ids)
    assert [struct.pack("<d", x) for x in result.logprobs] == [
        struct.pack("<d", x) for x in direct.logprobs
    ]
    assert result.truncated == direct.truncated
    assert result.finish_reason == pb.FinishReason.Name(direct.finish_reason).split("_")[-1].lower()
    which = direct.matched_stop.WhichOneof("match")
    assert result.stop_reason == (getattr(direct.matched_stop, which) if which else None)
    assert result.usage["completion_tokens"] == direct.usage.completion_tokens
    if direct.HasField("routed_experts"):
        assert result.routed_experts is not None
        assert result.routed_experts.data == direct.routed_experts.data
        assert list(result.routed_experts.shape) == list(direct.routed_experts.shape)
        assert (
            result.routed_experts.dtype
            == pb.TensorDtype.Name(direct.routed_experts.dtype)
            .removeprefix("TENSOR_DTYPE_")
            .lower()
        )
        assert result.r3_stats == {k: getattr(direct.r3_stats, k) for k in result.r3_stats or {}}
    else:
        assert result.routed_experts is None
