"""Scheduling, timing, aborts, cancellation and the backend's lifecycle."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_server.backends.base import (
    EngineDeadError,
    EngineRequestError,
    FinishReason,
    SamplingSpec,
)
from engine_server.backends.sim import SimBackend
from harness.waits import wait_until_async
from tests.unit.sim.sim_helpers import collect, logprobs_of, tokens_of

pytestmark = pytest.mark.serial

PROMPT = list(range(40))


def spec(n: int, **kw) -> SamplingSpec:
    return SamplingSpec(max_tokens=n, ignore_eos=True, **kw)


async def registered(backend: SimBackend, count: int) -> None:
    """Until ``count`` requests are registered (running or waiting), then until the
    engine has scheduled with them: the step under way ends, and the next one."""
    await wait_until_async(
        lambda: backend.load().running + backend.load().waiting == count,
        5,
        f"{count} requests registered",
    )
    steps = backend.engine.num_steps
    await wait_until_async(
        lambda: backend.engine.num_steps >= steps + 2, 5, "a scheduling step with them"
    )


async def test_info_and_load_describe_the_configured_engine_at_rest(make_backend):
    backend, _ = await make_backend(num_kv_blocks=300, max_num_seqs=8, served_model_name="m")
    info = backend.info
    assert info.model_name == "m" and info.backend_name == "sim" and info.backend_version
    assert (info.vocab_size, info.eos_token_ids) == (32000, (2,))
    assert (info.total_kv_blocks, info.kv_block_size, info.max_running_sequences) == (300, 16, 8)
    assert not info.reports_routed_experts
    load = backend.load()
    assert (load.running, load.waiting, load.kv_blocks_used, load.kv_blocks_total) == (0, 0, 0, 300)
    assert SimBackend().info.model_name == "sim-model"


async def test_requests_wait_beyond_max_num_seqs(make_backend):
    backend, _ = await make_backend(max_num_seqs=2, zero_delay=False, decode_step_ms=10.0)
    tasks = [asyncio.create_task(collect(backend, f"r{i}", PROMPT, spec(40))) for i in range(4)]
    await registered(backend, 4)
    load = backend.load()
    assert (load.running, load.waiting) == (2, 2)
    # Only the running ones hold blocks: 40-token prompts plus under 40 tokens each.
    assert 2 * 3 <= load.kv_blocks_used <= 2 * 5
    results = await asyncio.gather(*tasks)
    assert all(len(tokens_of(outs)) == 40 for outs in results)
    assert backend.load().running == backend.load().waiting == 0


async def test_requests_wait_for_kv_blocks(make_backend):
    # 10 blocks of 4: one 24-token prompt takes 6, so a second must wait.
    backend, _ = await make_backend(
        block_size=4, num_kv_blocks=10, context_length=40, zero_delay=False, decode_step_ms=20.0
    )
    a = asyncio.create_task(collect(backend, "a", list(range(24)), spec(12)))
    await wait_until_async(lambda: backend.load().running == 1, 5, "request a running")
    b = asyncio.create_task(collect(backend, "b", list(range(100, 124)), spec(12)))
    await registered(backend, 2)
    assert (backend.load().running, backend.load().waiting) == (1, 1)
    outs_a, outs_b = await asyncio.gather(a, b)
    assert len(tokens_of(outs_a)) == len(tokens_of(outs_b)) == 12


async def test_preemption_keeps_outputs_identical(make_backend):
    tight, _ = await make_backend(
        block_size=4, num_kv_blocks=16, context_length=64, max_num_seqs=4, max_num_batched_tokens=8
    )
    roomy, _ = await make_backend()
    s = SamplingSpec(max_tokens=40, ignore_eos=True, logprobs=0)
    prompts = [list(range(i * 10, i * 10 + 8)) for i in range(4)]
    tight_runs = await asyncio.gather(
        *(collect(tight, f"r{i}", p, s) for i, p in enumerate(prompts))
    )
    assert tight.engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        alone = await collect(roomy, f"r{i}", p, s)
        assert tokens_of(tight_runs[i]) == tokens_of(alone)
        assert logprobs_of(tight_runs[i]) == logprobs_of(alone)
        assert tight_runs[i][-1].finish_reason is FinishReason.LENGTH


async def test_timing_follows_step_costs(make_backend):
    backend, _ = await make_backend(
        zero_delay=False, decode_step_ms=10.0, prefill_tokens_per_s=1000.0
    )
    t0 = time.monotonic()
    gen = backend.generate("r", list(range(100)), spec(6))
    first = await gen.__anext__()
    t_first = time.monotonic() - t0
    rest = [o async for o in gen]
    total = time.monotonic() - t0
    assert len(first.token_ids) == 1
    assert t_first >= 0.09  # 100 prompt tokens at 1000 tokens/s
    assert total >= 0.09 + 5 * 0.009  # then 5 decode steps of 10 ms
    assert len(tokens_of([first, *rest])) == 6


async def test_slow_consumer_gets_several_tokens_per_delta(make_backend):
    backend, _ = await make_backend(zero_delay=False, decode_step_ms=1.0)
    outs = []
    async for out in backend.generate("r", PROMPT, spec(30)):
        outs.append(out)
        await asyncio.sleep(0.01)
    assert len(tokens_of(outs)) == 30
    assert len(outs) < 15 and max(len(o.token_ids) for o in outs) > 1


async def test_abort_yields_aborted_final_and_frees_blocks(make_backend):
    backend, _ = await make_backend(zero_delay=False, decode_step_ms=2.0)
    gen = backend.generate("r", PROMPT, spec(1000, logprobs=0))
    outs = [await gen.__anext__()]
    assert backend.load().running == 1 and backend.load().kv_blocks_used > 0
    await asyncio.sleep(0.02)  # tokens pile up unread
    await backend.abort("r")
    outs += [o async for o in gen]
    final = outs[-1]
    assert final.finished and final.finish_reason is FinishReason.ABORTED
    assert len(final.token_ids) > 0  # the tokens not yielded before the abort
    assert len(tokens_of(outs)) == sum(len(o.logprobs or []) for o in outs) < 1000
    assert backend.load().running == 0 and backend.load().kv_blocks_used == 0
    await backend.abort("r")  # finished: no-op
    await backend.abort("never-seen")


async def test_aborting_a_waiting_request(make_backend):
    backend, _ = await make_backend(max_num_seqs=1, zero_delay=False, decode_step_ms=2.0)
    running = asyncio.create_task(collect(backend, "a", PROMPT, spec(20)))
    waiting = asyncio.create_task(collect(backend, "b", PROMPT, spec(20)))
    await wait_until_async(lambda: backend.load().waiting == 1, 5, "request b waiting")
    await backend.abort("b")
    outs = await waiting
    assert tokens_of(outs) == [] and outs[-1].finish_reason is FinishReason.ABORTED
    assert outs[-1].num_cached_tokens == 0
    assert len(tokens_of(await running)) == 20


async def test_aclose_and_cancel_remove_the_request(make_backend):
    backend, _ = await make_backend(zero_delay=False, decode_step_ms=2.0)
    gen = backend.generate("r", PROMPT, spec(1000))
    await gen.__anext__()
    assert backend.load().running == 1
    await gen.aclose()
    assert backend.load().running == 0 and backend.load().kv_blocks_used == 0

    task = asyncio.create_task(collect(backend, "r", PROMPT, spec(1000)))  # id reusable
    await wait_until_async(lambda: backend.load().running == 1, 5, "the reused id running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.load().running == 0 and backend.load().kv_blocks_used == 0
    assert backend.cached_block_hashes()  # full blocks stay cached


async def test_a_duplicate_or_invalid_request_is_refused(make_backend):
    backend, _ = await make_backend(zero_delay=False, decode_step_ms=2.0)
    gen = backend.generate("dup", PROMPT, spec(1000))
    await gen.__anext__()
    with pytest.raises(EngineRequestError, match="already running"):
        await collect(backend, "dup", PROMPT, spec(5))
    await gen.aclose()
    for prompt, bad in (
        ([], spec(5)),
        ([32000], spec(5)),
        (list(range(5000)), spec(5)),
        (PROMPT, spec(5, top_p=0.0)),
        (PROMPT, spec(-1)),
    ):
        with pytest.raises(EngineRequestError):
            await collect(backend, "bad", prompt, bad)
    assert backend.load().running == 0


async def test_shutdown_aborts_and_kills(make_backend):
    backend, _ = await make_backend(zero_delay=False, decode_step_ms=2.0)
    task = asyncio.create_task(collect(backend, "r", PROMPT, spec(1000)))
    await wait_until_async(lambda: backend.load().running == 1, 5, "the request running")
    await backend.check_health()
    await backend.shutdown()
    outs = await task
    assert outs[-1].finish_reason is FinishReason.ABORTED
    with pytest.raises(EngineDeadError):
        await backend.check_health()
    with pytest.raises(EngineDeadError):
        await collect(backend, "again", PROMPT, spec(5))
    await backend.shutdown()  # idempotent


async def test_start_takes_the_configured_startup_delay():
    backend = SimBackend(startup_delay_s=0.05)
    t0 = time.monotonic()
    info = await backend.start(None)
    assert time.monotonic() - t0 >= 0.05 and info.backend_name == "sim"
    await backend.shutdown()


async def test_idle_loop_does_not_spin(make_backend):
    backend, _ = await make_backend()
    await collect(backend, "r", PROMPT, spec(5))
    steps = backend.engine.num_steps
    cpu = time.process_time()
    await asyncio.sleep(0.1)
    assert backend.engine.num_steps == steps
    assert time.process_time() - cpu < 0.05  # a spinning loop would burn the whole 0.1 s


async def test_zero_delay_16k_tokens_is_fast(make_backend):
    backend, _ = await make_backend(context_length=17000, num_kv_blocks=1100)
    t0 = time.monotonic()
    outs = await collect(backend, "r", PROMPT, spec(16000, logprobs=0))
    elapsed = time.monotonic() - t0
    assert len(tokens_of(outs)) == 16000 and outs[-1].finish_reason is FinishReason.LENGTH
    # Not a speed target (those are make bench's): a bound that only a step delay
    # breaks. 16,000 steps at the default 5 ms decode step take 80 s; the zero-
    # delay loop takes about a second, five on a machine busy with other work.
    assert elapsed < 30.0


async def test_engine_failure_is_reported_as_dead(make_backend):
    backend, _ = await make_backend(zero_delay=False, decode_step_ms=2.0)
    task = asyncio.create_task(collect(backend, "r", PROMPT, spec(1000)))
    await wait_until_async(lambda: backend.load().running == 1, 5, "the request running")

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    backend.engine.sampler.choose = broken  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="boom"):
        await task
    with pytest.raises(EngineDeadError):
        await backend.check_health()
    assert backend.load().running == 0
