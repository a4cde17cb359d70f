"""Dynamo request/chunk dicts <-> engine-contract messages. Pure: no I/O, no Dynamo.

Request kinds are chosen by annotation (``nvext.annotations`` reach the engine
verbatim). An annotation ``<kind>:<JSON object>`` names a bridge request kind;
the known kind is ``rollout`` (its JSON: ``rl_client.annotation``, the driver's
and the bridge's one shape). Annotations Dynamo itself uses
(``request_id:...``, ``query_instance_id:``, ...) never carry a JSON object and
pass untouched. A request without a kind annotation is an ordinary completion.
A rollout's result travels as ``bridge.rollout_wire`` writes it.

Errors the client caused raise ``RequestError`` (a ValueError); the engine glue
turns it into Dynamo's ``InvalidArgument`` (HTTP 400 with the message).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Required, TypedDict

from bridge.rollout_wire import ProtocolError, rollout_wire, routed_experts_wire, stop_reason
from engine_contract.text import clip, text_problem
from engine_contract.v1 import engine_pb2 as pb
from rl_client import annotation, wire
from rl_client.annotation import AnnotationError, RolloutSpec, parse_rollout_spec

# The ``nvext.extra_fields`` entry that asks for a chunk's engine_data.
ENGINE_DATA_FIELD = "engine_data"
KNOWN_KINDS = (annotation.KIND,)

# Dynamo's finish reasons ("cancelled" is what Dynamo calls an abort).
_FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
    # Ended early by the engine server, as an abort is (Dynamo has no other word).
    pb.FINISH_REASON_WEIGHT_VERSION_CHANGED: "cancelled",
}


class Chunk(TypedDict, total=False):
    """What the bridge yields to Dynamo: its ``GenerateChunk`` (engine.py of
    ``dynamo.common.backend``), key for key, plus ``stop_reason``, which the
    frontend passes on. Declared here so that this module stays Dynamo-free."""

    token_ids: Required[list[int]]
    index: Required[int]
    finish_reason: str
    completion_usage: dict[str, Any]
    disaggregated_params: dict[str, Any]
    encoder_result: dict[str, Any]
    log_probs: list[float]
    top_logprobs: list[list[dict[str, Any]]]
    engine_data: dict[str, Any]
    stop_reason: int | str
    # Present (even empty): the frontend takes the chunk as decoded already and
    # neither detokenizes it nor applies stop conditions to it.
    text: str


class RequestError(ValueError):
    """The request is malformed or asks for something the engine contract cannot do."""


# ---------------------------------------------------------------------------
# Request kinds


def parse_request_kind(annotations: Sequence[Any] | None) -> RolloutSpec | None:
    """The rollout spec when the request is a rollout, None for an ordinary completion."""
    found: RolloutSpec | None = None
    for entry in annotations or ():
        if not isinstance(entry, str):
            continue
        kind, sep, value = entry.partition(":")
        if kind == annotation.KIND:
            if found is not None:
                raise RequestError("more than one 'rollout:' annotation")
            if not sep:
                raise RequestError("the 'rollout' annotation needs a JSON spec: rollout:{...}")
            try:
                found = parse_rollout_spec(value)
            except AnnotationError as e:
                raise RequestError(str(e)) from e
        elif sep and value.lstrip().startswith("{"):
            raise RequestError(
                f"unknown request kind {clip(kind)} in annotation {clip(entry)}; "
                f"known kinds: {', '.join(KNOWN_KINDS)}"
            )
    return found


def _text(field: str, value: str) -> str:
    """A string that can travel as protobuf text (UTF-8): lone surrogates cannot."""
    problem = text_problem(field, value)
    if problem is not None:
        raise RequestError(problem)
    return value


# ---------------------------------------------------------------------------
# Rollout


def routed_rank(request: Mapping[str, Any], start_rank: int, ranks: int) -> int | None:
    """The engine's local data-parallel rank Dynamo's router chose
    (``routing.dp_rank``, a global rank), or None to let the engine pick."""
    routing = request.get("routing") or {}
    rank = routing.get("dp_rank") if isinstance(routing, Mapping) else None
    if not isinstance(rank, int) or isinstance(rank, bool):
        return None
    local = rank - start_rank
    return local if 0 <= local < ranks else None


def build_rollout_request(
    request_id: str, request: Mapping[str, Any], spec: RolloutSpec
) -> pb.RolloutRequest:
    """Sampling comes from the engine's generation defaults; only max_tokens is taken
    from the HTTP request (stop_conditions.max_tokens -> max_new_tokens) when given."""
    stop_conditions = request.get("stop_conditions") or {}
    if stop_conditions.get("stop"):
        raise RequestError(
            "a rollout takes its stop strings from the rollout spec ('stop_strings'), "
            "not from the request's 'stop'"
        )
    sampling = request.get("sampling_options") or {}
    if (sampling.get("n") or 1) != 1 or (sampling.get("best_of") or 1) != 1:
        raise RequestError(
            "a rollout has one choice (n and best_of 1): send n rollouts, each with its own "
            "request (NeMo RL sends one request per sample)"
        )
    msg = pb.RolloutRequest(
        request_id=request_id,
        prompt_token_ids=_token_ids(request),
        greedy=spec.greedy,
        stop_strings=list(spec.stop_strings),
    )
    max_tokens = stop_conditions.get("max_tokens")
    if max_tokens is not None:
        msg.max_new_tokens = _int(max_tokens, "max_tokens", minimum=0)
    if spec.weight_version is not None:
        msg.required_weight_version = spec.weight_version
    return msg


def rollout_chunk(resp: pb.RolloutResponse, text: str = "") -> Chunk:
    """The rollout's one and only chunk.

    The result travels whole in ``engine_data``. ``token_ids`` are there too so
    that the frontend's usage (it counts the chunks' tokens, not
    ``completion_usage``), its token metrics and tools like aiperf see the real
    completion; ``text`` is set (empty unless the spec asked for it) so that the
    frontend passes the chunk through as decoded already: no detokenizing, no
    EOS hiding, no stop strings applied, and a rollout comes back exactly as the
    engine made it.
    """
    chunk: Chunk = {
        "token_ids": list(resp.token_ids),
        "text": text,
        "index": 0,
        "finish_reason": _FINISH_REASONS.get(resp.finish_reason, "error"),
        "completion_usage": completion_usage(resp.usage),
        "engine_data": {wire.WIRE_KEY: rollout_wire(resp)},
    }
    reason = stop_reason(resp.matched_stop)
    if reason is not None:
        chunk["stop_reason"] = reason
    return chunk


# ---------------------------------------------------------------------------
# Ordinary completion


def build_generate_request(request_id: str, request: Mapping[str, Any]) -> pb.GenerateRequest:
    """Map Dynamo's sampling options, stop conditions and output options one to one.

    Proto3 ``optional`` presence mirrors what the user set: a None (or missing)
    option stays absent and the engine applies its neutral default. Floats arrive
    float32-rounded from the frontend and the proto fields are float32, so the
    user's value survives exactly. Features the contract cannot carry are refused
    rather than silently dropped.
    """
    sampling_in = request.get("sampling_options") or {}
    stop_in = request.get("stop_conditions") or {}
    output_in = request.get("output_options") or {}
    _refuse_unsupported(sampling_in, stop_in, output_in)

    sampling = pb.SamplingParams()
    for key in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = sampling_in.get(key)
        if value is not None:
            setattr(sampling, key, _float(value, key))
    if sampling_in.get("top_k") is not None:
        sampling.top_k = _int(sampling_in["top_k"], "top_k")
    if sampling_in.get("seed") is not None:
        sampling.seed = _int(sampling_in["seed"], "seed", bits=64)

    stop = pb.StopConditions()
    if stop_in.get("max_tokens") is not None:
        stop.max_tokens = _int(stop_in["max_tokens"], "max_tokens", minimum=0)
    if stop_in.get("min_tokens") is not None:
        stop.min_tokens = _int(stop_in["min_tokens"], "min_tokens", minimum=0)
    # Dynamo 1.6.1 forwards OpenAI `stop` here (and also cuts the text itself);
    # the engine stopping there too saves the tokens after the match.
    stop_strings = stop_in.get("stop") or []
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    stop.stop_strings.extend(_text(f"stop[{i}]", str(text)) for i, text in enumerate(stop_strings))
    ignore_eos = stop_in.get("ignore_eos")
    if ignore_eos is not None:
        stop.ignore_eos = bool(ignore_eos)
    stop.stop_token_ids.extend(_stop_token_ids(request, stop_in, ignore_eos=bool(ignore_eos)))
    if sampling_in.get("include_stop_str_in_output") is not None:
        stop.include_stop_str_in_output = bool(sampling_in["include_stop_str_in_output"])

    output = pb.OutputOptions()
    if output_in.get("logprobs") is not None:
        output.logprobs = _int(output_in["logprobs"], "logprobs", minimum=0)
    elif engine_data_requested(request):
        # The token bundle always carries the sampled token's logprob (shown in
        # the choice only when asked for: generate_chunk(logprobs=False)).
        output.logprobs = 0

    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=_token_ids(request),
        sampling=sampling,
        stop=stop,
        output=output,
    )


def _stop_token_ids(
    request: Mapping[str, Any], stop_in: Mapping[str, Any], *, ignore_eos: bool
) -> list[int]:
    """Every stop token Dynamo names, in order, without repeats.

    Dynamo splits them into user stop ids (``stop_token_ids``, also listed as
    ``stop_token_ids_visible``) and hidden ones (the model's EOS, which the
    frontend drops from the text); the engine must stop on all of them. With
    ``ignore_eos`` Dynamo already leaves the EOS out of the hidden list.
    """
    ids: list[int] = []
    sources = [
        stop_in.get("stop_token_ids"),
        stop_in.get("stop_token_ids_visible"),
        stop_in.get("stop_token_ids_hidden"),
    ]
    if not ignore_eos:
        sources.append(request.get("eos_token_ids"))
    for source in sources:
        for token in source or ():
            token = _int(token, "stop_token_ids", minimum=0)
            if token not in ids:
                ids.append(token)
    return ids


def _refuse_unsupported(
    sampling: Mapping[str, Any], stop: Mapping[str, Any], output: Mapping[str, Any]
) -> None:
    if (sampling.get("n") or 1) != 1:
        raise RequestError("n > 1 is not supported by this engine; send n separate requests")
    if (sampling.get("best_of") or 1) != 1:
        raise RequestError("best_of is not supported by this engine")
    if sampling.get("use_beam_search"):
        raise RequestError("beam search is not supported by this engine")
    if sampling.get("guided_decoding") is not None:
        raise RequestError("guided decoding is not supported by this engine")
    if stop.get("max_thinking_tokens") is not None:
        raise RequestError("max_thinking_tokens is not supported by this engine")
    if output.get("prompt_logprobs") is not None:
        raise RequestError("prompt_logprobs is not supported by this engine")


def generate_chunk(resp: pb.GenerateResponse, *, logprobs: bool = True) -> Chunk:
    """One Generate delta as a Dynamo chunk; the last one adds finish reason and usage.
    ``logprobs=False`` leaves out logprobs the client did not ask for (the bridge
    asked for them for the token bundle)."""
    token_ids = list(resp.token_ids)
    chunk: Chunk = {"token_ids": token_ids, "index": 0}
    if resp.logprobs:
        if len(resp.logprobs) != len(token_ids):
            raise ProtocolError(f"{len(resp.logprobs)} logprobs for {len(token_ids)} tokens")
        if logprobs:
            chunk["log_probs"] = wire.finite_logprobs(resp.logprobs)
    if resp.top_logprobs:
        if len(resp.top_logprobs) != len(token_ids):
            raise ProtocolError(
                f"{len(resp.top_logprobs)} top-logprob lists for {len(token_ids)} tokens"
            )
        chunk["top_logprobs"] = [_top_logprobs(t) for t in resp.top_logprobs]
    if resp.HasField("finished"):
        fin = resp.finished
        chunk["finish_reason"] = _FINISH_REASONS.get(fin.finish_reason, "error")
        chunk["completion_usage"] = completion_usage(fin.usage)
        reason = stop_reason(fin.matched_stop)
        if reason is not None:
            chunk["stop_reason"] = reason
        engine_data: dict[str, Any] = {}
        if fin.HasField("routed_experts"):
            engine_data["routed_experts"] = routed_experts_wire(fin.routed_experts)
        if fin.weight_versions:
            engine_data["weight_versions"] = wire.encode_weight_versions(fin.weight_versions)
        if engine_data:
            chunk["engine_data"] = engine_data
    return chunk


def engine_data_requested(request: Mapping[str, Any]) -> bool:
    """Whether the client's ``nvext.extra_fields`` names "engine_data". Dynamo's
    preprocessor passes the client's nvext on in ``extra_args.nvext``; a request
    built by hand may carry ``nvext`` itself."""
    for nvext in nvext_sources(request):
        fields = nvext.get("extra_fields")
        if isinstance(fields, list) and ENGINE_DATA_FIELD in fields:
            return True
    return False


def nvext_sources(request: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The client's nvext objects: the request's own, then the preprocessor's copy."""
    extra_args = request.get("extra_args")
    for nvext in (
        request.get("nvext"),
        extra_args.get("nvext") if isinstance(extra_args, Mapping) else None,
    ):
        if isinstance(nvext, Mapping):
            yield nvext


