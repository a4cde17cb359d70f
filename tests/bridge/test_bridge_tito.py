"""Token in, token out (bridge.tito): vLLM's sampling params read as vLLM reads them,
mapped onto the contract's Generate or refused by name; the answer's chunks; the
capability published where the installed Dynamo has the route (and not where it
has not: 1.3.0.post1, in NeMo RL's pin)."""

from __future__ import annotations

import base64
import importlib.util
import mmap
import struct
from pathlib import Path
from typing import Any

import pytest
from dynamo._core import Context
from dynamo.llm.exceptions import InvalidArgument

from bridge import dynamo_compat, tito
from bridge.codec import RequestError
from engine_contract.v1 import engine_pb2 as pb
from tests.bridge.bridge_fakes import FakeServer
from tests.bridge.test_bridge_engine import bridge_for, collect


def tito_request(params: dict[str, Any] | None = None, **envelope: Any) -> dict[str, Any]:
    """What Dynamo 1.6.1's frontend hands a worker for /inference/v1/generate."""
    return {
        "model": "m",
        "token_ids": [5, 6, 7],
        "stop_conditions": {"max_tokens": None, "min_tokens": None, "ignore_eos": False},
        "sampling_options": {"n": 1},
        "output_options": {},
        "eos_token_ids": [],
        "annotations": [],
        "extra_args": {
            "vllm_tito": {
                "request_id": "r",
                "sampling_params": params or {},
                "stream": False,
                "priority": 0,
                **envelope,
            }
        },
    }


def plan(params: dict[str, Any] | None = None, **envelope: Any) -> tito.TitoPlan:
    request = tito_request(params, **envelope)
    env = tito.envelope(request)
    assert env is not None
    return tito.plan("r", request, env)


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_only_a_request_with_the_envelope_is_token_in_token_out() -> None:
    assert tito.envelope({"token_ids": [1]}) is None
    assert tito.envelope({"extra_args": {"nvext": {}}}) is None
    with pytest.raises(RequestError, match=r"extra_args\.vllm_tito must be an object"):
        tito.envelope({"extra_args": {"vllm_tito": [1]}})


def test_vllm_defaults_are_the_contracts_neutral_ones() -> None:
    p = plan()
    msg = p.message
    assert msg.request_id == "r" and list(msg.prompt_token_ids) == [5, 6, 7]
    # Nothing set: temperature 1, top_p 1, top_k off, up to the end of the context.
    for field in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
        assert not msg.sampling.HasField(field)
    assert not msg.stop.HasField("max_tokens") and not msg.stop.HasField("ignore_eos")
    assert not msg.output.HasField("logprobs") and p.logprobs is None


def test_every_mapped_parameter_reaches_the_contract() -> None:
    p = plan(
        {
            "n": 1,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 2**40,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "max_tokens": 12,
            "min_tokens": 3,
            "stop": "END",
            "stop_token_ids": [9, 4, 9],
            "ignore_eos": True,
            "include_stop_str_in_output": True,
            "logprobs": 3,
            "skip_special_tokens": True,
            "detokenize": True,
        }
    )
    s, stop = p.message.sampling, p.message.stop
    assert (s.temperature, s.top_p, s.min_p) == (f32(0.7), f32(0.9), f32(0.05))
    assert (s.top_k, s.seed) == (40, 2**40)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (
        0.5,
        -0.5,
        f32(1.1),
    )
    assert (stop.max_tokens, stop.min_tokens) == (12, 3)
    assert list(stop.stop_strings) == ["END"] and list(stop.stop_token_ids) == [9, 4]
    assert stop.ignore_eos and stop.include_stop_str_in_output
    assert p.message.output.logprobs == 3 and p.logprobs == 3


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({"temperature": 0}, ("temperature", 0.0)),
        ({"temperature": 0.001}, ("temperature", f32(0.01))),  # vLLM's clamp
        ({"top_k": -1}, ("top_k", -1)),
        ({"top_k": 0}, ("top_k", 0)),
        ({"seed": -1}, ("seed", None)),  # vLLM's "no seed"
        ({"temperature": None, "seed": None}, ("temperature", None)),
    ],
)
def test_vllms_own_readings(params: dict[str, Any], want: tuple[str, Any]) -> None:
    sampling = plan(params).message.sampling
    name, value = want
    assert (getattr(sampling, name) if sampling.HasField(name) else None) == value


