"""SimBackend: the simulated engine behind the EngineBackend seam.

Used by tests, demos and benchmarks in place of a GPU engine. Everything the
contract can observe behaves like a real engine: deterministic tokens and
logprobs, stop rules, a paged prefix cache with KV events, queueing, timing,
aborts and routed experts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Collection, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_server.backends.base import (
    EngineBackend,
    EngineDeadError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequestError,
    FinishReason,
    KvEventSink,
    SamplingSpec,
)
from engine_server.backends.refit import (
    PauseMode,
    RlCapabilities,
    TensorSpec,
    WeightLoad,
    WeightWriter,
)
from engine_server.backends.sim.config import (
    DEFAULT_EOS_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    SimConfig,
)
from engine_server.backends.sim.engine import SimEngine
from engine_server.backends.sim.tokenizer import (
    BuiltinTokenizer,
    HfTokenizer,
    SimTokenizer,
    read_model_dir,
)
from engine_server.backends.sim.weights import SimWeights

if TYPE_CHECKING:
    from engine_server.generation_config import GenerationConfig


def _ranked(sink: KvEventSink | None, rank: int) -> KvEventSink | None:
    """The sink, with every batch marked as this rank's."""
    if sink is None or rank == 0:
        return sink
    return lambda batch: sink(dataclasses.replace(batch, data_parallel_rank=rank))


def _package_version() -> str:
    try:
        return metadata.version("dynamo-rl-engine")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def _build_tokenizer(config: SimConfig) -> SimTokenizer:
    if config.model is None:
        vocab = config.vocab_size or DEFAULT_VOCAB_SIZE
        eos = config.eos_token_ids if config.eos_token_ids is not None else (DEFAULT_EOS_TOKEN_ID,)
        tokenizer: SimTokenizer = BuiltinTokenizer(vocab, eos)
    else:
        model = read_model_dir(config.model)
        vocab = config.vocab_size or model.vocab_size
        eos = config.eos_token_ids if config.eos_token_ids is not None else model.eos_token_ids
        tokenizer = HfTokenizer(model.path / "tokenizer.json", vocab, eos)
    bad = [t for t in tokenizer.eos_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"sim backend: eos token ids {bad} outside the vocabulary [0, {vocab})")
    return tokenizer


