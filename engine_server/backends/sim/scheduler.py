"""What runs in each engine step: vLLM v1's scheduling policy, in miniature.

Each step has a token budget (max_num_batched_tokens). Running requests come
first, in admission order: one token each in decode, a chunk of the rest in
prefill. Blocks are allocated on demand; when none is left the newest running
request is preempted (its blocks freed, recomputed later, as vLLM's recompute
preemption). Then waiting requests are admitted first come first served while
budget, max_num_seqs and free blocks allow, each reusing its longest cached
prefix. After the step's compute the scheduler caches newly full blocks,
samples a token for every request whose context is fully computed and
finishes those that stop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from engine_server.backends.sim.prefix_cache import PrefixCache
from engine_server.backends.sim.request import RequestStatus, SimRequest
from engine_server.backends.sim.sampler import Sampler


@dataclass
class StepPlan:
    """The requests computed in one step and how many tokens each."""

    items: list[tuple[SimRequest, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


@dataclass(eq=False)
class Scheduler:
    """The step's policy over the engine's queues; ``on_finish`` hears of each
    request that stops."""

    cache: PrefixCache
    sampler: Sampler
    _: KW_ONLY
    max_num_seqs: int
    max_num_batched_tokens: int
    on_finish: Callable[[SimRequest], None]
    waiting: deque[SimRequest] = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)
    num_preemptions: int = 0
    # The label of the weights the next tokens are sampled with.
    weight_version: str = "default"

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)

    def remove(self, req: SimRequest) -> None:
        """Take a request out (abort, cancel); its blocks go back to the cache."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._release(req)

    def _release(self, req: SimRequest) -> None:
        self.cache.free(req.blocks)
        req.blocks = []
        req.num_committed_blocks = 0

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cache.block_size)

    def _preempt(self, req: SimRequest) -> None:
        self._release(req)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> StepPlan:
        """Pick this step's work and allocate its blocks (evictions happen here)."""
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            is_decode = req.num_computed == len(req.tokens) - 1 and req.num_output_tokens > 0
            n = min(len(req.tokens) - req.num_computed, budget)
            need = self._blocks_for(req.num_computed + n) - len(req.blocks)
            while need > self.cache.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            if need > 0:
                req.blocks.extend(self.cache.allocate(need))
            plan.items.append((req, n))
            if is_decode:
                plan.num_decode_tokens += n
            else:
                plan.num_prefill_tokens += n
            budget -= n
            i += 1
        # As vLLM: no admissions in a step that had to preempt.
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            req = self.waiting[0]
            bs = self.cache.block_size
            # At least one token must be computed, so the last one never hits.
            hits = self.cache.lookup(req.block_hashes[: (len(req.tokens) - 1) // bs])
            num_hit = len(hits) * bs
            n = min(len(req.tokens) - num_hit, budget)
            need = self._blocks_for(num_hit + n) - len(hits)
            if need > self.cache.num_free - sum(1 for b in hits if b.ref_count == 0):
                break  # first come first served: the head waits for blocks
            self.waiting.popleft()
            self.cache.pin(hits)
            req.blocks = hits + self.cache.allocate(need)
            req.num_committed_blocks = len(hits)
            req.num_computed = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.items.append((req, n))
            plan.num_prefill_tokens += n
            budget -= n
        return plan

    def complete(self, plan: StepPlan) -> None:
        """Apply a computed step: cache full blocks, sample, finish."""
        cache, sampler, bs = self.cache, self.sampler, self.cache.block_size
        for req, n in plan.items:
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed += n
            full = req.num_computed // bs
            start = req.num_committed_blocks
            if full > start:
                cache.commit(
                    req.blocks[start:full],
                    req.block_hashes[start:full],
                    req.block_hashes[start - 1] if start else None,
                    req.tokens[start * bs : full * bs],
                    req.spec.cache_salt or "",
                )
                req.num_committed_blocks = full
            if req.num_computed < len(req.tokens):
                continue  # prefill still in progress
            rs = req.sampling
            token, logprob, top = sampler.choose(
                req.ctx_hash,
                len(req.tokens),
                rs,
                req.output_counts,
                req.context_set if rs.repetition_penalty != 1.0 else None,
                req.banned_now,
            )
            req.append_token(token, logprob, top, self.weight_version)
            if req.finished:
                self.running.remove(req)
                self._release(req)
                self.on_finish(req)
