"""Generate: streamed deltas, per-request sampling and stop conditions."""

from __future__ import annotations

from engine_contract.v1 import engine_pb2 as pb
from tests.conformance.common import collect, make_prompt, new_id


def greedy(
    info: pb.GetServerInfoResponse, seed: int, max_tokens: int, length: int = 10
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=new_id("gen"), prompt_token_ids=make_prompt(info, length, seed)
    )
    request.sampling.temperature = 0.0
    request.stop.max_tokens = max_tokens
    request.stop.ignore_eos = True
    request.output.logprobs = 0
    return request


async def test_stream_ends_with_one_finished_message(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request = greedy(server_info, seed=1, max_tokens=20)
    result = await collect(stub, request)
    assert len(result.token_ids) == 20
    assert [m.HasField("finished") for m in result.messages] == (
        [False] * (len(result.messages) - 1) + [True]
    )
    finished = result.finished
    assert finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert finished.usage.prompt_tokens == 10 and finished.usage.completion_tokens == 20
    assert finished.instance_id == server_info.instance_id
    assert len(result.logprobs) == 20 and all(lp <= 0 for lp in result.logprobs)
    for message in result.messages:
        assert len(message.logprobs) == len(message.token_ids)


async def test_no_logprobs_unless_asked(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request = greedy(server_info, seed=1, max_tokens=5)
    request.output.ClearField("logprobs")
    result = await collect(stub, request)
    assert len(result.token_ids) == 5 and result.logprobs == []


async def test_top_logprobs_come_sorted_with_the_greedy_token_first(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    request = greedy(server_info, seed=2, max_tokens=6)
    request.output.logprobs = 3
    result = await collect(stub, request)
    assert len(result.top_logprobs) == 6
    for token, logprob, top in zip(
        result.token_ids, result.logprobs, result.top_logprobs, strict=True
    ):
        assert len(top.token_ids) == len(top.logprobs) >= 3
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert top.logprobs[0] == logprob or token in top.token_ids


async def test_a_stop_token_ends_generation_but_not_before_min_tokens(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    base = await collect(stub, greedy(server_info, seed=4, max_tokens=24))
    tokens = base.token_ids
    # The first token (after position 2) whose first occurrence is there.
    index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop_token = tokens[index]
    request = greedy(server_info, seed=4, max_tokens=24)
    request.stop.stop_token_ids.append(stop_token)
    stopped = await collect(stub, request)
    assert stopped.token_ids == tokens[: index + 1]
    assert stopped.finished.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.finished.matched_stop.token_id == stop_token
    request = greedy(server_info, seed=4, max_tokens=24)
    request.stop.stop_token_ids.append(stop_token)
    request.stop.min_tokens = index + 2
    later = await collect(stub, request)
    # Before min_tokens the stop token cannot be picked (engines mask it), so
    # generation goes on past where it stopped before.
    assert later.token_ids[:index] == tokens[:index]
    assert stop_token not in later.token_ids[: index + 2]
    assert len(later.token_ids) >= index + 2


async def test_seeded_sampling_is_reproducible(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    def sampled() -> pb.GenerateRequest:
        request = greedy(server_info, seed=5, max_tokens=16)
        request.sampling.temperature = 1.0
        request.sampling.seed = 1234
        return request

    first = await collect(stub, sampled())
    second = await collect(stub, sampled())
    assert first.token_ids == second.token_ids and first.logprobs == second.logprobs


async def test_max_tokens_zero_finishes_at_once(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    result = await collect(stub, greedy(server_info, seed=6, max_tokens=0))
    assert len(result.messages) == 1 and result.token_ids == []
    assert result.finished.finish_reason == pb.FINISH_REASON_LENGTH
