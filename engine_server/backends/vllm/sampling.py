"""SamplingSpec -> vllm.SamplingParams, one field to one field.

The core has already applied every default and rollout rule, so nothing is
added here except what only concerns how vLLM hands results back:

- ``output_kind=DELTA``: each RequestOutput carries only what is new (vLLM
  merges deltas itself when the consumer falls behind), so a long rollout
  costs O(n), not O(n^2), in Python.
- ``detokenize`` only when stop strings need the text: the server returns
  token ids, never text; token ids and logprobs are the same either way.
- ``top_k`` -1 is passed as is: vLLM treats -1 and 0 both as "off", as NeMo
  RL's native path relies on.

Routed experts have no per-request switch in vLLM (the engine argument
``enable_return_routed_experts`` decides); ``spec.return_routed_experts`` only
decides whether the backend passes them on (see ``outputs.py``).
"""

from __future__ import annotations

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from engine_server.backends.base import SamplingSpec


def to_sampling_params(spec: SamplingSpec) -> SamplingParams:
    """Map ``spec`` onto vLLM; vLLM's own validation errors propagate."""
    return SamplingParams(
        n=1,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        seed=spec.seed,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        stop_token_ids=list(spec.stop_token_ids),
        stop=list(spec.stop_strings),
        ignore_eos=spec.ignore_eos,
        include_stop_str_in_output=spec.include_stop_str_in_output,
        bad_words=list(spec.bad_words) or None,
        logprobs=spec.logprobs,
        detokenize=bool(spec.stop_strings),
        output_kind=RequestOutputKind.DELTA,
    )
