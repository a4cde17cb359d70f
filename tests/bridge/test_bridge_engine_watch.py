"""EngineWatch.recheck: an owner that left the pool on its engine's behalf is told
when the engine serves again, even across an outage too short for the watch to see."""

from __future__ import annotations

import asyncio

from bridge.client import Health
from bridge.engine_watch import EngineWatch


class ScriptedHealth:
    """A client whose health answers are handed out one probe at a time."""

    def __init__(self) -> None:
        self.answers: asyncio.Queue[Health] = asyncio.Queue()
        self.asked = asyncio.Event()  # a probe waits for its answer

    async def health(self) -> Health:
        self.asked.set()
        return await self.answers.get()


async def watched() -> tuple[EngineWatch, ScriptedHealth, list[tuple[bool, str]]]:
    client = ScriptedHealth()
    told: list[tuple[bool, str]] = []

    async def on_change(serving: bool, reason: str) -> None:
        told.append((serving, reason))

    watch = EngineWatch(client, on_change, interval_s=0.001)  # type: ignore[arg-type]
    watch.start()
    await client.asked.wait()  # its first probe in flight
    return watch, client, told


async def answer(client: ScriptedHealth, health: Health) -> None:
    """The probe in flight answered and reacted to (the next one asked)."""
    client.asked.clear()
    await client.answers.put(health)
    await asyncio.wait_for(client.asked.wait(), 5)


async def test_a_recheck_reports_the_next_serving_answer_once() -> None:
    watch, client, told = await watched()
    try:
        await answer(client, Health.SERVING)
        assert told == []
        # Asleep and awake again between two probes: the watch saw no outage.
        mark = watch.recheck()
        await answer(client, Health.SERVING)  # the probe asked before the mark
        await answer(client, Health.SERVING)
        await asyncio.wait_for(watch.checked(mark), 5)
        assert [serving for serving, _ in told] == [True]
        await answer(client, Health.SERVING)
        assert len(told) == 1
    finally:
        await watch.stop()


async def test_a_probe_asked_before_the_recheck_does_not_settle_it() -> None:
    """The route marks after its Sleep answered: a SERVING answer to a probe asked
    before then is about the engine before its sleep."""
    watch, client, told = await watched()
    try:
        await answer(client, Health.SERVING)
        mark = watch.recheck()  # a probe is in flight, asked before the mark
        await answer(client, Health.SERVING)
        assert told == []
        await answer(client, Health.NOT_SERVING)  # asleep: one failure, not two
        assert told == [] and watch.serving
        await answer(client, Health.SERVING)  # woken elsewhere
        await asyncio.wait_for(watch.checked(mark), 5)
        assert [serving for serving, _ in told] == [True]
    finally:
        await watch.stop()


async def test_an_outage_the_watch_saw_is_reported_once_with_the_recheck() -> None:
    watch, client, told = await watched()
    try:
        await answer(client, Health.SERVING)
        watch.recheck()
        for _ in range(watch.failures):
            await answer(client, Health.NOT_SERVING)
        assert told == [(False, "engine server not serving")]
        await answer(client, Health.SERVING)
        await answer(client, Health.SERVING)
        assert [serving for serving, _ in told] == [False, True]
    finally:
        await watch.stop()


async def test_checked_returns_when_the_watch_stops() -> None:
    watch, _, _ = await watched()
    mark = watch.recheck()
    waiting = asyncio.ensure_future(watch.checked(mark))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await watch.stop()
    await asyncio.wait_for(waiting, 5)
