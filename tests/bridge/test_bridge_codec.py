"""Dynamo request dicts -> proto (with presence), proto -> chunks, request kinds."""

from __future__ import annotations

import base64
import json
import math
import struct

import pytest
from google.protobuf.message import Message

from bridge import codec
from bridge.codec import RequestError
from bridge.rollout_wire import ProtocolError
from engine_contract.v1 import engine_pb2 as pb
from rl_client import wire
from rl_client.annotation import RolloutSpec


def f32(x: float) -> float:
    """What the frontend sends for a user's float: the float32 value as a double."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def completion_request(**overrides: object) -> dict:
    """A request shaped like what Dynamo 1.6.1's frontend sends for /v1/completions."""
    request: dict = {
        "token_ids": [5, 6, 7],
        "sampling_options": {
            "n": None,
            "best_of": None,
            "presence_penalty": None,
            "frequency_penalty": None,
            "repetition_penalty": None,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "min_p": None,
            "use_beam_search": None,
            "length_penalty": None,
            "seed": None,
            "include_stop_str_in_output": None,
            "guided_decoding": None,
        },
        "stop_conditions": {
            "max_tokens": None,
            "stop": None,
            "stop_token_ids": None,
            "stop_token_ids_visible": None,
            "stop_token_ids_hidden": [1],
            "min_tokens": None,
            "ignore_eos": None,
            "max_thinking_tokens": None,
        },
        "output_options": {
            "logprobs": None,
            "prompt_logprobs": None,
            "skip_special_tokens": True,
            "formatted_prompt": None,
        },
        "eos_token_ids": [1],
        "annotations": [],
    }
    for key, value in overrides.items():
        group, _, name = key.partition("__")
        if name:
            request[group][name] = value
        else:
            request[group] = value
    return request


# -- request kinds -------------------------------------------------------------


def test_no_annotation_is_an_ordinary_completion() -> None:
    assert codec.parse_request_kind(None) is None
    assert codec.parse_request_kind([]) is None
    # Dynamo's own annotations pass untouched.
    assert codec.parse_request_kind(["request_id:abc", "query_instance_id:", "token_ids"]) is None


def test_a_rollout_annotation_parses_into_its_spec() -> None:
    spec = codec.parse_request_kind(
        ['rollout:{"greedy":true,"stop_strings":["</s>","\\n\\n"],"request_id":"r1"}']
    )
    assert spec == RolloutSpec(greedy=True, stop_strings=("</s>", "\n\n"), request_id="r1")
    assert codec.parse_request_kind(["rollout:{}"]) == RolloutSpec()
    assert codec.parse_request_kind(["rollout:"]) == RolloutSpec()


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        ('rollout:{"greedy":1}', "'greedy' must be a boolean"),
        ('rollout:{"greedy":"yes"}', "'greedy' must be a boolean"),
        ('rollout:{"stop_strings":"x"}', "'stop_strings' must be a list"),
        ('rollout:{"stop_strings":[""]}', "'stop_strings' must be a list"),
        ('rollout:{"stop_strings":[3]}', "'stop_strings' must be a list"),
        ('rollout:{"request_id":7}', "'request_id' must be a non-empty string"),
        ('rollout:{"request_id":""}', "'request_id' must be a non-empty string"),
        ('rollout:{"temperature":0.5}', "unknown keys ['temperature']"),
        ("rollout:{greedy:true}", "not valid JSON"),
        ("rollout:[1]", "must be a JSON object"),
        ("rollout", "needs a JSON spec"),
        ('rolout:{"greedy":true}', "unknown request kind 'rolout'"),
    ],
)
def test_bad_annotation_is_a_request_error(annotation: str, message: str) -> None:
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        codec.parse_request_kind([annotation])


def test_two_rollout_annotations_refused() -> None:
    with pytest.raises(RequestError, match="more than one"):
        codec.parse_request_kind(["rollout:{}", "rollout:{}"])


# -- rollout ---------------------------------------------------------------------


def test_rollout_request_takes_max_tokens_only_when_given() -> None:
    spec = RolloutSpec(greedy=True, stop_strings=("x",))
    msg = codec.build_rollout_request("r", completion_request(), spec)
    assert not msg.HasField("max_new_tokens")
    assert (msg.request_id, list(msg.prompt_token_ids), msg.greedy, list(msg.stop_strings)) == (
        "r",
        [5, 6, 7],
        True,
        ["x"],
    )
    msg = codec.build_rollout_request("r", completion_request(stop_conditions__max_tokens=0), spec)
    assert msg.HasField("max_new_tokens") and msg.max_new_tokens == 0
    msg = codec.build_rollout_request("r", completion_request(stop_conditions__max_tokens=9), spec)
    assert msg.max_new_tokens == 9


def test_rollout_refuses_http_stop_strings() -> None:
    request = completion_request(stop_conditions__stop=["\n"])
    with pytest.raises(RequestError, match="from the rollout spec"):
        codec.build_rollout_request("r", request, RolloutSpec())


