"""Rollout semantics and request validation, without an engine."""

from __future__ import annotations

import dataclasses

import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_server.admission import plan_generate, plan_rollout, resolve_defaults
from engine_server.backends.base import EngineInfo
from engine_server.config import GenerationDefaults, Limits
from engine_server.errors import InvalidRequest

INFO = EngineInfo(
    model_name="m",
    model_path="/m",
    context_length=64,
    kv_block_size=16,
    total_kv_blocks=64,
    max_running_sequences=8,
    max_batched_tokens=256,
    eos_token_ids=(2,),
    vocab_size=100,
    backend_name="test",
    backend_version="0",
)
DEFAULTS = resolve_defaults(
    GenerationDefaults(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=20), INFO
)
LIMITS = Limits(max_stop_strings=2)


def rollout(**kw: object) -> pb.RolloutRequest:
    kw.setdefault("request_id", "r1")
    kw.setdefault("prompt_token_ids", [5, 6, 7])
    return pb.RolloutRequest(**kw)  # type: ignore[arg-type]


def test_defaults_stop_ids_fall_back_to_eos() -> None:
    assert DEFAULTS.stop_token_ids == (2,)
    explicit = resolve_defaults(GenerationDefaults(stop_token_ids=(9,)), INFO)
    assert explicit.stop_token_ids == (9,)


def test_greedy_rollout_is_temperature_zero_top_k_one_with_sampled_logprob() -> None:
    spec = plan_rollout(rollout(greedy=True, stop_strings=["x"]), INFO, DEFAULTS, LIMITS).spec
    assert (spec.temperature, spec.top_k, spec.top_p) == (0.0, 1, 0.9)
    assert spec.logprobs == 0 and spec.include_stop_str_in_output
    assert spec.stop_token_ids == (2,) and spec.stop_strings == ("x",)
    assert spec.max_tokens == 20 and spec.seed is None


def test_prompt_past_the_context_generates_nothing() -> None:
    plan = plan_rollout(rollout(prompt_token_ids=[1] * 65), INFO, DEFAULTS, LIMITS)
    assert plan.generates_nothing
    with pytest.raises(InvalidRequest) as err:  # an ordinary completion still refuses it
        plan_generate(pb.GenerateRequest(request_id="g", prompt_token_ids=[1] * 65), INFO, LIMITS)
    assert err.value.field == "prompt_token_ids"


def test_configured_stop_strings_merge_with_the_rollouts() -> None:
    defaults = dataclasses.replace(DEFAULTS, stop_strings=("a", "b"), ignore_eos=True)
    spec = plan_rollout(rollout(stop_strings=["b", "c"]), INFO, defaults, Limits()).spec
    assert spec.stop_strings == ("a", "b", "c") and spec.ignore_eos
    with pytest.raises(InvalidRequest) as err:  # the limit counts the merged list
        plan_rollout(rollout(stop_strings=["c"]), INFO, defaults, LIMITS)
    assert err.value.field == "stop_strings"


def test_sampled_rollout_uses_server_defaults() -> None:
    spec = plan_rollout(rollout(), INFO, DEFAULTS, LIMITS).spec
    assert (spec.temperature, spec.top_p, spec.top_k) == (pytest.approx(0.7), 0.9, 50)


@pytest.mark.parametrize(
    ("prompt_len", "max_new", "budget"),
    [(3, None, 20), (50, None, 14), (64, None, 0), (10, 5, 5), (10, 0, 0), (60, 64, 4)],
)
def test_budget_is_clamped_to_the_context(
    prompt_len: int, max_new: int | None, budget: int
) -> None:
    request = rollout(prompt_token_ids=[1] * prompt_len)
    if max_new is not None:
        request.max_new_tokens = max_new
    plan = plan_rollout(request, INFO, DEFAULTS, LIMITS)
    assert plan.spec.max_tokens == budget
    assert plan.generates_nothing == (budget == 0)


@pytest.mark.parametrize(
    ("request_kw", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": "x" * 257}, "request_id"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -1]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1, 100]}, "prompt_token_ids[1]"),
        ({"stop_strings": ["a", ""]}, "stop_strings[1]"),
        ({"stop_strings": ["a", "b", "c"]}, "stop_strings"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 65}, "max_new_tokens"),
        ({"routed_experts": 2}, "routed_experts"),
        ({"routed_experts": 7}, "routed_experts"),
    ],
)
def test_bad_rollouts_name_the_field(request_kw: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        plan_rollout(rollout(**request_kw), INFO, DEFAULTS, LIMITS)
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_generate_keeps_explicit_zeros_apart_from_absence() -> None:
    request = pb.GenerateRequest(request_id="g", prompt_token_ids=[1, 2])
    spec = plan_generate(request, INFO, LIMITS).spec
    assert (spec.temperature, spec.top_p, spec.top_k, spec.logprobs) == (1.0, 1.0, -1, None)
    assert spec.max_tokens == 62
    request.sampling.temperature = 0.0
    request.sampling.top_k = 0
    request.stop.max_tokens = 0
    request.output.logprobs = 0
    spec = plan_generate(request, INFO, LIMITS).spec
    assert (spec.temperature, spec.top_k, spec.max_tokens, spec.logprobs) == (0.0, -1, 0, 0)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: setattr(r.sampling, "temperature", -0.5), "sampling.temperature"),
        (lambda r: setattr(r.sampling, "temperature", float("nan")), "sampling.temperature"),
        (lambda r: setattr(r.sampling, "top_p", 0.0), "sampling.top_p"),
        (lambda r: setattr(r.sampling, "top_k", -2), "sampling.top_k"),
        (lambda r: setattr(r.sampling, "min_p", 1.5), "sampling.min_p"),
        (lambda r: setattr(r.sampling, "presence_penalty", 3.0), "sampling.presence_penalty"),
        (lambda r: setattr(r.sampling, "repetition_penalty", 0.0), "sampling.repetition_penalty"),
        (lambda r: setattr(r.stop, "max_tokens", -1), "stop.max_tokens"),
        (lambda r: setattr(r.stop, "max_tokens", 63), "stop.max_tokens"),
        (lambda r: setattr(r.stop, "min_tokens", 70), "stop.min_tokens"),
        (lambda r: r.stop.stop_token_ids.append(100), "stop.stop_token_ids[0]"),
        (lambda r: r.stop.stop_strings.append(""), "stop.stop_strings[0]"),
        (lambda r: setattr(r.output, "logprobs", 21), "output.logprobs"),
        (lambda r: setattr(r.output, "routed_experts", 9), "output.routed_experts"),
    ],
)
def test_bad_generate_requests_name_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    request = pb.GenerateRequest(request_id="g", prompt_token_ids=[1, 2])
    mutate(request)
    with pytest.raises(InvalidRequest) as err:
        plan_generate(request, INFO, LIMITS)
    assert err.value.field == field