def logprobs_requested(request: Mapping[str, Any]) -> bool:
    output = request.get("output_options") or {}
    return output.get("logprobs") is not None


class TokenTrace:
    """A completion's whole token bundle for the final chunk's ``engine_data``
    (``rl_client.wire``'s keys, as dynamo.vllm writes them): RL clients train on
    these exact ids and sampled logprobs, one per token, since the frontend's
    choice may differ (EOS hidden, stop strings cut). The prompt is the one sent
    to the engine, which runs exactly those ids."""

    __slots__ = ("_aligned", "_logprobs", "_prompt", "_tokens")

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self._prompt = list(prompt_token_ids)
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._aligned = True

    def add(self, resp: pb.GenerateResponse) -> None:
        """One delta (merged or not) in order; a delta without its logprobs drops
        them from the bundle rather than misalign it."""
        self._tokens.extend(resp.token_ids)
        if len(resp.logprobs) == len(resp.token_ids):
            self._logprobs.extend(wire.finite_logprobs(resp.logprobs))
        else:
            self._aligned = False

    def engine_data(self, finish_reason: str) -> dict[str, Any]:
        data: dict[str, Any] = {
            wire.PROMPT_TOKEN_IDS: list(self._prompt),
            wire.COMPLETION_TOKEN_IDS: list(self._tokens),
            wire.FINISHED: finish_reason in ("stop", "length"),
        }
        if self._aligned:
            data[wire.COMPLETION_LOGPROBS] = list(self._logprobs)
        return data