@pytest.mark.parametrize(
    ("params", "envelope", "field"),
    [
        ({"n": 2}, {}, "sampling_params.n"),
        ({"prompt_logprobs": 1}, {}, "sampling_params.prompt_logprobs"),
        ({"logprobs": -1}, {}, "sampling_params.logprobs"),
        ({"logit_bias": {"5": 1.0}}, {}, "sampling_params.logit_bias"),
        ({"bad_words": ["x"]}, {}, "sampling_params.bad_words"),
        ({"allowed_token_ids": [1]}, {}, "sampling_params.allowed_token_ids"),
        ({"structured_outputs": {"json": {}}}, {}, "sampling_params.structured_outputs"),
        ({"extra_args": {"a": 1}}, {}, "sampling_params.extra_args"),
        ({"logprob_token_ids": [3]}, {}, "sampling_params.logprob_token_ids"),
        ({"skip_reading_prefix_cache": True}, {}, "sampling_params.skip_reading_prefix_cache"),
        ({"thinking_token_budget": 5}, {}, "sampling_params.thinking_token_budget"),
        ({"temprature": 0.5}, {}, "sampling_params.temprature"),
        ({"temperature": 2.5}, {}, "sampling_params.temperature"),
        ({"temperature": "hot"}, {}, "sampling_params.temperature"),
        ({"top_p": 0}, {}, "sampling_params.top_p"),
        ({"top_k": -2}, {}, "sampling_params.top_k"),
        ({"min_p": 1.5}, {}, "sampling_params.min_p"),
        ({"presence_penalty": 3}, {}, "sampling_params.presence_penalty"),
        ({"repetition_penalty": 0}, {}, "sampling_params.repetition_penalty"),
        ({"max_tokens": 0}, {}, "sampling_params.max_tokens"),
        ({"max_tokens": 2, "min_tokens": 3}, {}, "sampling_params.min_tokens"),
        ({"stop": [""]}, {}, "sampling_params.stop"),
        ({"stop": "x", "detokenize": False}, {}, "sampling_params.detokenize"),
        ({"stop": "x", "skip_special_tokens": False}, {}, "sampling_params.skip_special_tokens"),
        ({"stop_token_ids": [1, "2"]}, {}, "sampling_params.stop_token_ids"),
        ({"ignore_eos": "yes"}, {}, "sampling_params.ignore_eos"),
        ({"seed": 2**64}, {}, "sampling_params.seed"),
        ({"routed_experts_prompt_start": 3}, {}, "sampling_params.routed_experts_prompt_start"),
        ({}, {"priority": 1}, "priority"),
        ({}, {"kv_transfer_params": {"a": 1}}, "kv_transfer_params"),
        ({}, {"features": {"mm_hashes": {}}}, "features"),
        ({}, {"ec_transfer_params": {"a": 1}}, "ec_transfer_params"),
        ({}, {"output_mode": "text"}, "output_mode"),
        ({}, {"sampling_params": None}, "sampling_params"),
    ],
)
def test_what_the_contract_cannot_honour_is_refused_by_name(
    params: dict[str, Any], envelope: dict[str, Any], field: str
) -> None:
    with pytest.raises(RequestError) as e:
        plan(params, **envelope)
    assert str(e.value).startswith(field), str(e.value)


def test_text_only_parameters_and_empty_defaults_are_accepted() -> None:
    p = plan(
        {
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "detokenize": False,
            "flat_logprobs": True,
            "logit_bias": None,
            "bad_words": [],
            "prompt_logprobs": None,
            "skip_reading_prefix_cache": False,
        },
        cache_salt=None,
        model="m",
        return_token_ids=True,
        output_mode="tokens",
        reasoning_ended=True,
    )
    assert p.logprobs is None