def rollout_response(**fields: object) -> pb.RolloutResponse:
    base: dict = dict(
        request_id="r1",
        token_ids=[3, 4, 1],
        logprobs=[-0.25, -1.5, -3.0],
        finish_reason=pb.FINISH_REASON_STOP,
        matched_stop=pb.StopMatch(token_id=1),
        usage=pb.Usage(prompt_tokens=3, completion_tokens=3, cached_prompt_tokens=2),
        instance_id="i1",
    )
    base.update(fields)
    return pb.RolloutResponse(**base)


def test_rollout_chunk_carries_everything_in_engine_data_and_counts_its_tokens() -> None:
    chunk = codec.rollout_chunk(rollout_response())
    # The tokens, for the frontend's usage; text set, so that it passes them through
    # without detokenizing, hiding EOS or cutting at stop strings.
    assert chunk["token_ids"] == [3, 4, 1] and chunk["text"] == ""
    assert chunk["finish_reason"] == "stop"
    assert chunk["stop_reason"] == 1
    assert chunk["completion_usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    data = chunk["engine_data"]["rollout"]
    assert set(data) == wire.WIRE_KEYS
    assert data["token_ids"] == [3, 4, 1]
    assert wire.decode_logprobs(data["logprobs"], data["version"]) == [-0.25, -1.5, -3.0]
    assert data["finish_reason"] == "stop" and data["truncated"] is False
    assert data["routed_experts"] is None and data["r3_stats"] is None
    json.dumps(chunk, allow_nan=False)  # JSON-safe


@pytest.mark.parametrize(
    ("reason", "dynamo", "wire_name"),
    [
        (pb.FINISH_REASON_STOP, "stop", "stop"),
        (pb.FINISH_REASON_LENGTH, "length", "length"),
        (pb.FINISH_REASON_ABORTED, "cancelled", "aborted"),
        (pb.FINISH_REASON_ERROR, "error", "error"),
        (pb.FINISH_REASON_UNSPECIFIED, "error", "error"),
    ],
)
def test_each_finish_reason_maps_to_dynamos_and_to_its_wire_name(
    reason: int, dynamo: str, wire_name: str
) -> None:
    chunk = codec.rollout_chunk(rollout_response(finish_reason=reason, matched_stop=None))
    assert chunk["finish_reason"] == dynamo
    assert chunk["engine_data"]["rollout"]["finish_reason"] == wire_name


def test_routed_experts_and_r3_stats_reach_the_rollouts_engine_data() -> None:
    data = bytes(range(2 * 3 * 2))
    resp = rollout_response(
        routed_experts=pb.RoutedExperts(data=data, dtype=pb.TENSOR_DTYPE_INT8, shape=[2, 3, 2]),
        r3_stats=pb.R3Stats(actual_routes=2, expected_routes=3, missing_routes=1),
    )
    out = codec.rollout_chunk(resp)["engine_data"]["rollout"]
    assert out["routed_experts"] == {
        "dtype": "int8",
        "shape": [2, 3, 2],
        "data": base64.b64encode(data).decode(),
    }
    assert out["r3_stats"] == {
        "actual_routes": 2,
        "expected_routes": 3,
        "missing_routes": 1,
        "surplus_routes": 0,
    }


def test_rollout_misaligned_or_bad_experts_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="2 logprobs for 3 tokens"):
        codec.rollout_chunk(rollout_response(logprobs=[-1.0, -2.0]))
    bad = pb.RoutedExperts(data=b"\x00" * 5, dtype=pb.TENSOR_DTYPE_INT16, shape=[1, 1, 2])
    with pytest.raises(ProtocolError, match="needs 4"):
        codec.rollout_chunk(rollout_response(routed_experts=bad))


def test_non_finite_logprobs_become_the_floor() -> None:
    resp = rollout_response(logprobs=[-math.inf, math.nan, -0.125])
    data = codec.rollout_chunk(resp)["engine_data"]["rollout"]
    assert wire.decode_logprobs(data["logprobs"], data["version"]) == [
        wire.LOGPROB_FLOOR,
        wire.LOGPROB_FLOOR,
        -0.125,
    ]
    chunk = codec.generate_chunk(pb.GenerateResponse(token_ids=[1, 2], logprobs=[math.inf, -2.0]))
    assert chunk["log_probs"] == [wire.LOGPROB_FLOOR, -2.0]


# -- ordinary completion -------------------------------------------------------------


def optional_fields(message: Message) -> list[str]:
    """The fields of ``message`` that the contract declares ``optional`` (absent
    unless set)."""
    return [field.name for field in message.DESCRIPTOR.fields if field.has_presence]


def test_unset_options_stay_absent() -> None:
    msg = codec.build_generate_request("g", completion_request())
    # Every optional sampling parameter, stop condition and output option.
    for options in (msg.sampling, msg.stop, msg.output):
        for name in optional_fields(options):
            assert not options.HasField(name), name
    # The model EOS (hidden stop id) is still a stop token for the engine.
    assert list(msg.stop.stop_token_ids) == [1]


