"""ToyBackend: the smallest complete backend, as an example for writing your own.

A made-up language model (the next token's logits are a hash of the context)
behind everything the contract asks of an engine: deltas, stop tokens,
min/max tokens, sampling with seeds, logprobs of the distribution drawn from
and top logprobs, aborts, a prefix cache that reports KV events, load and
health. ``python -m engine_server --backend toy`` serves it (registered as an
entry point, as a third-party backend would be); the conformance suite runs
against it. What it cannot do (stop strings need text; penalties, min_p) it
refuses, as an engine should. See README, "Writing a backend".
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import random
import time
from collections.abc import AsyncGenerator, Sequence

from engine_server.backends.base import (
    AllBlocksCleared,
    BlockStored,
    EngineBackend,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequestError,
    FinishReason,
    KvEventBatch,
    KvEventSink,
    SamplingSpec,
)

VOCAB, EOS, BLOCK, CONTEXT = 128, 1, 4, 512


def model(context: Sequence[int]) -> list[float]:
    """The toy model's next-token logprobs: a log-softmax of logits hashed from the context."""
    digest = hashlib.shake_128(repr(list(context[-6:])).encode()).digest(VOCAB)
    logits = [b / 32.0 for b in digest]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def processed(logprobs: list[float], spec: SamplingSpec) -> dict[int, float]:
    """The distribution a token is drawn from: temperature, top-k, top-p (vLLM's order)."""
    ranked = sorted(range(VOCAB), key=lambda t: -logprobs[t])
    if spec.temperature == 0 or spec.top_k == 1:  # greedy: the model's own logprob
        return {ranked[0]: logprobs[ranked[0]]}
    keep = ranked[: spec.top_k] if spec.top_k > 0 else ranked
    weights = [math.exp(logprobs[t] / spec.temperature) for t in keep]
    total, mass, cut = sum(weights), 0.0, len(keep)
    for i, w in enumerate(weights):
        mass += w / total
        if mass >= spec.top_p:
            cut = i + 1
            break
    kept = sum(weights[:cut])
    return {t: math.log(w / kept) for t, w in zip(keep[:cut], weights[:cut], strict=True)}


class ToyBackend(EngineBackend):
    def __init__(self) -> None:
        self._sink: KvEventSink | None = None
        self._cached: set[int] = set()  # block hashes
        self._live: dict[str, bool] = {}  # request id -> abort asked

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ToyBackend:
        return cls()

    async def start(self, kv_event_sink: KvEventSink | None) -> EngineInfo:
        self._sink = kv_event_sink
        return EngineInfo("toy", "", CONTEXT, BLOCK, 4096, 64, 2048, (EOS,), VOCAB, "toy", "1")

    def _cache(self, tokens: Sequence[int], salt: str | None) -> int:
        """Cache the full blocks of ``tokens`` under ``salt`` (KV events for new ones);
        return the length of the prefix that was cached already."""
        stored, parent, hit = [], None, 0
        for i in range(len(tokens) // BLOCK):
            block = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
            chain = (parent if i else salt, block)  # the salt keys the first block
            key = int.from_bytes(hashlib.blake2b(repr(chain).encode()).digest()[:8])
            if key in self._cached:
                hit += BLOCK if hit == i * BLOCK else 0
            else:
                self._cached.add(key)
                stored.append(BlockStored((key,), parent, block, BLOCK, "", salt or ""))
            parent = key
        if stored and self._sink is not None:
            self._sink(KvEventBatch(tuple(stored), time.time_ns()))
        return hit

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], spec: SamplingSpec
    ) -> AsyncGenerator[EngineOutput, None]:
        if spec.stop_strings or spec.bad_words:
            raise EngineRequestError("stop strings and bad words need text; the toy has none")
        if spec.min_p or spec.presence_penalty or spec.frequency_penalty:
            raise EngineRequestError("the toy backend has no min_p and no penalties")
        if spec.repetition_penalty != 1.0:
            raise EngineRequestError("the toy backend has no repetition penalty")
        rng = random.Random(spec.seed if spec.seed is not None else request_id)
        stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else {EOS})
        context, generated = list(prompt_token_ids), 0
        cached = self._cache(context, spec.cache_salt)
        self._live[request_id] = False
        try:
            while True:
                await asyncio.sleep(0.002)  # a decode step: lets aborts and others in
                done = None
                if self._live[request_id]:
                    done = FinishReason.ABORTED
                elif generated >= spec.max_tokens or len(context) >= CONTEXT:
                    done = FinishReason.LENGTH
                if done is not None:
                    self._cache(context, spec.cache_salt)
                    empty: list[float] | None = None if spec.logprobs is None else []
                    yield EngineOutput([], empty, None, True, done, None, 0, cached)
                    return
                full = model(context)
                if generated < spec.min_tokens:  # stop tokens cannot be drawn yet
                    full = [-math.inf if t in stops else lp for t, lp in enumerate(full)]
                dist = processed(full, spec)
                token = rng.choices(list(dist), [math.exp(lp) for lp in dist.values()])[0]
                context.append(token)
                generated += 1
                out = EngineOutput([token], None if spec.logprobs is None else [dist[token]])
                if spec.logprobs:
                    ranked = sorted(range(VOCAB), key=lambda t: -full[t])[: spec.logprobs]
                    out.top_logprobs = [[(t, full[t]) for t in ranked]]
                if token in stops and generated >= spec.min_tokens:
                    self._cache(context, spec.cache_salt)
                    out.finished, out.finish_reason, out.stop_reason = (
                        True,
                        FinishReason.STOP,
                        token,
                    )
                    out.num_cached_tokens = cached
                yield out
                if out.finished:
                    return
        finally:
            del self._live[request_id]

    async def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._live[request_id] = True

    async def reset_prefix_cache(self, *, running: bool = False) -> bool:
        self._cached.clear()
        if self._sink is not None:
            self._sink(KvEventBatch((AllBlocksCleared(),), time.time_ns()))
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._live), waiting=0, kv_blocks_used=len(self._cached))

    async def check_health(self) -> None:
        pass  # nothing can die in here

    async def shutdown(self) -> None:
        for request_id in self._live:
            self._live[request_id] = True