def finished_response(
    tokens: list[int], logprobs: list[float], experts: pb.RoutedExperts | None = None
) -> pb.GenerateResponse:
    finished = pb.GenerateFinished(
        finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=len(tokens)),
        weight_versions=[pb.WeightVersionSpan(version="v1", start=0, end=len(tokens))],
    )
    if experts is not None:
        finished.routed_experts.CopyFrom(experts)
    return pb.GenerateResponse(token_ids=tokens, logprobs=logprobs, finished=finished)


def test_the_chunks_carry_logprobs_only_when_asked_and_experts_from_their_start() -> None:
    rows = 3 + 2 - 1  # prompt + generated - 1
    data = bytes(range(rows * 2 * 2))
    experts = pb.RoutedExperts(data=data, dtype=pb.TENSOR_DTYPE_UINT8, shape=[rows, 2, 2])
    resp = finished_response([11, 12], [-0.5, -1.25], experts)
    chunk = plan({"logprobs": 0, "routed_experts_prompt_start": 1}).chunk(resp)
    assert chunk["token_ids"] == [11, 12] and chunk["log_probs"] == [-0.5, -1.25]
    assert chunk["finish_reason"] == "length"
    routed = chunk["engine_data"]["routed_experts"]
    # dynamo.vllm's shape, which Dynamo's frontend passes on as choices[0].routed_experts.
    assert routed == {
        "data": base64.b64encode(data[4:]).decode(),
        "shape": [rows - 1, 2, 2],
        "start": 1,
        "dtype": "uint8",
    }
    # vLLM's own shape of weight-version spans, in engine_data (the frontend drops it).
    assert chunk["engine_data"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 2}]
    quiet = plan().chunk(finished_response([11], [-0.5]))
    assert "log_probs" not in quiet and "routed_experts" not in quiet.get("engine_data", {})


async def test_the_bridge_runs_it_as_a_generate_and_refuses_bad_params_as_400() -> None:
    async with FakeServer() as server:
        engine = bridge_for(server.address)
        try:
            config = await engine.start(worker_id=1)
            published = (config.runtime_data or {}).get("vllm_inference_v1_generate")
            assert published is (True if dynamo_compat.serves_token_in_token_out() else None)
            chunks = await collect(
                engine, tito_request({"max_tokens": 4, "logprobs": 0}), Context(id="t-1")
            )
            assert [t for c in chunks for t in c["token_ids"]] == [10, 11, 12, 13]
            assert [lp for c in chunks for lp in c.get("log_probs", [])] == [-1.0] * 4
            sent = server.engine.generates[0]
            assert sent.request_id == "t-1" and sent.stop.max_tokens == 4
            assert sent.output.logprobs == 0
            with pytest.raises(InvalidArgument, match=r"^sampling_params\.n"):
                await collect(engine, tito_request({"n": 3}), Context(id="t-2"))
            assert len(server.engine.generates) == 1  # refused before the engine
        finally:
            await engine.cleanup()


def _core_library() -> Path:
    spec = importlib.util.find_spec("dynamo._core")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin)


def test_the_capability_is_published_exactly_where_the_frontend_has_the_route() -> None:
    """The frontend's route lives in Dynamo's Rust library: its capability key is
    there exactly when the installed Dynamo has /inference/v1/generate (1.6.1, not
    1.3.0.post1), and the bridge publishes it exactly then."""
    with _core_library().open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        route = m.find(b"/inference/v1/generate") != -1
        key = m.find(dynamo_compat.TOKEN_IN_TOKEN_OUT_CAPABILITY.encode()) != -1
    assert route == key == dynamo_compat.serves_token_in_token_out()
    data = dynamo_compat.token_in_token_out_runtime_data()
    assert data == ({dynamo_compat.TOKEN_IN_TOKEN_OUT_CAPABILITY: True} if route else {})
    if route:  # dynamo.vllm publishes the same key
        from dynamo.vllm.engine_generate import VLLM_GENERATE_CAPABILITY

        assert VLLM_GENERATE_CAPABILITY == dynamo_compat.TOKEN_IN_TOKEN_OUT_CAPABILITY
