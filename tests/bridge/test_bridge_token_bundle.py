"""The token bundle of a chat or completion that asks for ``engine_data`` (NeMo-Gym's
training data): codec pieces, the wire reader, and the bridge end to end against a
fake engine server. The frontend's side is tests/e2e/test_e2e_nemo_gym_chat.py."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
from dynamo._core import Context

from bridge import codec
from bridge.engine import BridgeEngine
from bridge.rollout_wire import ProtocolError
from engine_contract.v1 import engine_pb2 as pb
from rl_client import wire
from tests.bridge.bridge_fakes import FakeServer, bridge_on
from tests.bridge.test_bridge_codec import completion_request

# What Dynamo 1.6.1's preprocessor passes on for a chat request whose nvext asks for
# engine_data and carries token_data (seen in a bridge's debug log).
GYM_NVEXT = {"nvext": {"extra_fields": ["engine_data"], "token_in": True}}


def gym_request(**overrides: object) -> dict[str, Any]:
    return completion_request(extra_args=GYM_NVEXT, **overrides)


@pytest.mark.parametrize(
    ("request_", "asked"),
    [
        ({"extra_args": GYM_NVEXT}, True),
        ({"nvext": {"extra_fields": ["worker_id", "engine_data"]}}, True),
        ({"extra_args": {"nvext": {"extra_fields": ["worker_id"]}}}, False),
        ({"extra_args": {"nvext": {"extra_fields": "engine_data"}}}, False),
        ({"extra_args": None, "nvext": None}, False),
        ({}, False),
    ],
)
def test_engine_data_is_asked_for_only_in_extra_fields(
    request_: dict[str, Any], asked: bool
) -> None:
    assert codec.engine_data_requested(request_) is asked


def test_the_engine_is_asked_for_the_sampled_logprob_when_the_bundle_needs_it() -> None:
    assert not codec.build_generate_request("g", completion_request()).output.HasField("logprobs")
    msg = codec.build_generate_request("g", gym_request())
    assert msg.output.HasField("logprobs") and msg.output.logprobs == 0
    # The client's own choice stands.
    asked = codec.build_generate_request("g", gym_request(output_options__logprobs=3))
    assert asked.output.logprobs == 3


def test_chunks_leave_out_logprobs_the_client_did_not_ask_for() -> None:
    delta = pb.GenerateResponse(token_ids=[4, 5], logprobs=[-1.0, -2.0])
    assert "log_probs" not in codec.generate_chunk(delta, logprobs=False)
    assert codec.generate_chunk(delta)["log_probs"] == [-1.0, -2.0]
    with pytest.raises(ProtocolError):
        codec.generate_chunk(
            pb.GenerateResponse(token_ids=[4], logprobs=[-1.0, -2.0]), logprobs=False
        )


def test_the_trace_holds_every_delta_in_order() -> None:
    trace = codec.TokenTrace([7, 8, 9])
    merged = pb.GenerateResponse(token_ids=[1, 2], logprobs=[-0.5, -math.inf])
    trace.add(merged)
    trace.add(pb.GenerateResponse(token_ids=[3], logprobs=[-0.25]))
    trace.add(pb.GenerateResponse(finished=pb.GenerateFinished()))
    assert trace.engine_data("stop") == {
        "prompt_token_ids": [7, 8, 9],
        "completion_token_ids": [1, 2, 3],
        "completion_logprobs": [-0.5, wire.LOGPROB_FLOOR, -0.25],
        "finished": True,
    }
    assert trace.engine_data("length")["finished"] is True
    assert trace.engine_data("cancelled")["finished"] is False
    assert trace.engine_data("error")["finished"] is False


def test_a_delta_without_logprobs_drops_them_rather_than_misalign() -> None:
    trace = codec.TokenTrace([7])
    trace.add(pb.GenerateResponse(token_ids=[1], logprobs=[-0.5]))
    trace.add(pb.GenerateResponse(token_ids=[2]))
    trace.add(pb.GenerateResponse(token_ids=[3], logprobs=[-0.5]))
    data = trace.engine_data("stop")
    assert data["completion_token_ids"] == [1, 2, 3]
    assert "completion_logprobs" not in data
    with pytest.raises(wire.WireError, match="completion_logprobs"):
        wire.read_token_bundle(data)


@pytest.mark.parametrize(
    ("engine_data", "message"),
    [
        ({"prompt_token_ids": [1], "completion_token_ids": [2]}, "lacks"),
        ({"prompt_token_ids": [1], "completion_token_ids": [2], "completion_logprobs": []}, "0 "),
        ({"prompt_token_ids": [1.0], "completion_token_ids": [], "completion_logprobs": []}, "int"),
        (
            {"prompt_token_ids": [1], "completion_token_ids": [2], "completion_logprobs": ["x"]},
            "num",
        ),
        (
            {"prompt_token_ids": [True], "completion_token_ids": [], "completion_logprobs": []},
            "int",
        ),
    ],
)
def test_the_reader_refuses_partial_or_misaligned_bundles(
    engine_data: dict[str, Any], message: str
) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.read_token_bundle(engine_data)


def test_the_reader_returns_the_bundle() -> None:
    bundle = wire.read_token_bundle(
        {
            "prompt_token_ids": [1, 2],
            "completion_token_ids": [3],
            "completion_logprobs": [-1],
            "finished": True,
            "weight_versions": [],
        }
    )
    assert bundle == wire.TokenBundle([1, 2], [3], [-1.0], True)


@pytest.fixture
async def bridge() -> AsyncIterator[tuple[FakeServer, BridgeEngine]]:
    async with FakeServer() as server, bridge_on(server, connect_timeout_s=5) as engine:
        yield server, engine


async def chunks_of(engine: BridgeEngine, request: dict[str, Any], ctx: str) -> list[dict]:
    return [c async for c in engine.generate(request, context=Context(id=ctx))]


async def test_the_last_chunk_carries_the_bundle(bridge: tuple[FakeServer, BridgeEngine]) -> None:
    server, engine = bridge
    chunks = await chunks_of(engine, gym_request(token_ids=[5, 6, 7]), "gym-1")
    assert all("engine_data" not in c for c in chunks[:-1])
    bundle = wire.read_token_bundle(chunks[-1]["engine_data"])
    assert bundle.prompt_token_ids == list(server.engine.generates[-1].prompt_token_ids)
    assert bundle.prompt_token_ids == [5, 6, 7]
    assert bundle.completion_token_ids == [t for c in chunks for t in c["token_ids"]]
    assert bundle.completion_token_ids == [10, 11, 12, 13]
    assert bundle.completion_logprobs == [-1.0] * 4 and bundle.finished
    # Not asked for in the choice: the chunks carry none.
    assert all("log_probs" not in c for c in chunks)


async def test_no_bundle_unless_asked(bridge: tuple[FakeServer, BridgeEngine]) -> None:
    _, engine = bridge
    chunks = await chunks_of(engine, completion_request(), "plain-1")
    assert all(wire.COMPLETION_TOKEN_IDS not in c.get("engine_data", {}) for c in chunks), chunks[
        -1
    ]
