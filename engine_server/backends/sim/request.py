"""One request inside the sim: its context, KV bookkeeping, stop rules and the
buffer of output not yet handed to its consumer."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence

from engine_server.backends.base import (
    EngineOutput,
    FinishReason,
    RoutedExpertsArray,
    SamplingSpec,
)
from engine_server.backends.sim.hashing import ROOT_HASH, mix64, str_key
from engine_server.backends.sim.prefix_cache import KvBlock
from engine_server.backends.sim.sampler import RequestSampling
from engine_server.backends.sim.tokenizer import TextStream


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SimRequest:
    """A request's whole life in the sim, from queue to final output.

    ``tokens`` is the context (prompt, then generated tokens); ``num_computed``
    counts the leading tokens whose KV exists. Like vLLM, the newest sampled
    token is computed only in the next step, so a running request in decode
    has ``num_computed == len(tokens) - 1``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        spec: SamplingSpec,
        *,
        sampling: RequestSampling,
        context_length: int,
        block_size: int,
        eos_token_ids: Sequence[int],
        text_stream: TextStream | None,
    ) -> None:
        self.request_id = request_id
        self.spec = spec
        self.sampling = sampling
        self.tokens: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.tokens)
        self.context_length = context_length
        self.max_tokens = spec.max_tokens
        self.block_size = block_size

        # Rolling hash of the context, and its values at every full block
        # boundary: those are the block hashes (each a function of the parent
        # block's hash and the block's tokens), mixed with the cache salt when
        # there is one (a namespace of its own; sampling reads ctx_hash, unsalted).
        self._salt_key = str_key(spec.cache_salt) if spec.cache_salt else None
        self.block_hashes: list[int] = []
        h = ROOT_HASH
        for i, t in enumerate(self.tokens, 1):
            h = mix64(h ^ t)
            if i % block_size == 0:
                self.block_hashes.append(self._block_hash(h))
        self.ctx_hash = h

        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.blocks: list[KvBlock] = []
        self.num_committed_blocks = 0  # leading blocks already in the prefix cache
        self.num_cached_tokens = -1  # prefix-cache hit at first admission
        self.num_preemptions = 0

        self._eos = frozenset(() if spec.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(spec.stop_token_ids)
        self.min_tokens_banned = self._eos | self._stop_ids if spec.min_tokens else frozenset()
        self._stream = text_stream if spec.stop_strings else None
        self._text = ""
        self.output_counts: dict[int, int] | None = {} if sampling.has_penalties else None
        self._context_set: set[int] | None = None

        self._new_ids: list[int] = []
        self._new_logprobs: list[float] = []
        self._new_top: list[list[tuple[int, float]]] = []
        self.finished = False
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.routed_experts: RoutedExpertsArray | None = None
        # [version, start, end] over output tokens: which weights made which.
        self.weight_spans: list[list[str | int]] = []
        self._final_sent = False
        self.wakeup = asyncio.Event()

    def _block_hash(self, ctx_hash: int) -> int:
        return ctx_hash if self._salt_key is None else mix64(ctx_hash ^ self._salt_key)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def banned_now(self) -> frozenset[int]:
        """Stop tokens are masked until min_tokens are out (vLLM's min-tokens processor)."""
        if self.min_tokens_banned and self.num_output_tokens < self.spec.min_tokens:
            return self.min_tokens_banned
        return frozenset()

    @property
    def context_set(self) -> set[int]:
        """Prompt and generated ids, for the repetition penalty (built on demand)."""
        if self._context_set is None:
            self._context_set = set(self.tokens)
        return self._context_set

    def append_token(
        self,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        version: str = "default",
    ) -> None:
        """Add a sampled token (made by weights ``version``) and finish the request
        if it stops here."""
        spans = self.weight_spans
        n = self.num_output_tokens
        if spans and spans[-1][0] == version:
            spans[-1][2] = n + 1
        else:
            spans.append([version, n, n + 1])
        self.tokens.append(token)
        h = mix64(self.ctx_hash ^ token)
        self.ctx_hash = h
        if len(self.tokens) % self.block_size == 0:
            self.block_hashes.append(self._block_hash(h))
        if self.output_counts is not None:
            self.output_counts[token] = self.output_counts.get(token, 0) + 1
            if self._context_set is not None:
                self._context_set.add(token)
        self._new_ids.append(token)
        if logprob is not None:
            self._new_logprobs.append(logprob)
        if top is not None:
            self._new_top.append(top)
        stop = self._check_stop(token)
        if stop is not None:
            self.finish(*stop)
        else:
            self.wakeup.set()

    def _check_stop(self, token: int) -> tuple[FinishReason, int | str | None] | None:
        # vLLM's order: EOS, stop tokens, lengths; a stop string found by the
        # detokenizer then overrides a length finish.
        result: tuple[FinishReason, int | str | None] | None = None
        if token in self._eos or token in self._stop_ids:
            return FinishReason.STOP, token
        n = self.num_output_tokens
        if n >= self.max_tokens or len(self.tokens) >= self.context_length:
            result = (FinishReason.LENGTH, None)
        if self._stream is not None:
            before = len(self._text)
            self._text += self._stream.step(token)
            if n > self.spec.min_tokens and len(self._text) > before:
                text = self._text
                for s in self.spec.stop_strings:
                    if text.find(s, max(0, before - len(s) + 1)) >= 0:
                        return FinishReason.STOP, s
        return result

    def finish(
        self,
        reason: FinishReason,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> None:
        """Mark finished; the consumer gets the last output on its next drain."""
        if self.finished:
            return
        self.finished = True
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.wakeup.set()

    def has_output(self) -> bool:
        return bool(self._new_ids) or (self.finished and not self._final_sent)

    @property
    def final_sent(self) -> bool:
        return self._final_sent

    def drain(self) -> EngineOutput:
        """Everything produced since the last drain, as one delta."""
        want = self.sampling.logprobs
        out = EngineOutput(
            token_ids=self._new_ids,
            logprobs=self._new_logprobs if want is not None else None,
            top_logprobs=self._new_top if want else None,
        )
        self._new_ids, self._new_logprobs, self._new_top = [], [], []
        if self.finished and not self._final_sent:
            self._final_sent = True
            out.finished = True
            out.finish_reason = self.finish_reason
            out.stop_reason = self.stop_reason
            out.error = self.error
            out.num_prompt_tokens = self.num_prompt_tokens
            out.num_cached_tokens = max(0, self.num_cached_tokens)
            out.routed_experts = self.routed_experts
            out.weight_versions = [(str(v), int(a), int(b)) for v, a, b in self.weight_spans]
        return out
