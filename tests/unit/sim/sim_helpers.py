"""Helpers shared by the sim backend's tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_server.backends.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineOutput,
    KvEventBatch,
    SamplingSpec,
)
from engine_server.backends.sim import SimBackend


class EventRecorder:
    """A KV-event sink that replays events and checks them against the cache.

    At every batch, the replayed set must equal the blocks the cache holds,
    stored hashes must be new and removed hashes known.
    """

    def __init__(self) -> None:
        self.batches: list[KvEventBatch] = []
        self.replayed: set[int] = set()
        self.backend: SimBackend | None = None

    def __call__(self, batch: KvEventBatch) -> None:
        assert batch.events, "empty batches must not be emitted"
        assert batch.timestamp_unix_nanos > 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                for h in event.block_hashes:
                    assert 0 <= h < 2**64
                    assert h not in self.replayed, "stored twice while cached"
                    self.replayed.add(h)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert h in self.replayed, "removed a hash that was not stored"
                    self.replayed.remove(h)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.replayed.clear()
        self.batches.append(batch)
        if self.backend is not None:
            assert self.replayed == self.backend.cached_block_hashes()

    def events(self, kind: type | None = None) -> list[Any]:
        out = [e for b in self.batches for e in b.events]
        return [e for e in out if kind is None or isinstance(e, kind)]


async def collect(
    backend: SimBackend, request_id: str, prompt: Sequence[int], spec: SamplingSpec
) -> list[EngineOutput]:
    return [out async for out in backend.generate(request_id, prompt, spec)]


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def logprobs_of(outputs: list[EngineOutput]) -> list[float]:
    return [lp for out in outputs for lp in (out.logprobs or [])]
