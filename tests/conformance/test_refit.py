"""The refit cycle: pause, update weights, version, resume (contract revision 3).

Runs against every conformance server. Weight tests need the served model to
be the tiny model (its second checkpoint, seed 1, has the same tensors with new
values); each test leaves the server as it found it: resumed, the original
weights back. Engines that do not serve a part of the cycle must say so in
``rl_capabilities`` and answer FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_contract import TENSOR_STREAM_END_REVISION
from engine_contract.refit_rules import UpdateRefusal
from engine_contract.tensors import Tensor, update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import idle, wait_load_async
from tests.conformance.common import long_generate, make_prompt, new_id

PROMPT_SEEDS = (101, 202, 303)


@dataclass
class Rollout:
    token_ids: list[int]
    logprobs: list[float]
    spans: list[tuple[str, int, int]]
    finish_reason: int = 0


async def read_all(call) -> list[pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    out = []
    while (message := await asyncio.wait_for(call.read(), 60)) != grpc.aio.EOF:
        out.append(message)
    return out


async def wait_until(predicate, what: str, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def greedy(stub: pb_grpc.EngineServiceStub, info: pb.GetServerInfoResponse) -> list[Rollout]:
    """Greedy rollouts of fixed prompts: what the weights serving now produce."""
    out = []
    for seed in PROMPT_SEEDS:
        answer = await stub.Rollout(
            pb.RolloutRequest(
                request_id=new_id("refit"),
                prompt_token_ids=make_prompt(info, 12, seed),
                greedy=True,
                max_new_tokens=16,
            ),
            timeout=60,
        )
        out.append(
            Rollout(
                list(answer.token_ids),
                list(answer.logprobs),
                [(s.version, s.start, s.end) for s in answer.weight_versions],
                answer.finish_reason,
            )
        )
    return out


def outputs(rollouts: list[Rollout]) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, r.logprobs) for r in rollouts]


@dataclass
class Refit:
    """The server under test, and what a test changed that teardown must undo."""

    stub: pb_grpc.EngineServiceStub
    info: pb.GetServerInfoResponse
    weights_changed: bool = False
    original: list[Rollout] = field(default_factory=list)

    async def pause(self, mode: int = pb.PAUSE_MODE_WAIT, **kw: bool) -> pb.PauseGenerationResponse:
        return await self.stub.PauseGeneration(pb.PauseGenerationRequest(mode=mode, **kw))

    async def resume(self) -> pb.ResumeGenerationResponse:
        return await self.stub.ResumeGeneration(pb.ResumeGenerationRequest())

    async def load(self, path: Path | str, version: str | None = None) -> pb.WeightUpdateResult:
        options = pb.WeightUpdateOptions()
        if version is not None:
            options.weight_version = version
        self.weights_changed = True
        answer = await self.stub.UpdateWeightsFromPath(
            pb.UpdateWeightsFromPathRequest(path=str(path), options=options), timeout=120
        )
        return answer.result


def _needs(info: pb.GetServerInfoResponse, capability: str) -> None:
    if not getattr(info.rl_capabilities, capability):
        pytest.skip(f"the {info.backend_name} engine does not serve {capability}")


def _needs_tiny_model(info: pb.GetServerInfoResponse, capability: str) -> Path:
    """Seed-1 weights of the served model, when the engine serves ``capability`` and
    the served model is the tiny one."""
    _needs(info, capability)
    weights = tiny_weights_dir(1)
    served = Path(info.model_path)
    ours = {p.name: p.stat().st_size for p in weights.glob("*.safetensors")}
    theirs = {p.name: p.stat().st_size for p in served.glob("*.safetensors")}
    if (
        not served.is_dir()
        or ours != theirs
        or (served / "config.json").read_text() != (weights / "config.json").read_text()
    ):
        pytest.skip(f"the served model {info.model_path} is not the tiny model")
    return weights


@pytest_asyncio.fixture
async def refit(stub, server_info) -> AsyncIterator[Refit]:  # type: ignore[no-untyped-def]
    state = Refit(stub, server_info)
    try:
        yield state
    finally:
        if server_info.rl_capabilities.pause:
            if state.weights_changed:
                await state.pause(pb.PAUSE_MODE_ABORT)
                await state.load(server_info.model_path, version="default")
            await state.resume()
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
            assert not info.refit_state.paused
        if state.original:
            assert outputs(await greedy(stub, server_info)) == outputs(state.original)


# -- state and versions ---------------------------------------------------------


async def test_server_states_its_refit_capabilities_and_state(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    state = server_info.refit_state
    assert not state.paused and not state.sleeping
    assert state.weight_version  # the engine's own initial label ("default" in vLLM)
    version = await stub.GetWeightVersion(pb.GetWeightVersionRequest())
    assert version.weight_version == state.weight_version
    load = await stub.GetLoad(pb.GetLoadRequest())
    assert load.refit_state.weight_version == state.weight_version
    assert not (await stub.IsPaused(pb.IsPausedRequest())).paused
    assert not (await stub.IsSleeping(pb.IsSleepingRequest())).sleeping


async def test_rollouts_carry_the_weight_version(refit: Refit) -> None:
    rollouts = await greedy(refit.stub, refit.info)
    version = (await refit.stub.GetWeightVersion(pb.GetWeightVersionRequest())).weight_version
    for r in rollouts:
        assert r.spans == [(version, 0, len(r.token_ids))]


async def test_empty_weight_version_is_refused(refit: Refit) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await refit.stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(weight_version=" "))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "weight_version" in e.value.details()


async def test_version_label_applies_to_new_rollouts(refit: Refit) -> None:
    _needs(refit.info, "pause")
    before = (await refit.stub.GetWeightVersion(pb.GetWeightVersionRequest())).weight_version
    try:
        answer = await refit.stub.UpdateWeightVersion(
            pb.UpdateWeightVersionRequest(weight_version="label-7")
        )
        assert answer.weight_version == "label-7"
        got = await refit.stub.GetWeightVersion(pb.GetWeightVersionRequest())
        assert got.weight_version == "label-7" and got.declared
        for r in await greedy(refit.stub, refit.info):
            assert r.spans == [("label-7", 0, len(r.token_ids))]
    finally:
        await refit.stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(weight_version=before))


# -- pause and resume -------------------------------------------------------------


async def test_pause_abort_ends_requests_in_flight_with_retryable_aborted(refit: Refit) -> None:
    _needs(refit.info, "pause")
    # A fast engine (vLLM with the tiny model) may finish a request, or sample
    # EOS, before the pause lands; such a try is resumed and made again.
    for _ in range(5):
        if await _abort_pause_try(refit):
            return
    pytest.fail("in 5 tries the pause never found both requests still running")


async def _abort_pause_try(refit: Refit) -> bool:
    """One Generate and one Rollout, then Pause(ABORT): True when both were
    running and both ended ABORTED; False (resumed again) when one finished
    first. Either way the pause's count equals the requests it ended."""
    stub, info = refit.stub, refit.info
    room = info.engine_config.context_length - 8
    call = stub.Generate(long_generate(info, new_id("pa"), max_tokens=room))
    assert (await asyncio.wait_for(call.read(), 10)).token_ids
    rollout = asyncio.ensure_future(
        stub.Rollout(
            pb.RolloutRequest(
                request_id=new_id("pa"),
                prompt_token_ids=make_prompt(info, 8, 5),
                max_new_tokens=room,
            )
        )
    )
    await wait_load_async(
        stub,
        lambda load: load.running_requests + load.waiting_requests >= 2 or rollout.done(),
        10,
        "both running (or the rollout ended)",
    )
    answer = await refit.pause(pb.PAUSE_MODE_ABORT)
    assert answer.cache_cleared
    ends: list[grpc.StatusCode] = []
    try:
        while await asyncio.wait_for(call.read(), 10) != grpc.aio.EOF:
            pass
        ends.append(grpc.StatusCode.OK)
    except grpc.aio.AioRpcError as e:
        ends.append(e.code())
    try:
        await rollout
        ends.append(grpc.StatusCode.OK)
    except grpc.aio.AioRpcError as e:
        ends.append(e.code())
        assert e.code() != grpc.StatusCode.ABORTED or "pause" in e.details().lower()
    assert set(ends) <= {grpc.StatusCode.OK, grpc.StatusCode.ABORTED}, ends
    assert answer.aborted_count == ends.count(grpc.StatusCode.ABORTED), (answer, ends)
    assert (await stub.IsPaused(pb.IsPausedRequest())).paused
    await wait_load_async(stub, idle, 5, "idle after the abort pause")
    if ends == [grpc.StatusCode.ABORTED] * 2:
        return True
    assert (await refit.resume()).resumed
    return False