def test_set_options_are_present_and_exact() -> None:
    msg = codec.build_generate_request(
        "g",
        completion_request(
            sampling_options__temperature=f32(0.7),
            sampling_options__top_p=f32(0.9),
            sampling_options__top_k=0,
            sampling_options__min_p=0.0,
            sampling_options__seed=2**40,
            sampling_options__presence_penalty=f32(-0.5),
            sampling_options__frequency_penalty=0.0,
            sampling_options__repetition_penalty=f32(1.1),
            sampling_options__include_stop_str_in_output=False,
            stop_conditions__max_tokens=16,
            stop_conditions__min_tokens=0,
            stop_conditions__stop_token_ids=[9, 1],
            stop_conditions__stop_token_ids_visible=[9],
            output_options__logprobs=0,
        ),
    )
    s = msg.sampling
    # float32-rounded doubles land exactly on the user's float32 values.
    assert s.temperature == f32(0.7) and s.top_p == f32(0.9)
    assert s.repetition_penalty == f32(1.1) and s.presence_penalty == f32(-0.5)
    # Explicit zeros are present, not "unset".
    assert s.HasField("top_k") and s.top_k == 0
    assert s.HasField("min_p") and s.HasField("frequency_penalty")
    assert s.seed == 2**40
    assert msg.stop.max_tokens == 16 and msg.stop.HasField("min_tokens")
    assert msg.stop.HasField("include_stop_str_in_output")
    assert list(msg.stop.stop_token_ids) == [9, 1]
    assert msg.output.HasField("logprobs") and msg.output.logprobs == 0


def test_ignore_eos_drops_the_eos_and_is_present() -> None:
    request = completion_request(
        stop_conditions__ignore_eos=True,
        stop_conditions__stop_token_ids_hidden=[],
        eos_token_ids=[],
    )
    msg = codec.build_generate_request("g", request)
    assert msg.stop.HasField("ignore_eos") and msg.stop.ignore_eos is True
    assert list(msg.stop.stop_token_ids) == []
    # Even if the frontend listed the EOS, ignore_eos keeps it out of the stop ids.
    request = completion_request(
        stop_conditions__ignore_eos=True,
        eos_token_ids=[2],
        stop_conditions__stop_token_ids_hidden=[],
    )
    assert list(codec.build_generate_request("g", request).stop.stop_token_ids) == []
    request = completion_request(stop_conditions__ignore_eos=False)
    msg = codec.build_generate_request("g", request)
    assert msg.stop.HasField("ignore_eos") and msg.stop.ignore_eos is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"sampling_options__n": 2}, "n > 1"),
        ({"sampling_options__best_of": 3}, "best_of"),
        ({"sampling_options__use_beam_search": True}, "beam search"),
        ({"sampling_options__guided_decoding": {"json": {}}}, "guided decoding"),
        ({"output_options__prompt_logprobs": 1}, "prompt_logprobs"),
        ({"stop_conditions__max_thinking_tokens": 5}, "max_thinking_tokens"),
        ({"stop_conditions__max_tokens": -1}, "max_tokens must be >= 0"),
        ({"stop_conditions__max_tokens": 2**40}, "out of range"),
        ({"sampling_options__temperature": "hot"}, "temperature must be a finite number"),
        ({"sampling_options__top_k": 1.5}, "top_k must be an integer"),
        ({"token_ids": []}, "no prompt token ids"),
    ],
)
def test_unsupported_or_bad_options_refused(override: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        codec.build_generate_request("g", completion_request(**override))


def test_generate_deltas_become_dynamo_chunks_and_malformed_ones_are_refused() -> None:
    delta = codec.generate_chunk(
        pb.GenerateResponse(
            token_ids=[4, 5],
            logprobs=[-0.5, -0.75],
            top_logprobs=[
                pb.TopLogprobs(token_ids=[4, 8], logprobs=[-0.5, -1.0]),
                pb.TopLogprobs(token_ids=[5], logprobs=[-0.75]),
            ],
        )
    )
    assert delta == {
        "token_ids": [4, 5],
        "index": 0,
        "log_probs": [-0.5, -0.75],
        "top_logprobs": [
            [
                {"rank": 1, "token_id": 4, "token": None, "logprob": -0.5},
                {"rank": 2, "token_id": 8, "token": None, "logprob": -1.0},
            ],
            [{"rank": 1, "token_id": 5, "token": None, "logprob": -0.75}],
        ],
    }
    last = codec.generate_chunk(
        pb.GenerateResponse(
            finished=pb.GenerateFinished(
                finish_reason=pb.FINISH_REASON_STOP,
                matched_stop=pb.StopMatch(stop_string="\n"),
                usage=pb.Usage(prompt_tokens=3, completion_tokens=2),
            )
        )
    )
    assert last == {
        "token_ids": [],
        "index": 0,
        "finish_reason": "stop",
        "stop_reason": "\n",
        "completion_usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    with pytest.raises(ProtocolError):
        codec.generate_chunk(pb.GenerateResponse(token_ids=[1], logprobs=[-1.0, -2.0]))
