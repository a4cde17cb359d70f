"""RefitControl's rules under failure and cancellation, on the sim engine in-process:
the pause state stays true to the engine, a refused pause aborts nothing, and
the sim's pause, keep and sleep freezes hold and release independently."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.refit import PauseMode
from engine_server.backends.sim import SimBackend
from engine_server.config import ServerConfig
from engine_server.core import ServerCore
from engine_server.errors import RefitRefused


@pytest_asyncio.fixture
async def core() -> AsyncIterator[ServerCore]:
    backend = SimBackend(decode_step_ms=2.0, eos_rate=0.0)
    server = ServerCore(backend, ServerConfig(listen="127.0.0.1:0"), "inst")
    await server.start_engine()
    yield server
    await backend.shutdown()


def long_request(request_id: str) -> pb.RolloutRequest:
    return pb.RolloutRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], max_new_tokens=400)


async def running(core: ServerCore, n: int) -> None:
    for _ in range(500):
        if core.backend.load().running >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never ran")


async def test_a_cancelled_wait_pause_still_pauses_and_resume_releases(core: ServerCore) -> None:
    rollout = asyncio.ensure_future(core.rollout(long_request("a")))
    await running(core, 1)
    pause = asyncio.ensure_future(
        core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
    )
    await asyncio.sleep(0.05)
    pause.cancel()  # the trainer's deadline passed
    with pytest.raises(asyncio.CancelledError):
        await pause
    # The engine finished the drain and is paused; the state says so.
    assert core.refit.paused is PauseMode.WAIT
    assert (await rollout).finish_reason == pb.FINISH_REASON_LENGTH
    assert (await core.refit.resume()).resumed
    answer = await asyncio.wait_for(core.rollout(long_request("b")), 10)
    assert answer.finish_reason == pb.FINISH_REASON_LENGTH


async def test_wait_after_keep_lets_frozen_requests_finish(core: ServerCore) -> None:
    rollout = asyncio.ensure_future(core.rollout(long_request("k")))
    await running(core, 1)
    await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP))
    await asyncio.wait_for(core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT)), 10)
    assert (await rollout).finish_reason == pb.FINISH_REASON_LENGTH
    await core.refit.resume()


async def test_a_sleep_and_wake_keep_a_keep_pause_frozen(core: ServerCore) -> None:
    rollout = asyncio.ensure_future(core.rollout(long_request("s")))
    await running(core, 1)
    await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP))
    await core.refit.sleep(pb.SleepRequest(level=1, mode=pb.PAUSE_MODE_KEEP))
    assert await core.refit.wake_up([])
    await asyncio.sleep(0.2)
    assert not rollout.done() and all(e.frozen for e in core.backend.engines)
    await core.refit.resume()
    assert (await asyncio.wait_for(rollout, 10)).finish_reason == pb.FINISH_REASON_LENGTH


async def test_a_refused_abort_pause_aborts_nothing(core: ServerCore) -> None:
    async def refuse(mode: PauseMode, clear_cache: bool) -> None:
        raise RuntimeError("the engine refused")

    rollout = asyncio.ensure_future(core.rollout(long_request("r")))
    await running(core, 1)
    core.backend.pause = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))
    assert core.refit.paused is None
    assert (await rollout).finish_reason == pb.FINISH_REASON_LENGTH  # not aborted


async def test_transfer_phases_in_order_only(core: ServerCore) -> None:
    with pytest.raises(RefitRefused, match="StartWeightUpdate first"):
        await core.refit.update_weights(b"{}")
    with pytest.raises(RefitRefused, match="StartWeightUpdate first"):
        await core.refit.finish_weight_update(pb.FinishWeightUpdateRequest())
