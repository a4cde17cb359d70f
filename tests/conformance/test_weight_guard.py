"""Version-guarded requests (contract revision 8): ``required_weight_version``.

Every conformance server: a request naming a version other than the weights'
label is refused with ABORTED (retryable) before anything runs, on Rollout, on
the Rollouts stream and on Generate, naming both versions; the label itself is
served, every span of it. Engines that pause: a KEEP-mode pause followed by a
new label or new weights ends a guarded request there (finish reason
WEIGHT_VERSION_CHANGED, the tokens so far, all of the required version), where
an unguarded one lives on. Each test leaves the server resumed, its label and
weights as it found them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio

from engine_contract.retry import is_retryable
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import idle, wait_load_async
from tests.conformance.common import long_generate, make_prompt, new_id
from tests.conformance.test_refit import _needs, _needs_tiny_model
from tests.conformance.test_rollouts_stream import error_of, read_results

WVC = pb.FINISH_REASON_WEIGHT_VERSION_CHANGED


@dataclass
class Guarded:
    stub: pb_grpc.EngineServiceStub
    info: pb.GetServerInfoResponse
    version: str  # the label serving when the test began
    weights_changed: bool = False

    async def label(self, version: str) -> None:
        await self.stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(weight_version=version))


@pytest_asyncio.fixture
async def guarded(stub, server_info) -> AsyncIterator[Guarded]:  # type: ignore[no-untyped-def]
    version = (await stub.GetWeightVersion(pb.GetWeightVersionRequest())).weight_version
    state = Guarded(stub, server_info, version)
    try:
        yield state
    finally:
        if server_info.rl_capabilities.pause:
            if state.weights_changed:
                await stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))
                await stub.UpdateWeightsFromPath(
                    pb.UpdateWeightsFromPathRequest(path=server_info.model_path), timeout=120
                )
            await stub.ResumeGeneration(pb.ResumeGenerationRequest())
        now = (await stub.GetWeightVersion(pb.GetWeightVersionRequest())).weight_version
        if now != version:
            await state.label(version)
        await wait_load_async(stub, idle, 10, "idle after the test")


def rollout(
    info: pb.GetServerInfoResponse, version: str, seed: int = 1, max_new_tokens: int = 16
) -> pb.RolloutRequest:
    return pb.RolloutRequest(
        request_id=new_id("wg"),
        prompt_token_ids=make_prompt(info, 8, seed),
        greedy=True,
        max_new_tokens=max_new_tokens,
        required_weight_version=version,
    )


def spans(finished: pb.RolloutResponse | pb.GenerateFinished) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in finished.weight_versions]


def names_both(details: str, required: str, serving: str) -> None:
    assert repr(required) in details and repr(serving) in details, details


async def test_the_serving_version_is_served_with_every_span_its_own(guarded: Guarded) -> None:
    answer = await guarded.stub.Rollout(rollout(guarded.info, guarded.version), timeout=60)
    assert answer.token_ids and spans(answer) == [(guarded.version, 0, len(answer.token_ids))]
    call = guarded.stub.Rollouts()
    await call.write(
        pb.RolloutsRequest(
            start=[pb.RolloutStart(tag=1, rollout=rollout(guarded.info, guarded.version))]
        )
    )
    streamed = (await read_results(call, 1))[1].response
    await call.done_writing()
    assert list(streamed.token_ids) == list(answer.token_ids) and spans(streamed) == spans(answer)
    request = long_generate(guarded.info, new_id("wg"), max_tokens=12)
    request.required_weight_version = guarded.version
    messages = [m async for m in guarded.stub.Generate(request, timeout=60)]
    assert spans(messages[-1].finished) == [(guarded.version, 0, 12)]


async def test_another_version_is_refused_retryably_before_anything_runs(
    guarded: Guarded,
) -> None:
    stub, info, serving = guarded.stub, guarded.info, guarded.version
    other = f"{serving}-other"
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.Rollout(rollout(info, other), timeout=30)
    assert unary.value.code() == grpc.StatusCode.ABORTED and is_retryable(unary.value.code())
    names_both(unary.value.details(), other, serving)
    # On a stream it fails alone; the rollout next to it is served.
    call = stub.Rollouts()
    await call.write(
        pb.RolloutsRequest(
            start=[
                pb.RolloutStart(tag=1, rollout=rollout(info, other)),
                pb.RolloutStart(tag=2, rollout=rollout(info, serving)),
            ]
        )
    )
    results = await read_results(call, 2)
    await call.done_writing()
    code, message = error_of(results[1])
    assert code == grpc.StatusCode.ABORTED
    names_both(message, other, serving)
    assert results[2].response.token_ids
    request = long_generate(info, new_id("wg"), max_tokens=12)
    request.required_weight_version = other
    generate = stub.Generate(request, timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        async for message in generate:
            pytest.fail(f"a refused Generate sent {message}")
    assert streamed.value.code() == grpc.StatusCode.ABORTED
    # Nothing of them reached the engine, nor stayed registered.
    await wait_load_async(stub, idle, 5, "idle")


@pytest.mark.parametrize("label", ["", " ", "v\n1", "x" * 257])
async def test_a_required_version_that_is_no_label_is_invalid(guarded: Guarded, label: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await guarded.stub.Rollout(rollout(guarded.info, label), timeout=30)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "required_weight_version" in bad.value.details()


async def _frozen(guarded: Guarded) -> tuple[grpc.aio.UnaryStreamCall, list[pb.GenerateResponse]]:
    """A guarded Generate long enough to be mid-way when a KEEP-mode pause freezes
    it (EOS ignored), and the deltas it sent; the pause is on when this returns."""
    info = guarded.info
    request = long_generate(
        info, new_id("wgk"), max_tokens=min(480, info.engine_config.context_length - 8)
    )
    request.required_weight_version = guarded.version
    call = guarded.stub.Generate(request, timeout=120)
    first = await asyncio.wait_for(call.read(), 30)
    assert first != grpc.aio.EOF and first.token_ids
    await guarded.stub.PauseGeneration(
        pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP, clear_cache=False)
    )
    return call, [first]


async def _ended(
    call: grpc.aio.UnaryStreamCall, received: list[pb.GenerateResponse], version: str
) -> int:
    """The frozen Generate's end: WEIGHT_VERSION_CHANGED with every token of
    ``version``, while the server is still paused; how many tokens it made."""
    while (message := await asyncio.wait_for(call.read(), 30)) != grpc.aio.EOF:
        received.append(message)
    finished = received[-1].finished
    made = sum(len(m.token_ids) for m in received)
    assert finished.finish_reason == WVC, finished
    assert spans(finished) == [(version, 0, made)]
    assert finished.usage.completion_tokens == made
    return made


async def test_a_new_label_under_a_keep_pause_ends_guarded_requests(guarded: Guarded) -> None:
    _needs(guarded.info, "pause")
    stub = guarded.stub
    call, received = await _frozen(guarded)
    await guarded.label(f"{guarded.version}-relabelled")
    await _ended(call, received, guarded.version)
    assert (await stub.IsPaused(pb.IsPausedRequest())).paused


async def test_new_weights_under_a_keep_pause_end_guarded_requests_not_others(
    guarded: Guarded,
) -> None:
    weights = _needs_tiny_model(guarded.info, "update_from_path")
    stub, info = guarded.stub, guarded.info
    free = long_generate(
        info, new_id("wgf"), seed=3, max_tokens=min(480, info.engine_config.context_length - 8)
    )
    free_call = stub.Generate(free, timeout=120)
    assert (await asyncio.wait_for(free_call.read(), 30)).token_ids
    call, received = await _frozen(guarded)
    guarded.weights_changed = True
    loaded = await stub.UpdateWeightsFromPath(
        pb.UpdateWeightsFromPathRequest(
            path=str(weights), options=pb.WeightUpdateOptions(weight_version="wg-new")
        ),
        timeout=120,
    )
    assert loaded.result.weight_version == "wg-new"
    await _ended(call, received, guarded.version)
    # Served the new version after resume; the unguarded request lived on into it.
    await stub.ResumeGeneration(pb.ResumeGenerationRequest())
    last = pb.GenerateResponse()
    while (message := await asyncio.wait_for(free_call.read(), 60)) != grpc.aio.EOF:
        last = message
    assert spans(last.finished)[-1][0] == "wg-new"
    answer = await stub.Rollout(rollout(info, "wg-new"), timeout=60)
    assert spans(answer) == [("wg-new", 0, len(answer.token_ids))]
