"""vLLM RequestOutput deltas -> EngineOutput deltas.

Logprobs: vLLM returns, per generated position, a dict holding the sampled
token first and then the top k (``logprobs=k``); when the sampled token is one
of the top k the dict has k entries, else k + 1. So:

- ``logprobs[i]`` is always the sampled token's entry (NeMo RL's rule), never
  the top-1;
- ``top_logprobs[i]`` is exactly vLLM's top k, most likely first: the sampled
  token is among them only when it ranks in the top k (ties included, as vLLM
  decided). Told apart by the dict's size, not by ranks, because a sampled
  token tied with the k-th keeps its own rank <= k without being in the list.

Stop reason: vLLM reports None when the request ended on the model's primary
EOS (it is checked apart from ``stop_token_ids``); the contract wants the token
that stopped it, so that case reports the last generated token.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
from vllm.outputs import RequestOutput

from engine_server.backends.base import (
    EngineOutput,
    FinishReason,
    RoutedExpertsArray,
    SamplingSpec,
)
from engine_server.vllm_compat import output_weight_versions

log = logging.getLogger(__name__)

FINISH_REASONS: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORTED,
    "error": FinishReason.ERROR,
    # Repetition detection (off unless asked for) ends like a stop condition;
    # vLLM's stop_reason says "repetition_detected".
    "repetition": FinishReason.STOP,
}


def routed_experts_array(arr: np.ndarray) -> RoutedExpertsArray:
    """Raw little-endian bytes of ``arr`` with its dtype name and shape."""
    arr = np.ascontiguousarray(arr)
    little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return RoutedExpertsArray(
        data=little.tobytes(), dtype=arr.dtype.name, shape=tuple(int(d) for d in arr.shape)
    )


class OutputConverter:
    """Turns one request's vLLM DELTA outputs into EngineOutputs."""

    def __init__(self, spec: SamplingSpec, num_prompt_tokens: int) -> None:
        self._logprobs = spec.logprobs
        self._routed = spec.return_routed_experts
        self._num_prompt_tokens = num_prompt_tokens
        self._last_token: int | None = None
        self.finished = False

    def convert(self, out: RequestOutput) -> EngineOutput:
        comp = out.outputs[0]
        token_ids = list(comp.token_ids)
        if token_ids:
            self._last_token = token_ids[-1]
        result = EngineOutput(token_ids=token_ids)
        if self._logprobs is not None:
            result.logprobs, top = _logprobs(comp.logprobs, token_ids, self._logprobs)
            if self._logprobs > 0:
                result.top_logprobs = top
        if not out.finished:
            return result
        self.finished = True
        result.finished = True
        reason = comp.finish_reason or "abort"
        result.finish_reason = FINISH_REASONS.get(reason, FinishReason.ERROR)
        if result.finish_reason is FinishReason.ERROR:
            result.error = f"vLLM finished the request with reason {reason!r}"
        if result.finish_reason is FinishReason.STOP:
            stop = comp.stop_reason
            result.stop_reason = self._last_token if stop is None else stop
        result.num_prompt_tokens = len(out.prompt_token_ids or ()) or self._num_prompt_tokens
        result.num_cached_tokens = int(out.num_cached_tokens or 0)
        if self._routed and comp.routed_experts is not None:
            result.routed_experts = routed_experts_array(comp.routed_experts)
        # vLLM's own spans, over the whole output (final output only; 0.23 has none).
        result.weight_versions = output_weight_versions(comp)
        return result


def _logprobs(
    entries: Any, token_ids: list[int], k: int
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The sampled tokens' logprobs and, for k > 0, the top k per position."""
    sampled: list[float] = []
    top: list[list[tuple[int, float]]] | None = [] if k > 0 else None
    if entries is None or len(entries) != len(token_ids):
        # vLLM always aligns them; a mismatch is a bug worth seeing, not hiding.
        log.error(
            "vLLM returned %s logprob entries for %d tokens",
            None if entries is None else len(entries),
            len(token_ids),
        )
    for i, tok in enumerate(token_ids):
        pos = entries[i] if entries is not None and i < len(entries) else None
        entry = pos.get(tok) if pos else None
        sampled.append(entry.logprob if entry is not None else math.nan)
        if top is not None:
            items = list(pos.items()) if pos else []
            if len(items) > k:  # the sampled token came first and is not in the top k
                items = items[1:]
            items.sort(key=lambda kv: kv[1].rank if kv[1].rank is not None else math.inf)
            top.append([(int(t), lp.logprob) for t, lp in items[:k]])
    return sampled, top
