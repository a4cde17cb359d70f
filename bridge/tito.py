"""Token in, token out: vLLM's ``POST /inference/v1/generate``, served by Dynamo's
frontend, run as the contract's Generate. Pure: no I/O, no Dynamo, no vLLM.

The frontend (``DYN_VLLM_ENABLE_INFERENCE_V1_GENERATE``) routes the route only to
workers whose model card says ``runtime_data["vllm_inference_v1_generate"]``
(``bridge.dynamo_compat.token_in_token_out_runtime_data``) and hands each the
usual preprocessed request plus ``extra_args.vllm_tito``: the client's body less
its ``token_ids`` (those are the request's own), ``sampling_params`` exactly as
sent. The frontend's projection of them (``stop_conditions``,
``sampling_options``) keeps only the few it routes by, so the raw params are the
authority here, read as vLLM's ``SamplingParams`` reads them. Whatever the
contract cannot carry is refused by name (HTTP 400), never dropped: a client
gets what it asked for or is told why not.

The answer goes back as Generate's deltas, which the frontend folds into one
``choices[0]``: ``token_ids``, ``finish_reason``, ``logprobs.content`` (when
``logprobs`` was asked for: the sampled token's, and the top k for k > 0) and
``routed_experts`` (from the last chunk's ``engine_data``, in dynamo.vllm's
shape).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bridge.codec import Chunk, RequestError, generate_chunk
from bridge.rollout_wire import ProtocolError, routed_experts_wire
from engine_contract.v1 import engine_pb2 as pb

ENVELOPE_KEY = "vllm_tito"

# The envelope's own fields (vLLM's GenerateRequest less token_ids), as the
# frontend forwards them; any other one is refused by name.
_ENVELOPE_FIELDS = frozenset(
    {
        "request_id",  # the frontend's context id already (x-request-id, else this)
        "sampling_params",
        "model",  # the frontend routed by it
        "stream",  # true is answered 501 by the frontend itself
        "stream_options",
        "cache_salt",  # bridge.cache_salt reads it
        "priority",
        "kv_transfer_params",
        # Answer metadata, or hints for structured outputs (refused anyway): no token
        # or logprob depends on them.
        "return_token_ids",
        "output_mode",  # "text" is refused: the answer has token ids only
        "token_offsets",
        "reasoning_ended",
        "reasoning_parser_kwargs",
    }
)
# Sampling fields that change only text or transport, never a token or logprob:
# the route returns no text, and the frontend folds the deltas itself.
_TEXT_ONLY = frozenset(
    {
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "flat_logprobs",
        "output_kind",
        "stream_interval",
        "skip_clone",
        "output_text_buffer_length",
    }
)
# vLLM features the contract has no field for: allowed only at their default.
_UNSUPPORTED = frozenset(
    {
        "prompt_logprobs",
        "prompt_logprob_token_ids",
        "prompt_logprob_start",
        "logprob_token_ids",
        "structured_outputs",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "extra_args",
        "thinking_token_budget",
        "repetition_detection",
        "watermarking",
        "trace_decode_token_ids",
        "skip_reading_prefix_cache",
    }
)
_MAPPED = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "logprobs",
        "routed_experts_prompt_start",
    }
)
# vLLM clamps a temperature in (0, this) up to it (``SamplingParams.__post_init__``).
_MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class TitoPlan:
    """One token-in/token-out request: the Generate to send and how to answer it."""

    message: pb.GenerateRequest
    # What the client asked vLLM for: None, no logprobs; 0, the sampled token's;
    # k, also the top k.
    logprobs: int | None
    # vLLM's routed_experts_prompt_start: the first row of routed experts returned.
    experts_start: int

    def chunk(self, resp: pb.GenerateResponse) -> Chunk:
        """A Generate delta as the chunk the frontend folds: logprobs only when asked
        for, routed experts in dynamo.vllm's shape (``{data, shape, start, dtype}``)."""
        chunk = generate_chunk(resp, logprobs=self.logprobs is not None)
        if resp.HasField("finished") and resp.finished.HasField("routed_experts"):
            experts = _experts(resp.finished.routed_experts, self.experts_start)
            chunk.setdefault("engine_data", {})["routed_experts"] = experts
        return chunk


