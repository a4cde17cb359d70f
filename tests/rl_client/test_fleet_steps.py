"""rl_client.fleet_steps.to_its_end: a step run to its end, whatever cancels its caller."""

from __future__ import annotations

import asyncio

import pytest

from rl_client.fleet_steps import to_its_end


async def caller_cancelled_as_the_step_ends(fails: bool) -> tuple[int, bool]:
    """The caller's cancellation scheduled by the step itself as it ends: it lands
    after the step's result is set, before the caller is woken."""
    caller: asyncio.Task[tuple[int, bool]]

    async def step() -> int:
        asyncio.get_running_loop().call_soon(caller.cancel)
        if fails:
            raise RuntimeError("the step's own failure")
        return 42

    caller = asyncio.ensure_future(to_its_end(step()))
    return await caller


async def test_a_cancellation_as_the_step_ends_still_returns_its_result() -> None:
    assert await caller_cancelled_as_the_step_ends(fails=False) == (42, True)


async def test_a_step_that_failed_as_its_caller_was_cancelled_is_a_cancellation() -> None:
    with pytest.raises(asyncio.CancelledError):
        await caller_cancelled_as_the_step_ends(fails=True)


async def test_a_cancellation_mid_step_waits_for_the_step() -> None:
    ended = asyncio.Event()

    async def step() -> str:
        await asyncio.sleep(0.05)
        ended.set()
        return "written"

    caller = asyncio.ensure_future(to_its_end(step()))
    await asyncio.sleep(0.01)
    caller.cancel()
    caller.cancel()  # twice: still to its end
    assert await caller == ("written", True)
    assert ended.is_set()


async def test_uncancelled_it_is_the_step() -> None:
    async def step() -> int:
        return 7

    assert await to_its_end(step()) == (7, False)
