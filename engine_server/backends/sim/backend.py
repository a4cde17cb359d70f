"""SimBackend: the simulated engine behind the EngineBackend seam.

Used by tests, demos and benchmarks in place of a GPU engine. Everything the
contract can observe behaves like a real engine: deterministic tokens and
logprobs, stop rules, a paged prefix cache with KV events, queueing, timing,
aborts and routed experts.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncGenerator, Sequence
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

if TYPE_CHECKING:
    from engine_server.generation_config import GenerationConfig


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
        self.engine = SimEngine(config, self.tokenizer)
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
        self.engine.start(kv_event_sink)
        return self.info

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], spec: SamplingSpec
    ) -> AsyncGenerator[EngineOutput, None]:
        if spec.bad_words:
            raise EngineRequestError("bad_words: the sim backend does not support them")
        req = self.engine.submit(request_id, prompt_token_ids, spec)
        try:
            while True:
                while not req.has_output():
                    req.wakeup.clear()
                    await req.wakeup.wait()
                out = req.drain()
                if out.finish_reason is FinishReason.ERROR and self.engine.dead_reason:
                    raise EngineDeadError(self.engine.dead_reason)
                yield out
                if out.finished:
                    return
        finally:
            if not req.final_sent:
                # The consumer left early (aclose, cancellation): free the engine.
                self.engine.cancel(req)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Drop all cached blocks; False (nothing done) while any block is in use."""
        if self.engine.dead_reason is not None:
            raise EngineDeadError(self.engine.dead_reason)
        return self.engine.reset_prefix_cache()

    def load(self) -> EngineLoad:
        cache = self.engine.cache
        return EngineLoad(
            running=self.engine.num_running,
            waiting=self.engine.num_waiting,
            kv_blocks_used=cache.num_used,
            kv_blocks_total=cache.num_blocks,
        )

    async def check_health(self) -> None:
        if self.engine.dead_reason is not None:
            raise EngineDeadError(self.engine.dead_reason)

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    # -- inspection (tests, demos) -----------------------------------------

    def cached_block_hashes(self) -> frozenset[int]:
        """Hashes of the blocks the prefix cache holds now."""
        return self.engine.cache.cached_hashes()