def envelope(request: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The request's ``extra_args.vllm_tito``, None for any other request."""
    extra_args = request.get("extra_args")
    if not isinstance(extra_args, Mapping) or ENVELOPE_KEY not in extra_args:
        return None
    value = extra_args[ENVELOPE_KEY]
    if not isinstance(value, Mapping):
        raise RequestError(f"extra_args.{ENVELOPE_KEY} must be an object")
    return value


def plan(request_id: str, request: Mapping[str, Any], env: Mapping[str, Any]) -> TitoPlan:
    """The Generate for a /inference/v1/generate request, or RequestError naming the
    first field the contract cannot honour."""
    _check_envelope(env)
    params = env.get("sampling_params")
    if not isinstance(params, Mapping):
        raise RequestError("sampling_params must be an object")
    unknown = sorted(k for k in params if k not in _MAPPED | _TEXT_ONLY | _UNSUPPORTED)
    if unknown:
        raise RequestError(
            f"sampling_params.{unknown[0]}: not a vLLM sampling parameter this engine knows"
        )
    for name in sorted(_UNSUPPORTED):
        if _set(params.get(name)):
            raise RequestError(
                f"sampling_params.{name}: not supported by this engine (the engine "
                "contract has no such field)"
            )
    prompt = request.get("token_ids")
    if not prompt:
        raise RequestError("token_ids: the request has no prompt token ids")
    stop = _stop_conditions(params)
    logprobs = _integer(params, "logprobs", minimum=-1)
    if logprobs == -1:
        raise RequestError(
            "sampling_params.logprobs: -1 (the whole vocabulary) is not supported by this "
            "engine; ask for 0 (the sampled token's) or a top k"
        )
    output = pb.OutputOptions()
    if logprobs is not None:
        output.logprobs = logprobs
    start = _integer(params, "routed_experts_prompt_start", minimum=0) or 0
    if start >= len(prompt):
        raise RequestError(
            "sampling_params.routed_experts_prompt_start must be smaller than the prompt "
            f"token count ({len(prompt)}), got {start}"
        )
    message = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling=_sampling(params),
        stop=stop,
        output=output,
    )
    return TitoPlan(message, logprobs, start)


def _check_envelope(env: Mapping[str, Any]) -> None:
    unknown = sorted(k for k in env if k not in _ENVELOPE_FIELDS and _set(env[k]))
    if unknown:
        raise RequestError(f"{unknown[0]}: not supported by this engine")
    priority = env.get("priority") or 0
    if priority != 0:
        # What vLLM answers under its default first-come-first-served scheduling.
        raise RequestError(f"priority: {priority!r} given, but this engine schedules by arrival")
    if _set(env.get("kv_transfer_params")):
        raise RequestError("kv_transfer_params: disaggregated serving is not supported")
    if env.get("output_mode", "tokens") not in (None, "tokens"):
        raise RequestError("output_mode: only 'tokens' (this route answers token ids)")


