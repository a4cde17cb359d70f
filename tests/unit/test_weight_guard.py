"""Version-guarded requests (contract revision 8) in the serving core, on the sim
engine in-process: refused before anything is generated when the weights carry
another label (also once a paused server resumes on a new one), and ended, not
continued, by a weight or label change under them, with the tokens so far, every
one of the version they required."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import grpc
import pytest
import pytest_asyncio

from engine_contract.retry import is_retryable
from engine_contract.tensors import update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.base import EngineOutput, SamplingSpec
from engine_server.backends.sim import SimBackend
from engine_server.config import ServerConfig
from engine_server.core import ServerCore
from engine_server.errors import InvalidRequest, WeightVersionMismatch
from engine_server.refit_requests import update_from_tensors
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.tiny_model import tiny_model_dir
from harness.waits import wait_until_async

MAX_TOKENS = 400


@pytest_asyncio.fixture
async def core() -> AsyncIterator[ServerCore]:
    """A sim engine on the tiny model's weights, labelled "v1", slow enough (2 ms a
    step) that a request is still running when a refit comes."""
    backend = SimBackend(decode_step_ms=2.0, eos_rate=0.0, model=str(tiny_model_dir()))
    server = ServerCore(backend, ServerConfig(listen="127.0.0.1:0"), "inst")
    await server.start_engine()
    await server.refit.update_version("v1")
    yield server
    await backend.shutdown()


def rollout(request_id: str, version: str | None = None, **kw: int) -> pb.RolloutRequest:
    request = pb.RolloutRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7, 8],
        max_new_tokens=kw.get("max_new_tokens", MAX_TOKENS),
    )
    if version is not None:
        request.required_weight_version = version
    return request


def generate(request_id: str, version: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[9, 10, 11],
        stop=pb.StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True),
        output=pb.OutputOptions(logprobs=0),
        required_weight_version=version,
    )


def spans(finished: pb.RolloutResponse | pb.GenerateFinished) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in finished.weight_versions]


async def tokens_made(core: ServerCore, n: int, at_least: int = 1) -> None:
    """Until ``n`` requests run in the engine and each has made ``at_least`` tokens."""

    def made() -> bool:
        running = core.backend.engine.scheduler.running  # type: ignore[attr-defined]
        return len(running) >= n and all(r.num_output_tokens >= at_least for r in running)

    await wait_until_async(made, 10, f"{n} requests running")


async def collect(messages: AsyncGenerator[pb.GenerateResponse, None]) -> list[pb.GenerateResponse]:
    async with contextlib.aclosing(messages):
        return [m async for m in messages]


# -- the refusal -----------------------------------------------------------------------


async def test_the_required_version_is_served_with_every_span_its_own(core: ServerCore) -> None:
    answer = await core.rollout(rollout("r", "v1", max_new_tokens=20))
    assert answer.finish_reason == pb.FINISH_REASON_LENGTH and len(answer.token_ids) == 20
    assert spans(answer) == [("v1", 0, 20)]


async def test_another_version_is_refused_retryably_before_anything_runs(
    core: ServerCore,
) -> None:
    for request in (rollout("r", "v0"), rollout("nothing", "v0", max_new_tokens=0)):
        with pytest.raises(WeightVersionMismatch) as refused:
            await core.rollout(request)
        assert refused.value.code == grpc.StatusCode.ABORTED and is_retryable(refused.value.code)
        assert "'v0'" in str(refused.value) and "'v1'" in str(refused.value)
    with pytest.raises(WeightVersionMismatch):
        await collect(core.generate(generate("g", "v0")))
    # Refused before the registry or the engine saw it.
    load = core.load()
    assert load.registered_requests == 0 and load.running_requests == 0


@pytest.mark.parametrize("label", ["", " ", "v\n1", "x" * 257])
async def test_a_required_version_that_is_no_label_is_invalid(core: ServerCore, label: str) -> None:
    with pytest.raises(InvalidRequest) as bad:
        await core.rollout(rollout("r", label))
    assert bad.value.field == "required_weight_version"


async def test_a_request_waiting_for_a_paused_server_is_checked_again_at_resume(
    core: ServerCore,
) -> None:
    await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
    stale = asyncio.ensure_future(core.rollout(rollout("stale", "v1", max_new_tokens=8)))
    await wait_until_async(lambda: len(core.registry) == 1, 5, "at the gate")
    await core.refit.update_version("v2")
    fresh = asyncio.ensure_future(core.rollout(rollout("fresh", "v2", max_new_tokens=8)))
    await wait_until_async(lambda: len(core.registry) == 2, 5, "both at the gate")
    await core.refit.resume()
    with pytest.raises(WeightVersionMismatch) as refused:
        await stale
    assert "'v1'" in str(refused.value) and "'v2'" in str(refused.value)
    assert spans(await fresh) == [("v2", 0, 8)]


# -- the end at a weight change ------------------------------------------------------------


async def keep_paused_with(core: ServerCore) -> tuple[asyncio.Future[pb.RolloutResponse], ...]:
    """A guarded rollout, an unguarded one and a guarded Generate, frozen by a
    KEEP-mode pause after each made some tokens."""
    guarded = asyncio.ensure_future(core.rollout(rollout("guarded", "v1")))
    free = asyncio.ensure_future(core.rollout(rollout("free")))
    messages = asyncio.ensure_future(collect(core.generate(generate("gen", "v1"))))
    await tokens_made(core, 3, at_least=2)
    await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP))
    return guarded, free, messages  # type: ignore[return-value]


@pytest.mark.parametrize("update", ["path", "tensors"])
async def test_a_keep_mode_refit_ends_guarded_requests_at_the_weight_change(
    core: ServerCore, update: str
) -> None:
    guarded, free, messages = await keep_paused_with(core)
    await asyncio.sleep(0.05)
    assert not guarded.done()  # frozen, not ended, by the pause alone
    weights = tiny_weights_dir(1)
    if update == "path":
        await core.updates.update_from_path(
            pb.UpdateWeightsFromPathRequest(
                path=str(weights), options=pb.WeightUpdateOptions(weight_version="v2")
            )
        )
    else:
        requests = update_requests(checkpoint_tensors(weights), weight_version="v2")

        async def stream() -> AsyncIterator[pb.UpdateWeightsFromTensorsRequest]:
            for request in requests:
                yield request

        await update_from_tensors(core, stream())
    # Ended at the change, still paused: what they made so far, all of v1.
    answer = await asyncio.wait_for(guarded, 5)
    assert core.refit.paused is not None
    made = len(answer.token_ids)
    assert answer.finish_reason == pb.FINISH_REASON_WEIGHT_VERSION_CHANGED
    assert 2 <= made < MAX_TOKENS and len(answer.logprobs) == made and not answer.truncated
    assert spans(answer) == [("v1", 0, made)]
    assert answer.usage.completion_tokens == made
    deltas = await asyncio.wait_for(messages, 5)
    finished = deltas[-1].finished
    streamed = sum(len(m.token_ids) for m in deltas)
    assert finished.finish_reason == pb.FINISH_REASON_WEIGHT_VERSION_CHANGED
    assert spans(finished) == [("v1", 0, streamed)] and 2 <= streamed < MAX_TOKENS
    # The unguarded one lives on into the new version, as KEEP says.
    assert not free.done()
    await core.refit.resume()
    continued = await asyncio.wait_for(free, 10)
    assert continued.finish_reason == pb.FINISH_REASON_LENGTH
    versions = spans(continued)
    assert versions[0][0] == "v1" and versions[-1] == ("v2", versions[-1][1], MAX_TOKENS)


async def test_a_new_label_ends_only_the_requests_of_another_version(core: ServerCore) -> None:
    guarded = asyncio.ensure_future(core.rollout(rollout("guarded", "v1")))
    await tokens_made(core, 1, at_least=2)
    await core.refit.update_version("v1")  # the same label: nothing changes
    await asyncio.sleep(0.05)
    assert not guarded.done()
    await core.refit.update_version("v1b")  # unpaused, a label alone
    answer = await asyncio.wait_for(guarded, 5)
    assert answer.finish_reason == pb.FINISH_REASON_WEIGHT_VERSION_CHANGED
    assert spans(answer) == [("v1", 0, len(answer.token_ids))] and answer.token_ids


async def test_a_resume_without_a_weight_change_continues_guarded_requests(
    core: ServerCore,
) -> None:
    guarded, free, messages = await keep_paused_with(core)
    await core.refit.resume()
    answer = await asyncio.wait_for(guarded, 10)
    assert answer.finish_reason == pb.FINISH_REASON_LENGTH
    assert spans(answer) == [("v1", 0, MAX_TOKENS)]
    await asyncio.wait_for(asyncio.gather(free, messages), 10)


class Relabelling(SimBackend):
    """A sim whose label changes behind the server (as a host driving its own engine
    could): the last output's spans name another version for the later tokens."""

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], spec: SamplingSpec
    ) -> AsyncGenerator[EngineOutput, None]:
        async for out in super().generate(request_id, prompt_token_ids, spec):
            if out.finished and out.weight_versions:
                (version, start, end), *_ = out.weight_versions
                out.weight_versions = [(version, start, end - 1), ("behind", end - 1, end)]
            yield out


async def test_tokens_of_another_version_never_go_out() -> None:
    backend = Relabelling(decode_step_ms=0.0, eos_rate=0.0)
    server = ServerCore(backend, ServerConfig(listen="127.0.0.1:0"), "inst")
    await server.start_engine()
    try:
        version = server.refit.version
        with pytest.raises(WeightVersionMismatch) as refused:
            await server.rollout(rollout("r", version, max_new_tokens=5))
        assert "'behind'" in str(refused.value) and refused.value.code == grpc.StatusCode.ABORTED
        with pytest.raises(WeightVersionMismatch):
            await collect(server.generate(generate("g", version)))
        # Unguarded, the spans pass as the engine made them.
        answer = await server.rollout(rollout("free", max_new_tokens=5))
        assert spans(answer) == [(version, 0, 4), ("behind", 4, 5)]
    finally:
        await backend.shutdown()
