"""The paged prefix cache: hits, hash chains, LRU eviction, KV-event replay, reset."""

from __future__ import annotations

import asyncio
import random

from engine_server.backends.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FinishReason,
    SamplingSpec,
)
from engine_server.backends.sim.hashing import ROOT_HASH, extend_hash
from engine_server.backends.sim.prefix_cache import PrefixCache
from tests.unit.sim.sim_helpers import collect, tokens_of


def greedy(n: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=n, temperature=0.0)


async def test_prefix_hits_count_full_blocks(make_backend):
    backend, _ = await make_backend(block_size=16)
    prompt = list(range(1000, 1040))
    first = await collect(backend, "a", prompt, greedy(4))
    assert first[-1].num_cached_tokens == 0
    again = await collect(backend, "b", prompt, greedy(4))
    assert again[-1].num_cached_tokens == 32  # two full blocks of 40 tokens
    assert tokens_of(again) == tokens_of(first)
    # A prompt of exactly two blocks: the last token is always computed.
    exact = list(range(2000, 2032))
    await collect(backend, "c", exact, greedy(1))
    assert (await collect(backend, "d", exact, greedy(1)))[-1].num_cached_tokens == 16
    # A different first block misses everything after it.
    other = [7, *prompt[1:]]
    assert (await collect(backend, "e", other, greedy(1)))[-1].num_cached_tokens == 0


async def test_generated_blocks_are_cached(make_backend):
    backend, _ = await make_backend(block_size=16)
    prompt = list(range(300, 320))
    generated = tokens_of(await collect(backend, "a", prompt, greedy(30)))
    # KV exists for prompt + generated - 1 = 49 tokens: three full blocks.
    follow_up = await collect(backend, "b", prompt + generated, greedy(1))
    assert follow_up[-1].num_cached_tokens == 48


async def test_stored_events_form_a_hash_chain(make_backend):
    backend, events = await make_backend(block_size=4)
    prompt = list(range(500, 510))
    generated = tokens_of(await collect(backend, "a", prompt, greedy(20)))
    context = prompt + generated
    stored = events.events(BlockStored)
    assert len(stored) > 1  # prompt blocks at prefill, then blocks filled in decode
    assert stored[0].parent_block_hash is None
    parent = None
    hashes = []
    for event in stored:
        assert event.parent_block_hash == parent
        assert event.block_size == 4
        for i, h in enumerate(event.block_hashes):
            block = event.token_ids[4 * i : 4 * i + 4]
            assert h == extend_hash(ROOT_HASH if parent is None else parent, block)
            parent = h
            hashes.append(h)
    # Everything but the last sampled token has KV: (10 + 20 - 1) // 4 blocks.
    assert len(hashes) == 7
    assert [t for e in stored for t in e.token_ids] == context[:28]
    assert set(hashes) == backend.cached_block_hashes()


async def test_lru_eviction_emits_removed_for_least_recently_used(make_backend):
    backend, events = await make_backend(block_size=4, num_kv_blocks=8, context_length=32)
    a = list(range(10, 22))  # three blocks each
    b = list(range(30, 42))
    await collect(backend, "a", a, greedy(1))
    await collect(backend, "b", b, greedy(1))
    stored = {e.block_hashes[0]: e for e in events.events(BlockStored)}
    a_hashes, b_hashes = (e.block_hashes for e in stored.values())
    assert not events.events(BlockRemoved)
    # Touch a's blocks (a hit on all three): b's blocks are now the LRU ones.
    assert (await collect(backend, "a2", [*a, 1], greedy(1)))[-1].num_cached_tokens == 12
    # 16 tokens need 4 blocks; 2 are empty, so the 2 LRU cached ones go: b's tail first.
    await collect(backend, "c", list(range(50, 66)), greedy(1))
    removed = [h for e in events.events(BlockRemoved) for h in e.block_hashes]
    assert removed == [b_hashes[2], b_hashes[1]]
    assert set(a_hashes) <= backend.cached_block_hashes()


def test_freed_blocks_stay_cached_until_allocation_evicts_them():
    cache = PrefixCache(num_blocks=3, block_size=2)
    h1, h2 = extend_hash(ROOT_HASH, [1, 2]), extend_hash(extend_hash(ROOT_HASH, [1, 2]), [3, 4])
    blocks = cache.allocate(2)
    cache.commit(blocks, [h1, h2], None, [1, 2, 3, 4])
    assert cache.num_used == 2 and cache.cached_hashes() == {h1, h2}
    # A second request computing the same block keeps its copy private.
    dup = cache.allocate(1)
    cache.commit(dup, [h1], None, [1, 2])
    cache.free(dup)
    cache.free(blocks)
    assert cache.num_used == 0 and cache.num_free == 3
    assert cache.lookup([h1, h2, 99]) == blocks
    events = cache.take_events()
    assert events == [BlockStored((h1, h2), None, (1, 2, 3, 4), 2)]
    # All three needed: the empty one, then h2 (freed last-block-first), then h1.
    cache.allocate(3)
    assert cache.take_events() == [BlockRemoved((h2, h1))]
    assert cache.reset() is False  # blocks in use


async def test_the_prefix_cache_resets_only_when_no_request_holds_blocks(make_backend):
    backend, events = await make_backend(decode_step_ms=2.0, zero_delay=False)
    await collect(backend, "a", list(range(100)), greedy(2))
    assert backend.cached_block_hashes()
    # Refused while a request holds blocks.
    gen = backend.generate("b", list(range(100)), greedy(1000))
    await gen.__anext__()
    assert await backend.reset_prefix_cache() is False
    assert not events.events(AllBlocksCleared)
    await backend.abort("b")
    async for _ in gen:
        pass
    assert await backend.reset_prefix_cache() is True
    assert isinstance(events.batches[-1].events[-1], AllBlocksCleared)
    assert backend.cached_block_hashes() == frozenset() == events.replayed
    # The cache works again afterwards, from scratch.
    assert (await collect(backend, "c", list(range(100)), greedy(1)))[-1].num_cached_tokens == 0


async def test_random_workload_replay_matches_cache(make_backend):
    """Small cache, shared prefixes, aborts and preemption: events never drift.

    The recorder checks at every batch that the replayed set equals the cache.
    """
    backend, events = await make_backend(
        block_size=4, num_kv_blocks=24, context_length=64, max_num_seqs=4, max_num_batched_tokens=16
    )
    rng = random.Random(5)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randrange(4, 20))] for _ in range(4)]

    async def one(i: int) -> None:
        prompt = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(rng.randrange(1, 12))]
        spec = SamplingSpec(max_tokens=rng.randrange(1, 40), temperature=1.0, ignore_eos=True)
        gen = backend.generate(f"r{i}", prompt, spec)
        stop_after = rng.randrange(6)
        n = 0
        async for out in gen:
            n += 1
            if n == stop_after and not out.finished:
                if i % 2:
                    await backend.abort(f"r{i}")
                else:
                    await gen.aclose()
                    return
            if out.finished:
                assert out.finish_reason in (FinishReason.LENGTH, FinishReason.ABORTED)

    for round_ in range(4):
        await asyncio.gather(*(one(round_ * 10 + i) for i in range(10)))
        if round_ == 2:
            assert await backend.reset_prefix_cache()
    assert events.events(BlockRemoved), "the workload should have evicted blocks"
    assert events.events(AllBlocksCleared)
    assert backend.engine.scheduler.num_preemptions > 0
    assert events.replayed == backend.cached_block_hashes()
    assert backend.load().kv_blocks_used == 0