async def test_requests_wait_while_paused_and_run_after_resume(refit: Refit) -> None:
    _needs(refit.info, "pause")
    stub, info = refit.stub, refit.info
    await refit.pause(pb.PAUSE_MODE_WAIT)
    waiting = asyncio.ensure_future(greedy(stub, info))
    await wait_load_async(
        stub, lambda load: load.registered_requests == 1, 10, "the rollout waits at the gate"
    )
    load = await stub.GetLoad(pb.GetLoadRequest())
    assert load.running_requests == 0 and load.refit_state.paused
    await asyncio.sleep(0.3)
    assert not waiting.done()
    # A request whose deadline passes while paused ends DEADLINE_EXCEEDED, nothing run.
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await stub.Rollout(
            pb.RolloutRequest(request_id=new_id("dl"), prompt_token_ids=[5, 6, 7]), timeout=0.5
        )
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await refit.resume()).resumed
    assert len(await asyncio.wait_for(waiting, 60)) == len(PROMPT_SEEDS)
    assert not (await refit.resume()).resumed  # not paused: a no-op


async def test_pause_wait_lets_requests_in_flight_finish(refit: Refit) -> None:
    _needs(refit.info, "pause")
    stub, info = refit.stub, refit.info
    request = long_generate(info, new_id("pw"), max_tokens=60)
    call = stub.Generate(request)
    assert (await asyncio.wait_for(call.read(), 10)).token_ids
    answer = await refit.pause(pb.PAUSE_MODE_WAIT)
    assert answer.aborted_count == 0
    messages = await read_all(call)
    assert messages[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
    load = await stub.GetLoad(pb.GetLoadRequest())
    assert load.running_requests == 0


async def test_pause_keep_freezes_and_resume_continues_with_new_version(refit: Refit) -> None:
    _needs(refit.info, "pause")
    stub, info = refit.stub, refit.info
    before = (await stub.GetWeightVersion(pb.GetWeightVersionRequest())).weight_version
    # Long enough that a fast engine (vLLM, tiny model) is still mid-way at the pause.
    max_tokens = min(480, info.engine_config.context_length - 8)
    call = stub.Generate(long_generate(info, new_id("pk"), max_tokens=max_tokens))
    received: list[pb.GenerateResponse] = []

    async def read() -> None:
        while (message := await call.read()) != grpc.aio.EOF:
            received.append(message)

    reader = asyncio.ensure_future(read())
    await wait_until(lambda: bool(received), "the first tokens")
    await refit.pause(pb.PAUSE_MODE_KEEP, clear_cache=False)
    await asyncio.sleep(0.3)  # messages already on their way may still arrive
    frozen = len(received)
    await asyncio.sleep(0.5)
    assert len(received) == frozen and not reader.done()  # frozen, not ended
    frozen_tokens = sum(len(m.token_ids) for m in received)
    assert frozen_tokens < max_tokens
    try:
        await stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(weight_version="kept-2"))
        await refit.resume()
        await asyncio.wait_for(reader, 60)
        total = sum(len(m.token_ids) for m in received)
        finished = received[-1].finished
        assert finished.finish_reason == pb.FINISH_REASON_LENGTH and total == max_tokens
        spans = [(s.version, s.start, s.end) for s in finished.weight_versions]
        assert spans[0][0] == before and spans[-1][0] == "kept-2", spans
        assert spans[0][1] == 0 and spans[-1][2] == max_tokens
        assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))
    finally:
        await stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(weight_version=before))


