"""Rollout: NeMo RL's native semantics as seen over the contract."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from harness.engine import wait_load_async
from tests.conformance.common import collect, make_prompt, new_id

DTYPE_SIZES = {
    pb.TENSOR_DTYPE_UINT8: 1,
    pb.TENSOR_DTYPE_INT8: 1,
    pb.TENSOR_DTYPE_UINT16: 2,
    pb.TENSOR_DTYPE_INT16: 2,
    pb.TENSOR_DTYPE_INT32: 4,
    pb.TENSOR_DTYPE_INT64: 8,
}


def rollout(
    info: pb.GetServerInfoResponse, length: int = 12, seed: int = 1, **kw: object
) -> pb.RolloutRequest:
    return pb.RolloutRequest(
        request_id=new_id("ro"), prompt_token_ids=make_prompt(info, length, seed), **kw
    )  # type: ignore[arg-type]


def check_consistent(
    request: pb.RolloutRequest, answer: pb.RolloutResponse, info: pb.GetServerInfoResponse
) -> None:
    assert answer.request_id == request.request_id
    assert answer.instance_id == info.instance_id
    assert len(answer.logprobs) == len(answer.token_ids)
    assert all(lp <= 0.0 for lp in answer.logprobs)
    assert all(0 <= t < info.vocab_size for t in answer.token_ids)
    assert answer.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert answer.truncated == (
        answer.finish_reason == pb.FINISH_REASON_LENGTH and len(answer.token_ids) > 0
    )
    assert answer.usage.prompt_tokens == len(request.prompt_token_ids)
    assert answer.usage.completion_tokens == len(answer.token_ids)
    assert 0 <= answer.usage.cached_prompt_tokens <= len(request.prompt_token_ids)
    if answer.finish_reason == pb.FINISH_REASON_STOP:
        kind = answer.matched_stop.WhichOneof("match")
        assert kind is not None
        if kind == "token_id":
            assert answer.token_ids[-1] == answer.matched_stop.token_id
            assert answer.matched_stop.token_id in info.generation_defaults.stop_token_ids


async def test_greedy_rollout_is_deterministic_and_consistent(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request = rollout(server_info, greedy=True)
    first = await stub.Rollout(request)
    check_consistent(request, first, server_info)
    assert len(first.token_ids) >= 1
    request.request_id = new_id("ro")
    second = await stub.Rollout(request)
    assert list(second.token_ids) == list(first.token_ids)
    assert list(second.logprobs) == list(first.logprobs)


async def test_greedy_rollout_equals_generate_with_native_parameters(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    """Rollout = Generate(temperature 0, top_k 1, defaults' top_p and stop ids, logprobs 0)."""
    request = rollout(server_info, length=20, seed=7, greedy=True, max_new_tokens=24)
    answer = await stub.Rollout(request)
    defaults = server_info.generation_defaults
    generate = pb.GenerateRequest(
        request_id=new_id("gen"), prompt_token_ids=request.prompt_token_ids
    )
    generate.sampling.temperature = 0.0
    generate.sampling.top_k = 1
    generate.sampling.top_p = defaults.top_p
    generate.stop.max_tokens = 24
    generate.stop.stop_token_ids.extend(defaults.stop_token_ids)
    generate.stop.include_stop_str_in_output = True
    generate.output.logprobs = 0
    streamed = await collect(stub, generate)
    assert streamed.token_ids == list(answer.token_ids)
    assert streamed.logprobs == list(answer.logprobs)
    assert streamed.finished.finish_reason == answer.finish_reason


async def test_sampled_rollout_has_one_logprob_per_token(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request = rollout(server_info, seed=3, max_new_tokens=16)
    answer = await stub.Rollout(request)
    check_consistent(request, answer, server_info)


async def test_max_new_tokens_bounds_and_truncates(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    for seed in range(20):
        request = rollout(server_info, seed=100 + seed, greedy=True, max_new_tokens=3)
        answer = await stub.Rollout(request)
        check_consistent(request, answer, server_info)
        assert len(answer.token_ids) <= 3
        if answer.finish_reason == pb.FINISH_REASON_LENGTH:
            assert len(answer.token_ids) == 3 and answer.truncated
            return
    pytest.fail("every prompt stopped within 3 tokens: cannot observe truncation")


async def test_budget_is_clamped_to_the_context(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    context = server_info.engine_config.context_length
    request = rollout(server_info, length=context - 2, greedy=True, max_new_tokens=context)
    answer = await stub.Rollout(request)
    check_consistent(request, answer, server_info)
    assert len(answer.token_ids) <= 2


@pytest.mark.parametrize(
    "how", ["prompt fills the context", "prompt longer than the context", "max_new_tokens 0"]
)
async def test_a_rollout_with_no_room_to_generate_finishes_empty_by_length(
    stub, server_info, how: str
) -> None:  # type: ignore[no-untyped-def]
    context = server_info.engine_config.context_length
    if how == "max_new_tokens 0":
        request = rollout(server_info, greedy=True, max_new_tokens=0)
    elif how == "prompt fills the context":
        request = rollout(server_info, length=context)
    else:
        request = rollout(server_info, length=context + 7)
    answer = await stub.Rollout(request)
    assert list(answer.token_ids) == [] and list(answer.logprobs) == []
    assert answer.finish_reason == pb.FINISH_REASON_LENGTH and not answer.truncated
    assert answer.usage.prompt_tokens == len(request.prompt_token_ids)
    assert answer.usage.completion_tokens == 0


async def test_stop_string_is_kept_in_the_output(stub, server_info, tokenizer) -> None:  # type: ignore[no-untyped-def]
    for seed in range(30):
        base = rollout(server_info, seed=200 + seed, greedy=True, max_new_tokens=24)
        full = await stub.Rollout(base)
        tokens = list(full.token_ids)
        text = tokenizer.decode(tokens)
        # A stop string taken from the middle of the text the model will produce.
        cut = tokenizer.decode(tokens[:4])
        stop = text[len(cut) : len(cut) + 3]
        if len(tokens) < 8 or len(stop.strip()) < 2 or stop in cut:
            continue
        request = pb.RolloutRequest(
            request_id=new_id("ro"),
            prompt_token_ids=base.prompt_token_ids,
            greedy=True,
            max_new_tokens=24,
            stop_strings=["never-seen!", stop],
        )
        answer = await stub.Rollout(request)
        check_consistent(request, answer, server_info)
        assert answer.finish_reason == pb.FINISH_REASON_STOP
        assert answer.matched_stop.stop_string == stop
        got = list(answer.token_ids)
        assert got == tokens[: len(got)], "stopping must not change the tokens before the stop"
        assert stop in tokenizer.decode(got), "the stop string stays in the output"
        assert stop not in tokenizer.decode(got[:-1]), "generation ends where the stop completes"
        return
    pytest.fail("found no prompt whose output offers a usable stop string")


async def test_routed_experts_when_available(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request = rollout(server_info, length=10, greedy=True, max_new_tokens=6)
    if not server_info.routed_experts_available:
        request.routed_experts = pb.ROUTED_EXPERTS_MODE_REQUIRE
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Rollout(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "routed_experts" in err.value.details()
        return
    answer = await stub.Rollout(request)
    experts = answer.routed_experts
    rows = len(request.prompt_token_ids) + len(answer.token_ids) - 1
    assert len(experts.shape) == 3 and experts.shape[0] == rows
    assert experts.dtype in DTYPE_SIZES
    assert (
        len(experts.data) == rows * experts.shape[1] * experts.shape[2] * DTYPE_SIZES[experts.dtype]
    )
    stats = answer.r3_stats
    assert (stats.expected_routes, stats.actual_routes) == (rows, rows)
    assert stats.missing_routes == stats.surplus_routes == 0
    request.request_id = new_id("ro")
    request.routed_experts = pb.ROUTED_EXPERTS_MODE_OMIT
    omitted = await stub.Rollout(request)
    assert not omitted.HasField("routed_experts")
    assert list(omitted.token_ids) == list(answer.token_ids)


async def test_concurrent_rollouts_all_complete(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    requests = [
        rollout(server_info, seed=300 + i, greedy=i % 2 == 0, max_new_tokens=12) for i in range(32)
    ]
    answers = await asyncio.gather(*(stub.Rollout(r) for r in requests))
    for request, answer in zip(requests, answers, strict=True):
        check_consistent(request, answer, server_info)
    await wait_load_async(stub, lambda load: load.registered_requests == 0)