def _sampling(params: Mapping[str, Any]) -> pb.SamplingParams:
    """vLLM's sampling fields, checked as ``SamplingParams._verify_args`` checks them."""
    n = _integer(params, "n", minimum=1)
    if n not in (None, 1):
        raise RequestError(f"sampling_params.n: {n} given; this engine answers one choice")
    sampling = pb.SamplingParams()
    temperature = _number(params, "temperature")
    if temperature is not None:
        if not 0 <= temperature <= 2:
            raise RequestError(f"sampling_params.temperature must be in [0, 2], got {temperature}")
        sampling.temperature = max(temperature, _MIN_TEMPERATURE) if temperature else 0.0
    top_p = _number(params, "top_p")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise RequestError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
        sampling.top_p = top_p
    top_k = _integer(params, "top_k", minimum=-1)
    if top_k is not None:
        sampling.top_k = top_k  # -1 and 0 both switch it off, in vLLM and the contract
    min_p = _number(params, "min_p")
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise RequestError(f"sampling_params.min_p must be in [0, 1], got {min_p}")
        sampling.min_p = min_p
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(params, name)
        if value is not None:
            if not -2 <= value <= 2:
                raise RequestError(f"sampling_params.{name} must be in [-2, 2], got {value}")
            setattr(sampling, name, value)
    repetition = _number(params, "repetition_penalty")
    if repetition is not None:
        if repetition <= 0:
            raise RequestError(
                f"sampling_params.repetition_penalty must be greater than 0, got {repetition}"
            )
        sampling.repetition_penalty = repetition
    seed = _integer(params, "seed", bits=64)
    if seed is not None and seed != -1:  # vLLM's -1: no seed
        sampling.seed = seed
    return sampling


def _stop_conditions(params: Mapping[str, Any]) -> pb.StopConditions:
    stop = pb.StopConditions()
    max_tokens = _integer(params, "max_tokens", minimum=1)
    if max_tokens is not None:  # absent: up to the end of the context, as vLLM's server
        stop.max_tokens = max_tokens
    min_tokens = _integer(params, "min_tokens", minimum=0)
    if min_tokens is not None:
        if max_tokens is not None and min_tokens > max_tokens:
            raise RequestError(
                f"sampling_params.min_tokens must be at most max_tokens={max_tokens}, "
                f"got {min_tokens}"
            )
        stop.min_tokens = min_tokens
    strings = params.get("stop")
    if isinstance(strings, str):
        strings = [strings]
    if strings is not None and (
        not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings)
    ):
        raise RequestError("sampling_params.stop must be a string or a list of non-empty strings")
    if strings:
        for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens"):
            # Stop strings are matched in the text vLLM decodes with its defaults.
            if params.get(name) is False:
                raise RequestError(
                    f"sampling_params.{name}: false is not supported together with stop"
                )
        stop.stop_strings.extend(strings)
    ids = params.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids
        ):
            raise RequestError("sampling_params.stop_token_ids must be a list of token ids")
        stop.stop_token_ids.extend(dict.fromkeys(ids))  # vLLM drops repeats too
    for name in ("ignore_eos", "include_stop_str_in_output"):
        value = params.get(name)
        if value is not None:
            if not isinstance(value, bool):
                raise RequestError(f"sampling_params.{name} must be true or false")
            setattr(stop, name, value)
    return stop


def _experts(msg: pb.RoutedExperts, start: int) -> dict[str, Any]:
    """Routed experts as dynamo.vllm writes them: the rows from ``start`` on (vLLM's
    routed_experts_prompt_start), base64 of their little-endian bytes."""
    whole = routed_experts_wire(msg)  # checks dtype and size
    if len(msg.shape) != 3:
        raise ProtocolError(f"routed experts of shape {list(msg.shape)}, not 3 dimensions")
    rows = msg.shape[0]
    start = min(start, rows)
    row_bytes = len(msg.data) // rows if rows else 0
    return {
        "data": base64.b64encode(msg.data[start * row_bytes :]).decode("ascii"),
        "shape": [rows - start, *whole["shape"][1:]],
        "start": start,
        "dtype": whole["dtype"],
    }


def _set(value: Any) -> bool:
    """Whether a field holds anything but its default (absent, null, false, empty)."""
    return value is not None and value is not False and value != [] and value != {}


def _integer(
    params: Mapping[str, Any], name: str, minimum: int | None = None, *, bits: int = 32
) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"sampling_params.{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise RequestError(f"sampling_params.{name} must be at least {minimum}, got {value}")
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise RequestError(f"sampling_params.{name} is out of range: {value}")
    return value


def _number(params: Mapping[str, Any], name: str) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"sampling_params.{name} must be a finite number, got {value!r}")
    return float(value)