async def test_pause_clears_the_routers_view_at_once(refit: Refit) -> None:
    """clear_cache: AllBlocksCleared reaches subscribers now, not with the next request."""
    _needs(refit.info, "pause")
    stub, info = refit.stub, refit.info
    await greedy(stub, info)  # something cached
    subscription = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest())
    await subscription.initial_metadata()
    answer = await refit.pause(pb.PAUSE_MODE_WAIT, clear_cache=True)
    assert answer.cache_cleared

    async def until_cleared() -> None:
        async for message in subscription:
            batches = [message.batch, *message.batches]
            live = [b for b in batches if not b.HasField("snapshot")]  # snapshots start cleared
            if any(e.WhichOneof("event") == "cleared" for b in live for e in b.events):
                return

    await asyncio.wait_for(until_cleared(), 5)
    subscription.cancel()


# -- weight updates ---------------------------------------------------------------


async def test_update_is_refused_unless_paused(refit: Refit) -> None:
    weights = _needs_tiny_model(refit.info, "update_from_path")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await refit.stub.UpdateWeightsFromPath(pb.UpdateWeightsFromPathRequest(path=str(weights)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # In dynamo.vllm's words: the RL routes pass the message on as it comes.
    assert e.value.details() == UpdateRefusal.NOT_PAUSED.value
    # allow_unpaused cannot also reset the prefix cache (running requests hold it).
    options = pb.WeightUpdateOptions(allow_unpaused=True, reset_prefix_cache=True)
    with pytest.raises(grpc.aio.AioRpcError) as both:
        await refit.stub.UpdateWeightsFromPath(
            pb.UpdateWeightsFromPathRequest(path=str(weights), options=options)
        )
    assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert both.value.details() == UpdateRefusal.UNPAUSED_CACHE_RESET.value


async def test_refit_from_path_changes_outputs_and_back_restores_them_exactly(
    refit: Refit,
) -> None:
    weights = _needs_tiny_model(refit.info, "update_from_path")
    stub, info = refit.stub, refit.info
    refit.original = await greedy(stub, info)
    await refit.pause(pb.PAUSE_MODE_WAIT)
    result = await refit.load(weights, version="step-1")
    assert result.weight_version == "step-1" and result.cache_cleared
    assert result.tensors > 0 and result.bytes > 0
    await refit.resume()
    after = await greedy(stub, info)
    assert outputs(after) != outputs(refit.original)
    for r in after:
        assert r.spans == [("step-1", 0, len(r.token_ids))]
    # Again: the same weights give the same outputs (nothing left of the old ones).
    assert outputs(await greedy(stub, info)) == outputs(after)
    # Teardown loads the original checkpoint back and checks the outputs match.


def _needs_stream_end(info: pb.GetServerInfoResponse) -> None:
    if info.contract_revision < TENSOR_STREAM_END_REVISION:
        pytest.skip(f"a tensor stream's end message is revision {TENSOR_STREAM_END_REVISION}")


@pytest.mark.parametrize("marked", [False, True], ids=["half-close", "end-message"])
async def test_streamed_tensors_load_like_the_checkpoint(refit: Refit, marked: bool) -> None:
    weights = _needs_tiny_model(refit.info, "update_from_tensors")
    stub, info = refit.stub, refit.info
    if marked:
        _needs_stream_end(info)
    refit.original = await greedy(stub, info)
    await refit.pause(pb.PAUSE_MODE_WAIT)
    await refit.load(weights)
    await refit.resume()
    from_path = await greedy(stub, info)
    await refit.pause(pb.PAUSE_MODE_WAIT)
    await refit.load(info.model_path)  # back to the original
    tensors = checkpoint_tensors(weights)
    # Odd-sized chunks: tensors split across messages at unaligned offsets.
    answer = await stub.UpdateWeightsFromTensors(
        update_requests(tensors, weight_version="streamed", chunk_bytes=7001, end_marker=marked),
        timeout=120,
    )
    assert answer.result.weight_version == "streamed"
    assert answer.result.tensors == len(tensors)
    assert answer.result.bytes == sum(t.nbytes for t in tensors)
    await refit.resume()
    assert outputs(await greedy(stub, info)) == outputs(from_path)


def _bad_shape(tensors: list[Tensor]) -> list[Tensor]:
    first = tensors[0]
    shape = [first.shape[0] * 2, *first.shape[1:]]
    data = bytes(first.data) * 2  # type: ignore[call-overload]
    return [Tensor(first.name, first.dtype, shape, data), *tensors[1:]]


@pytest.mark.parametrize(
    "case",
    ["missing-dir", "wrong-shape", "unknown-name", "missing-tensors", "split-fused-group"],
)
async def test_bad_update_is_refused_and_old_weights_keep_serving(refit: Refit, case: str) -> None:
    weights = _needs_tiny_model(refit.info, "update_from_tensors")
    stub, info = refit.stub, refit.info
    refit.original = await greedy(stub, info)
    version = (await stub.GetWeightVersion(pb.GetWeightVersionRequest())).weight_version
    await refit.pause(pb.PAUSE_MODE_WAIT)
    tensors = checkpoint_tensors(weights)
    partial = False
    if case == "wrong-shape":
        tensors = _bad_shape(tensors)
    elif case == "unknown-name":
        t = tensors[-1]
        tensors = [*tensors, Tensor("model.layers.9.mlp.nonsense.weight", t.dtype, t.shape, t.data)]
    elif case == "missing-tensors":
        tensors = tensors[1:]
    elif case == "split-fused-group":
        tensors = [t for t in tensors if t.name.endswith("layers.0.self_attn.q_proj.weight")]
        partial = True
    with pytest.raises(grpc.aio.AioRpcError) as e:
        if case == "missing-dir":
            await stub.UpdateWeightsFromPath(
                pb.UpdateWeightsFromPathRequest(
                    path=str(weights / "no-such-dir"),
                    options=pb.WeightUpdateOptions(weight_version="never"),
                )
            )
        else:
            await stub.UpdateWeightsFromTensors(
                update_requests(tensors, weight_version="never", allow_partial=partial)
            )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = e.value.details()
    assert "old weights still serve" in detail, detail
    expected = {
        "missing-dir": "does not exist",
        "wrong-shape": tensors[0].name,
        "unknown-name": "model.layers.9.mlp.nonsense.weight",
        "missing-tensors": "missing",
        "split-fused-group": "k_proj",
    }[case]
    assert expected in detail, detail
    await refit.resume()
    assert (await stub.GetWeightVersion(pb.GetWeightVersionRequest())).weight_version == version
    assert outputs(await greedy(stub, info)) == outputs(refit.original)


async def test_broken_tensor_streams_load_nothing(refit: Refit) -> None:
    weights = _needs_tiny_model(refit.info, "update_from_tensors")
    stub, info = refit.stub, refit.info
    refit.original = await greedy(stub, info)
    await refit.pause(pb.PAUSE_MODE_WAIT)
    messages = list(update_requests(checkpoint_tensors(weights), chunk_bytes=50_000))
    assert len(messages) > 4
    out_of_order = [messages[0], messages[2], messages[1], *messages[3:]]
    short = messages[:-1]
    no_manifest = messages[1:]
    for stream, needle in (
        (out_of_order, "out of order"),
        (short, "ended short"),
        (no_manifest, "manifest"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.UpdateWeightsFromTensors(iter(stream))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in e.value.details(), e.value.details()
    if info.contract_revision >= TENSOR_STREAM_END_REVISION:
        marked = list(
            update_requests(checkpoint_tensors(weights), chunk_bytes=50_000, end_marker=True)
        )
        for stream, needle in (
            (marked[:-1], "without the end message its manifest announced"),
            ([*marked[:2], marked[-1]], "came to its end message short"),
            ([*marked, marked[1]], "after the end message"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.UpdateWeightsFromTensors(iter(stream))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in e.value.details(), e.value.details()

    # A client that goes away mid-stream: nothing loaded, the server keeps serving.
    async def half() -> AsyncIterator[pb.UpdateWeightsFromTensorsRequest]:
        for message in messages[: len(messages) // 2]:
            yield message
        await asyncio.sleep(30)

    call = stub.UpdateWeightsFromTensors(half())
    await asyncio.sleep(0.5)
    call.cancel()
    await refit.resume()
    assert outputs(await greedy(stub, info)) == outputs(refit.original)


# -- engines that cannot --------------------------------------------------------


async def test_unsupported_parts_answer_failed_precondition(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    caps = server_info.rl_capabilities
    calls = []
    if not caps.pause:
        calls.append(stub.PauseGeneration(pb.PauseGenerationRequest()))
    if not caps.update_from_path:
        calls.append(
            stub.UpdateWeightsFromPath(
                pb.UpdateWeightsFromPathRequest(
                    path="/nonexistent", options=pb.WeightUpdateOptions(allow_unpaused=True)
                )
            )
        )
    if not caps.weight_transfer_backend:
        calls.append(stub.InitWeightTransferEngine(pb.InitWeightTransferEngineRequest()))
    if not caps.sleep:
        calls.append(stub.Sleep(pb.SleepRequest()))
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not supported" in e.value.details()
    assert not (await stub.IsSleeping(pb.IsSleepingRequest())).sleeping


async def _health_becomes(health: health_pb2_grpc.HealthStub, wanted: int) -> None:
    """Until the health service answers ``wanted`` (2.5 s at most, then it fails)."""
    for _ in range(50):
        status = (await health.Check(health_pb2.HealthCheckRequest())).status
        if status == wanted:
            break
        await asyncio.sleep(0.05)
    assert status == wanted


async def test_sleep_takes_the_server_out_of_service_until_wake_up(
    refit: Refit, engine_address: str
) -> None:
    _needs(refit.info, "sleep")
    stub = refit.stub
    channel = grpc.aio.insecure_channel(engine_address)
    health = health_pb2_grpc.HealthStub(channel)
    await stub.Sleep(pb.SleepRequest(level=1))
    try:
        assert (await stub.IsSleeping(pb.IsSleepingRequest())).sleeping
        await _health_becomes(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        assert (await stub.WakeUp(pb.WakeUpRequest())).awake
    await _health_becomes(health, health_pb2.HealthCheckResponse.SERVING)
    assert len(await greedy(stub, refit.info)) == len(PROMPT_SEEDS)
    await channel.close()
