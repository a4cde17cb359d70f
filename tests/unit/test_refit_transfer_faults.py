"""A weight-transfer peer that fails (issue 37, defect 3), at the refit control: the
engine runs its calls one at a time (as vLLM's EngineCore does), so a step given up
on at its deadline would hold every later call behind it; a trainer that dies mid-
update must leave no update in progress and the old weights serving.

- A stuck init: its caller gets DEADLINE_EXCEEDED at its deadline; the next init gets
  UNAVAILABLE at once, a shutdown OK at once (the teardown is queued behind it
  already), neither queued behind it; once it ends, the teardown runs, and inits.
- An update the engine rolled back (its trainer gone during UpdateWeights) is over,
  even though its caller left before the answer: resume goes through.
- An update whose trainer died between its calls is rolled back by the next init (or
  a shutdown); a rollback that fails leaves the weights unknown.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from engine_server.config import RefitConfig
from engine_server.core import ServerCore
from engine_server.errors import (
    EngineFailed,
    RefitRefused,
    RefitTimedOut,
    TransferUnavailable,
    UpdateAbandoned,
)
from harness.engine import nothing
from tests.unit.test_refit_control import sim_core, still_serving, update_started
from tests.unit.test_refit_init_deadline import hanging_transfer

pytestmark = [pytest.mark.serial, pytest.mark.timeout(30)]


class SerialEngine:
    """A transfer engine whose calls run one at a time, as in vLLM's EngineCore: an
    init to ``{"hang": true}`` blocks until ``release`` is set."""

    def __init__(self, core: ServerCore) -> None:
        hanging_transfer(core, "gloo")  # the capabilities of a gloo engine
        self.turn = asyncio.Lock()
        self.release = asyncio.Event()
        self.calls: list[str] = []
        backend = core.backend
        backend.init_weight_transfer = self.init  # type: ignore[method-assign]
        backend.shutdown_weight_transfer = self.shutdown  # type: ignore[method-assign]

    async def init(self, info: dict[str, Any]) -> None:
        async with self.turn:
            self.calls.append("init")
            if info.get("hang"):
                await self.release.wait()

    async def shutdown(self) -> None:
        async with self.turn:
            self.calls.append("shutdown")


async def test_a_stuck_init_answers_at_its_deadline_and_later_calls_at_once() -> None:
    async with sim_core(RefitConfig(check_timeout_s=5, timeout_s=60)) as core:
        engine = SerialEngine(core)
        started = time.monotonic()
        with pytest.raises(RefitTimedOut, match=r"caller's init deadline of 0\.3 s"):
            await core.updates.init_weight_transfer({"hang": True}, 0.3)
        # Not the check deadline more: the teardown queued behind the stuck init.
        assert time.monotonic() - started < 2.5
        started = time.monotonic()
        with pytest.raises(TransferUnavailable, match=r"InitWeightTransferEngine\) is still stuck"):
            await core.updates.init_weight_transfer({}, 10)
        # A shutdown: already queued in the engine behind the stuck init, said at once.
        await core.updates.shutdown_weight_transfer()
        assert time.monotonic() - started < 0.5
        assert engine.calls == ["init"]
        await asyncio.wait_for(core.refit.resume(), 1)  # the refit lock is free

        engine.release.set()  # the rendezvous gives up at last: the teardown runs
        for _ in range(100):
            if engine.calls == ["init", "shutdown"]:
                break
            await asyncio.sleep(0.02)
        await core.updates.init_weight_transfer({}, 10)
        assert engine.calls == ["init", "shutdown", "init"]


async def test_an_update_the_engine_rolled_back_is_over_though_its_caller_left() -> None:
    """The trainer that sent UpdateWeights died: its call is cancelled, the engine's
    round fails on the dead group and rolls the update back; no update is left in
    progress, so resume goes through at once."""
    async with sim_core() as core:
        backend = core.backend
        failing = asyncio.Event()

        async def receive(info: object) -> None:
            await failing.wait()
            raise UpdateAbandoned("the trainer's group went away: rolled back")

        backend.update_weights = receive  # type: ignore[method-assign]
        await update_started(core)
        call = asyncio.ensure_future(core.updates.update_weights({}))
        await asyncio.sleep(0.05)
        call.cancel()  # the trainer's process is gone
        failing.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        await still_serving(core)


async def test_the_next_init_rolls_back_an_update_its_trainer_left() -> None:
    async with sim_core() as core:
        backend = core.backend
        abandoned: list[str] = []

        async def abort(why: str) -> None:
            abandoned.append(why)

        backend.init_weight_transfer = nothing  # type: ignore[method-assign]
        backend.abort_weight_update = abort  # type: ignore[method-assign]
        await update_started(core)
        # The trainer died here: the refusal names the way out without it.
        with pytest.raises(RefitRefused, match=r"in progress.*ShutdownWeightTransferEngine"):
            await core.refit.resume()
        await core.updates.init_weight_transfer({})  # a new trainer
        assert abandoned == ["a new InitWeightTransferEngine replaces the trainer's group"]
        await still_serving(core)  # no update in progress, the old weights


async def test_a_rollback_that_fails_leaves_the_weights_unknown() -> None:
    async with sim_core() as core:
        backend = core.backend

        async def abort(why: str) -> None:
            raise EngineFailed("what it had loaded could not be rolled back")

        backend.shutdown_weight_transfer = nothing  # type: ignore[method-assign]
        backend.abort_weight_update = abort  # type: ignore[method-assign]
        await update_started(core)
        with pytest.raises(EngineFailed, match=r"could not be rolled back.*unknown"):
            await core.updates.shutdown_weight_transfer()
        assert core.refit.broken is not None
