"""Turns contract requests into engine work: validation, defaults, the rollout budget.

Everything a backend runs is decided here, so every backend gets the same
semantics. Errors name the offending field (INVALID_ARGUMENT).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine_contract.labels import label_problem
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.base import EngineInfo, SamplingSpec
from engine_server.config import GenerationDefaults, Limits
from engine_server.errors import InvalidRequest


@dataclass(frozen=True)
class Plan:
    """A validated request: what to run, or (max_tokens 0) that nothing runs."""

    request_id: str
    prompt_token_ids: Sequence[int]
    spec: SamplingSpec
    # The weight version every token must come from (revision 8); None: any.
    required_weight_version: str | None = None

    @property
    def generates_nothing(self) -> bool:
        return self.spec.max_tokens == 0


def resolve_defaults(defaults: GenerationDefaults, info: EngineInfo) -> GenerationDefaults:
    """Fill the defaults' stop ids with the model's EOS ids when none were configured."""
    if defaults.stop_token_ids:
        return defaults
    return dataclasses.replace(defaults, stop_token_ids=tuple(info.eos_token_ids))


def check_request_id(request_id: str, limits: Limits) -> None:
    if not request_id:
        raise InvalidRequest("request_id", "must not be empty")
    check_id_length("request_id", request_id, limits)


def check_id_length(field: str, value: str, limits: Limits) -> None:
    """Every id a request carries is bounded (and never echoed whole)."""
    check_length(field, value, limits.max_request_id_length)


def check_length(field: str, value: str, most: int) -> str:
    """``value``, refused when longer than ``most`` characters (never echoed whole)."""
    if len(value) > most:
        raise InvalidRequest(field, f"{len(value)} characters, more than the limit of {most}")
    return value


def check_prompt(prompt: Sequence[int], info: EngineInfo, *, fit_context: bool = True) -> None:
    if not prompt:
        raise InvalidRequest("prompt_token_ids", "must not be empty")
    if fit_context and len(prompt) > info.context_length:
        raise InvalidRequest(
            "prompt_token_ids",
            f"{len(prompt)} tokens, longer than the context length {info.context_length}",
        )
    check_token_ids("prompt_token_ids", prompt, info)


def merge_stop_strings(configured: Sequence[str], own: Sequence[str]) -> tuple[str, ...]:
    """NeMo RL's merge: the union of the config's and the rollout's stop strings.

    NeMo RL takes a set (no order); the order here is fixed (config first, then
    the rollout's, first occurrence kept) so that the same rollout always runs
    the same way.
    """
    return tuple(dict.fromkeys((*configured, *own)))


def check_token_ids(field: str, ids: Sequence[int], info: EngineInfo) -> None:
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or high >= info.vocab_size:
        bad_index, bad = next((i, t) for i, t in enumerate(ids) if t < 0 or t >= info.vocab_size)
        raise InvalidRequest(
            f"{field}[{bad_index}]",
            f"token id {bad} is outside the vocabulary [0, {info.vocab_size})",
        )


def check_stop_strings(field: str, stop_strings: Sequence[str], limits: Limits) -> None:
    if len(stop_strings) > limits.max_stop_strings:
        raise InvalidRequest(
            field,
            f"{len(stop_strings)} stop strings, more than the limit of {limits.max_stop_strings}",
        )
    for i, text in enumerate(stop_strings):
        if not text:
            raise InvalidRequest(f"{field}[{i}]", "stop strings must not be empty")
        if len(text) > limits.max_stop_string_length:
            raise InvalidRequest(
                f"{field}[{i}]",
                f"{len(text)} characters, more than the limit of {limits.max_stop_string_length}",
            )


def routed_experts_wanted(field: str, mode: int, info: EngineInfo) -> bool:
    if mode == pb.ROUTED_EXPERTS_MODE_UNSPECIFIED:
        return info.reports_routed_experts
    if mode == pb.ROUTED_EXPERTS_MODE_OMIT:
        return False
    if mode == pb.ROUTED_EXPERTS_MODE_REQUIRE:
        if not info.reports_routed_experts:
            raise InvalidRequest(field, "required, but this engine does not report routed experts")
        return True
    raise InvalidRequest(field, f"unknown RoutedExpertsMode value {mode}")


def data_parallel_rank(
    request: pb.RolloutRequest | pb.GenerateRequest, info: EngineInfo
) -> int | None:
    """The rank the request names (None: the engine picks), checked."""
    if not request.HasField("data_parallel_rank"):
        return None
    rank = request.data_parallel_rank
    if not 0 <= rank < info.data_parallel_size:
        raise InvalidRequest(
            "data_parallel_rank",
            f"{rank} is outside [0, {info.data_parallel_size}) (the ranks this server hosts)",
        )
    return rank


def required_weight_version(request: pb.RolloutRequest | pb.GenerateRequest) -> str | None:
    """The version a version-guarded request requires, a valid label; None: unguarded."""
    if not request.HasField("required_weight_version"):
        return None
    version = request.required_weight_version
    problem = label_problem(version)
    if problem is not None:
        raise InvalidRequest("required_weight_version", problem)
    return version


def cache_salt(request: pb.RolloutRequest | pb.GenerateRequest) -> str | None:
    """The request's prefix-cache namespace (revision 11), printable as a label is;
    None: the shared cache."""
    if not request.HasField("cache_salt"):
        return None
    problem = label_problem(request.cache_salt)
    if problem is not None:
        raise InvalidRequest("cache_salt", problem)
    return request.cache_salt


def plan_rollout(
    request: pb.RolloutRequest, info: EngineInfo, defaults: GenerationDefaults, limits: Limits
) -> Plan:
    """NeMo RL's native rollout: sampling from the server's defaults, budget clamped.

    A prompt that fills the context (or more) is not an error: its budget is 0
    and nothing is generated, as on NeMo RL's native path.
    """
    check_request_id(request.request_id, limits)
    prompt = request.prompt_token_ids
    check_prompt(prompt, info, fit_context=False)
    check_stop_strings("stop_strings", request.stop_strings, limits)
    stop_strings = merge_stop_strings(defaults.stop_strings, request.stop_strings)
    if len(stop_strings) > limits.max_stop_strings:
        raise InvalidRequest(
            "stop_strings",
            f"{len(stop_strings)} stop strings with the server's configured ones, more than "
            f"the limit of {limits.max_stop_strings}",
        )
    max_new = defaults.max_new_tokens
    if request.HasField("max_new_tokens"):
        max_new = request.max_new_tokens
        if not 0 <= max_new <= info.context_length:
            raise InvalidRequest(
                "max_new_tokens", f"{max_new} is outside [0, {info.context_length}]"
            )
    budget = max(0, min(max_new, info.context_length - len(prompt)))
    spec = SamplingSpec(
        max_tokens=budget,
        temperature=0.0 if request.greedy else defaults.temperature,
        top_p=defaults.top_p,
        top_k=1 if request.greedy else defaults.top_k,
        stop_token_ids=tuple(defaults.stop_token_ids),
        stop_strings=stop_strings,
        ignore_eos=defaults.ignore_eos,
        bad_words=defaults.bad_words,
        include_stop_str_in_output=True,
        logprobs=0,
        return_routed_experts=routed_experts_wanted("routed_experts", request.routed_experts, info),
        data_parallel_rank=data_parallel_rank(request, info),
        cache_salt=cache_salt(request),
    )
    return Plan(request.request_id, prompt, spec, required_weight_version(request))


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(field, f"{value} is not a finite number")
    return value


def plan_generate(request: pb.GenerateRequest, info: EngineInfo, limits: Limits) -> Plan:
    """An ordinary completion: the request's own sampling, engine-neutral defaults."""
    check_request_id(request.request_id, limits)
    prompt = request.prompt_token_ids
    check_prompt(prompt, info)
    sampling, stop, output = request.sampling, request.stop, request.output
    room = info.context_length - len(prompt)

    temperature = 1.0
    if sampling.HasField("temperature"):
        temperature = _finite("sampling.temperature", sampling.temperature)
        if temperature < 0:
            raise InvalidRequest("sampling.temperature", f"{temperature} is negative")
    top_p = 1.0
    if sampling.HasField("top_p"):
        top_p = _finite("sampling.top_p", sampling.top_p)
        if not 0 < top_p <= 1:
            raise InvalidRequest("sampling.top_p", f"{top_p} is outside (0, 1]")
    top_k = -1
    if sampling.HasField("top_k"):
        top_k = sampling.top_k
        if top_k < -1:
            raise InvalidRequest("sampling.top_k", f"{top_k}: use -1 or 0 to disable, else >= 1")
        top_k = -1 if top_k == 0 else top_k
    min_p = 0.0
    if sampling.HasField("min_p"):
        min_p = _finite("sampling.min_p", sampling.min_p)
        if not 0 <= min_p <= 1:
            raise InvalidRequest("sampling.min_p", f"{min_p} is outside [0, 1]")
    penalties: dict[str, float] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if sampling.HasField(name):
            value = _finite(f"sampling.{name}", getattr(sampling, name))
            if not -2 <= value <= 2:
                raise InvalidRequest(f"sampling.{name}", f"{value} is outside [-2, 2]")
            penalties[name] = value
    if sampling.HasField("repetition_penalty"):
        value = _finite("sampling.repetition_penalty", sampling.repetition_penalty)
        if value <= 0:
            raise InvalidRequest("sampling.repetition_penalty", f"{value} must be > 0")
        penalties["repetition_penalty"] = value

    max_tokens = room
    if stop.HasField("max_tokens"):
        max_tokens = stop.max_tokens
        if max_tokens < 0:
            raise InvalidRequest("stop.max_tokens", f"{max_tokens} is negative")
        if max_tokens > room:
            raise InvalidRequest(
                "stop.max_tokens",
                f"{max_tokens} tokens do not fit: the prompt leaves {room} of the context "
                f"length {info.context_length}",
            )
    min_tokens = 0
    if stop.HasField("min_tokens"):
        min_tokens = stop.min_tokens
        if not 0 <= min_tokens <= max_tokens:
            raise InvalidRequest("stop.min_tokens", f"{min_tokens} is outside [0, {max_tokens}]")
    check_stop_strings("stop.stop_strings", stop.stop_strings, limits)
    check_token_ids("stop.stop_token_ids", stop.stop_token_ids, info)

    logprobs: int | None = None
    if output.HasField("logprobs"):
        logprobs = output.logprobs
        if not 0 <= logprobs <= limits.max_top_logprobs:
            raise InvalidRequest(
                "output.logprobs", f"{logprobs} is outside [0, {limits.max_top_logprobs}]"
            )
    spec = SamplingSpec(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=sampling.seed if sampling.HasField("seed") else None,
        presence_penalty=penalties.get("presence_penalty", 0.0),
        frequency_penalty=penalties.get("frequency_penalty", 0.0),
        repetition_penalty=penalties.get("repetition_penalty", 1.0),
        min_tokens=min_tokens,
        stop_token_ids=tuple(stop.stop_token_ids),
        stop_strings=tuple(stop.stop_strings),
        ignore_eos=stop.ignore_eos,
        include_stop_str_in_output=stop.include_stop_str_in_output,
        logprobs=logprobs,
        return_routed_experts=routed_experts_wanted(
            "output.routed_experts", output.routed_experts, info
        ),
        data_parallel_rank=data_parallel_rank(request, info),
        cache_salt=cache_salt(request),
    )
    return Plan(request.request_id, prompt, spec, required_weight_version(request))
