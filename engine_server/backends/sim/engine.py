"""The simulated engine's step loop: one asyncio task that paces steps in time.

A step is planned (scheduler), "computed" by sleeping for what it would cost
on a GPU (decode_step_ms when any request decodes, plus prefill tokens at
prefill_tokens_per_s), then applied. Its KV events go to the sink as one
batch. With zero_delay the loop never sleeps but still yields to the event
loop between steps. When idle it waits on an event, never spinning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from engine_server.backends.base import (
    EngineDeadError,
    EngineRequestError,
    FinishReason,
    KvEventBatch,
    KvEventSink,
    SamplingSpec,
)
from engine_server.backends.sim.config import SimConfig
from engine_server.backends.sim.prefix_cache import PrefixCache
from engine_server.backends.sim.request import SimRequest
from engine_server.backends.sim.routed_experts import RoutedExpertsGenerator
from engine_server.backends.sim.sampler import Sampler
from engine_server.backends.sim.scheduler import Scheduler, StepPlan
from engine_server.backends.sim.tokenizer import SimTokenizer

logger = logging.getLogger(__name__)


class SimEngine:
    """Requests, the scheduler and the loop that drives it."""

    def __init__(self, config: SimConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.cache = PrefixCache(config.num_kv_blocks, config.block_size)
        self.sampler = Sampler(
            tokenizer.vocab_size, config.seed, tokenizer.eos_token_ids, config.eos_rate
        )
        self.scheduler = Scheduler(
            self.cache,
            self.sampler,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            on_finish=self._on_finish,
        )
        self.routed_experts = (
            RoutedExpertsGenerator(config.routed_experts, config.seed)
            if config.routed_experts
            else None
        )
        self.num_steps = 0
        self._requests: dict[str, SimRequest] = {}
        # KEEP-mode pause: no step runs; requests stay as they are.
        self.frozen = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._frozen_by: set[str] = set()
        self._sink: KvEventSink | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._dead: str | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self, sink: KvEventSink | None) -> None:
        if self._task is not None:
            raise RuntimeError("sim engine already started")
        self._sink = sink
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    async def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the sim engine was shut down"
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._finish_all(FinishReason.ABORTED, None)

    def _finish_all(self, reason: FinishReason, error: str | None) -> None:
        for req in list(self._requests.values()):
            self.scheduler.remove(req)
            req.finish(reason, error=error)
        self._requests.clear()
        self._idle.set()  # a WAIT pause (or anyone waiting for idle) ends too

    # -- requests ----------------------------------------------------------

    def submit(
        self, request_id: str, prompt_token_ids: Sequence[int], spec: SamplingSpec
    ) -> SimRequest:
        """Validate and queue a request (raises EngineRequestError / EngineDeadError)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._task is None:
            raise EngineDeadError("the sim engine is not started")
        if request_id in self._requests:
            raise EngineRequestError(f"request {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        self._validate(prompt, spec)
        tok = self.tokenizer
        req = SimRequest(
            request_id,
            prompt,
            spec,
            sampling=self.sampler.prepare(spec, request_id),
            context_length=self.config.context_length,
            block_size=self.config.block_size,
            eos_token_ids=tok.eos_token_ids,
            text_stream=tok.new_stream(prompt) if spec.stop_strings else None,
        )
        if spec.max_tokens == 0 or len(prompt) >= self.config.context_length:
            # Nothing to generate: finished before reaching the engine proper.
            req.num_cached_tokens = 0
            req.finish(FinishReason.LENGTH)
            return req
        self._requests[request_id] = req
        self._idle.clear()
        self.scheduler.add(req)
        self._wakeup.set()
        return req

    def _validate(self, prompt: list[int], spec: SamplingSpec) -> None:
        vocab, ctx = self.tokenizer.vocab_size, self.config.context_length

        def bad(message: str) -> EngineRequestError:
            return EngineRequestError(message)

        if not prompt:
            raise bad("prompt_token_ids is empty")
        if len(prompt) > ctx:
            raise bad(f"prompt has {len(prompt)} tokens, more than the context length {ctx}")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise bad(f"prompt token ids must be in [0, {vocab})")
        if spec.max_tokens < 0:
            raise bad(f"max_tokens must be >= 0, got {spec.max_tokens}")
        if spec.min_tokens < 0:
            raise bad(f"min_tokens must be >= 0, got {spec.min_tokens}")
        if spec.temperature < 0:
            raise bad(f"temperature must be >= 0, got {spec.temperature}")
        if not 0 < spec.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {spec.top_p}")
        if spec.top_k < -1:
            raise bad(f"top_k must be -1 (off), 0 (off) or >= 1, got {spec.top_k}")
        if not 0 <= spec.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {spec.min_p}")
        if spec.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {spec.repetition_penalty}")
        if spec.logprobs is not None and spec.logprobs < 0:
            raise bad(f"logprobs must be >= 0, got {spec.logprobs}")

    def abort(self, request_id: str) -> bool:
        """Abort with an ABORTED final output; False for unknown or finished ids."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if not self._requests:
            self._idle.set()
        self.scheduler.remove(req)
        req.finish(FinishReason.ABORTED)
        self._wakeup.set()
        return True

    def cancel(self, req: SimRequest) -> None:
        """Drop a request whose consumer went away (no output is delivered)."""
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]
            if not self._requests:
                self._idle.set()
            self.scheduler.remove(req)
            req.finish(FinishReason.ABORTED)
            self._wakeup.set()

    def _on_finish(self, req: SimRequest) -> None:
        self._requests.pop(req.request_id, None)
        if not self._requests:
            self._idle.set()
        if self.routed_experts is not None and req.spec.return_routed_experts:
            req.routed_experts = self.routed_experts.build(req.tokens, len(req.tokens) - 1)

    def reset_prefix_cache(self, *, running: bool = False) -> bool:
        self._flush_events()  # evictions of a step in flight go out before the clear
        done = self.cache.reset(running=running)
        self._flush_events()
        return done

    def abort_all(self) -> int:
        """End every request with finish reason ABORTED (a Pause(ABORT))."""
        count = len(self._requests)
        self._finish_all(FinishReason.ABORTED, None)
        self._idle.set()
        self._wakeup.set()
        return count

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def freeze(self, frozen: bool, why: str = "pause") -> None:
        """Stop stepping (KEEP-mode requests stay where they are) while any reason
        holds: a pause and a sleep freeze and thaw independently."""
        if frozen:
            self._frozen_by.add(why)
        else:
            self._frozen_by.discard(why)
        self.frozen = bool(self._frozen_by)
        self._wakeup.set()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the loop ----------------------------------------------------------

    def _flush_events(self) -> None:
        events = self.cache.take_events()
        if events and self._sink is not None:
            batch = KvEventBatch(events=tuple(events), timestamp_unix_nanos=time.time_ns())
            try:
                self._sink(batch)
            except Exception:
                logger.exception("sim engine: the KV event sink failed")

    def _step_seconds(self, plan: StepPlan) -> float:
        cfg = self.config
        seconds = plan.num_prefill_tokens / cfg.prefill_tokens_per_s
        if plan.num_decode_tokens:
            seconds += cfg.decode_step_ms / 1000.0
        return seconds

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        zero_delay = self.config.zero_delay
        # End of the previous step on the simulated GPU's clock. The loop's own
        # work between steps (sampling, delivery) is absorbed into the next
        # step's sleep, so Python overhead does not slow the simulated engine
        # down as long as it is cheaper than a step, and lag never accumulates.
        gpu_clock = loop.time()
        try:
            while True:
                if self.frozen or not scheduler.has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    gpu_clock = loop.time()
                    continue
                plan = scheduler.schedule()
                if not plan.items:
                    # Nothing can run until something changes (cannot happen with
                    # a valid config, where an idle cache fits any request).
                    self._flush_events()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    gpu_clock = loop.time()
                    continue
                if zero_delay:
                    await asyncio.sleep(0)
                else:
                    cost = self._step_seconds(plan)
                    now = loop.time()
                    gpu_clock = max(gpu_clock, now - cost) + cost
                    await asyncio.sleep(gpu_clock - now)
                scheduler.complete(plan)
                self.num_steps += 1
                self._flush_events()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("sim engine: the step loop failed")
            self._dead = f"the sim engine failed: {e!r}"
            self._finish_all(FinishReason.ERROR, self._dead)