def _top_logprobs(msg: pb.TopLogprobs) -> list[dict[str, Any]]:
    if len(msg.token_ids) != len(msg.logprobs):
        raise ProtocolError(
            f"top logprobs: {len(msg.logprobs)} values for {len(msg.token_ids)} tokens"
        )
    return [
        {"rank": rank, "token_id": token, "token": None, "logprob": wire.finite_logprob(lp)}
        for rank, (token, lp) in enumerate(zip(msg.token_ids, msg.logprobs, strict=True), 1)
    ]


# ---------------------------------------------------------------------------
# Shared pieces


def completion_usage(usage: pb.Usage) -> dict[str, Any]:
    """OpenAI usage. The prompt's cached tokens always, 0 included (as vLLM's
    server with ``--enable-prompt-tokens-details``): the engine always counts
    them, and clients such as aiperf read an absent count as "not reported"."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def cancelled_chunk(prompt_tokens: int, completion_tokens: int = 0) -> Chunk:
    """The terminal chunk of a request aborted by Dynamo (client gone, stop string hit)."""
    return {
        "token_ids": [],
        "index": 0,
        "finish_reason": "cancelled",
        "completion_usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def refusal_chunk(refusal: wire.WeightVersionRefusal, prompt_tokens: int) -> Chunk:
    """The one chunk of a version-guarded rollout refused with the fleet's versions
    (``bridge.weight_refusal``): nothing generated, ``engine_data`` holding the
    refusal instead of the result. An answer, not an error: no frontend passes an
    error's words on, every one passes ``engine_data``. "cancelled" (the frontend
    shows "stop"), as a rollout ended early."""
    chunk = cancelled_chunk(prompt_tokens)
    chunk["text"] = ""
    chunk["engine_data"] = {wire.REFUSAL_KEY: wire.encode_refusal(refusal)}
    return chunk


def _token_ids(request: Mapping[str, Any]) -> list[int]:
    ids = request.get("token_ids")
    if not ids:
        raise RequestError("the request has no prompt token ids")
    return list(ids)


def _int(value: Any, name: str, *, minimum: int | None = None, bits: int = 32) -> int:
    """An integer that fits the proto field (int32 unless said otherwise)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or int(value) != value
    ):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if minimum is not None and value < minimum:
        raise RequestError(f"{name} must be >= {minimum}, got {value}")
    if not low <= value <= high:
        raise RequestError(f"{name} is out of range: {value}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)