class SimBackend(EngineBackend):
    """A simulated inference engine: ``SimBackend(SimConfig(...))`` or ``SimBackend(**fields)``."""

    def __init__(self, config: SimConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = SimConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a SimConfig or keyword fields, not both")
        self.config = config
        self.tokenizer = _build_tokenizer(config)
        # One engine per data-parallel rank: own scheduler, own prefix cache.
        self.engines = [SimEngine(config, self.tokenizer) for _ in range(config.dp_size)]
        self.weights = SimWeights.initial(config.model, config.seed)
        self._apply_weights()
        if config.served_model_name:
            name = config.served_model_name
        elif config.model:
            name = Path(config.model).resolve().name
        else:
            name = "sim-model"
        self.info = EngineInfo(
            model_name=name,
            model_path=config.model or "",
            context_length=config.context_length,
            kv_block_size=config.block_size,
            total_kv_blocks=config.num_kv_blocks,
            max_running_sequences=config.max_num_seqs,
            max_batched_tokens=config.max_num_batched_tokens,
            eos_token_ids=self.tokenizer.eos_token_ids,
            vocab_size=self.tokenizer.vocab_size,
            backend_name="sim",
            backend_version=_package_version(),
            data_parallel_size=config.dp_size,
            reports_routed_experts=config.routed_experts is not None,
        )
        self._started = False

    # -- CLI ---------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        SimConfig.add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> SimBackend:
        return cls(SimConfig.from_cli_args(args))

    @classmethod
    def apply_generation_config(
        cls, config: GenerationConfig, args: argparse.Namespace
    ) -> list[str]:
        """``vllm_cfg.max_model_len`` is the sim's context length; nothing else applies."""
        notes = []
        for key, value in config.engine.items():
            if key == "max_model_len":
                if args.context_length is None:
                    args.context_length = value
                else:
                    notes.append(f"vllm_cfg.max_model_len: --context-length wins ({value} ignored)")
            else:
                notes.append(f"vllm_cfg.{key}: the sim backend has no such setting")
        notes += [
            f"vllm_kwargs.{k}: the sim backend has no such setting" for k in config.engine_kwargs
        ]
        return notes

    # -- EngineBackend -----------------------------------------------------

    async def start(self, kv_event_sink: KvEventSink | None) -> EngineInfo:
        if self._started:
            raise RuntimeError("SimBackend.start() called twice")
        self._started = True
        if self.config.startup_delay_s:
            await asyncio.sleep(self.config.startup_delay_s)
        if self.engine.dead_reason is not None:  # shut down while starting
            raise EngineDeadError(self.engine.dead_reason)
        for rank, engine in enumerate(self.engines):
            engine.start(_ranked(kv_event_sink, rank))
        return self.info

    @property
    def engine(self) -> SimEngine:
        """Rank 0's engine (the only one unless dp_size > 1)."""
        return self.engines[0]

    def _pick(self, spec: SamplingSpec) -> SimEngine:
        """The rank asked for, else the least loaded (the lowest of equals), as
        vLLM's internal data-parallel balancing does."""
        if spec.data_parallel_rank is not None:
            return self.engines[spec.data_parallel_rank]
        return min(self.engines, key=lambda e: e.num_running + e.num_waiting)

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], spec: SamplingSpec
    ) -> AsyncGenerator[EngineOutput, None]:
        if spec.bad_words:
            raise EngineRequestError("bad_words: the sim backend does not support them")
        engine = self._pick(spec)
        req = engine.submit(request_id, prompt_token_ids, spec)
        try:
            while True:
                while not req.has_output():
                    req.wakeup.clear()
                    await req.wakeup.wait()
                out = req.drain()
                if out.finish_reason is FinishReason.ERROR and engine.dead_reason:
                    raise EngineDeadError(engine.dead_reason)
                yield out
                if out.finished:
                    return
        finally:
            if not req.final_sent:
                # The consumer left early (aclose, cancellation): free the engine.
                engine.cancel(req)

    async def abort(self, request_id: str) -> None:
        for engine in self.engines:
            engine.abort(request_id)

    async def reset_prefix_cache(self, *, running: bool = False) -> bool:
        """Drop all cached blocks; False (nothing done) while any block is in use,
        unless ``running``. AllBlocksCleared reaches the sink before this returns."""
        await self.check_health()
        done = [engine.reset_prefix_cache(running=running) for engine in self.engines]
        return all(done)

    # -- the refit cycle: the sim does all of it (see weights.py) ------------

    def rl_capabilities(self) -> RlCapabilities:
        return RlCapabilities(
            pause=True, update_from_path=True, update_from_tensors=True, sleep=True
        )

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self._stop(mode, clear_cache, "pause")

    async def _stop(self, mode: PauseMode, clear_cache: bool, why: str) -> None:
        """A pause's (or a sleep's) effect on every rank. ``why`` names the freeze, so
        that a pause and a sleep hold and release the engines independently."""
        for engine in self.engines:
            if mode is PauseMode.KEEP:
                engine.freeze(True, why)
            else:  # ABORT, or WAIT (also after KEEP): what is frozen by this runs on
                engine.freeze(False, why)
                if mode is PauseMode.ABORT:
                    engine.abort_all()
        if mode is PauseMode.WAIT:  # new requests wait in the core meanwhile
            # (an engine still frozen for the other reason cannot finish anything)
            await asyncio.gather(*(e.wait_idle() for e in self.engines if not e.frozen))
        if clear_cache:
            for engine in self.engines:
                engine.reset_prefix_cache(running=True)

    async def resume(self) -> None:
        for engine in self.engines:
            engine.freeze(False)

    def _apply_weights(self) -> None:
        for engine in self.engines:
            engine.sampler.set_weights(self.weights.key)

    async def load_weights_from_path(self, path: str, *, allow_partial: bool) -> WeightLoad:
        # Off the loop: reading a large checkpoint must not stall health and GetLoad.
        load = await asyncio.to_thread(self.weights.load_dir, path, allow_partial=allow_partial)
        self._apply_weights()
        return load

    async def begin_tensor_update(
        self, tensors: Sequence[TensorSpec], *, allow_partial: bool
    ) -> WeightWriter:
        return self.weights.writer(tensors, allow_partial=allow_partial, then=self._apply_weights)

    async def weight_names(self) -> Collection[str] | None:
        return self.weights.specs.keys()

    async def weight_version(self) -> str:
        return self.engine.scheduler.weight_version

    async def set_weight_version(self, version: str) -> None:
        for engine in self.engines:
            engine.scheduler.weight_version = version

    async def sleep(self, level: int, mode: PauseMode) -> None:
        await self._stop(mode, level >= 1, "sleep")
        for engine in self.engines:
            engine.freeze(True, "sleep")

    async def wake_up(self, tags: Sequence[str]) -> bool:
        for engine in self.engines:
            engine.freeze(False, "sleep")
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=sum(e.num_running for e in self.engines),
            waiting=sum(e.num_waiting for e in self.engines),
            kv_blocks_used=sum(e.cache.num_used for e in self.engines),
            kv_blocks_total=sum(e.cache.num_blocks for e in self.engines),
        )

    async def check_health(self) -> None:
        for engine in self.engines:
            if engine.dead_reason is not None:
                raise EngineDeadError(engine.dead_reason)

    async def shutdown(self) -> None:
        await asyncio.gather(*(engine.shutdown() for engine in self.engines))

    # -- inspection (tests, demos) -----------------------------------------

    def cached_block_hashes(self, rank: int | None = None) -> frozenset[int]:
        """Hashes of the blocks the prefix cache holds now (of one rank, or all)."""
        engines = self.engines if rank is None else [self.engines[rank]]
        return frozenset().union(*(e.cache.cached_hashes() for e in engines))
