"""A rollout's required weight version (contract revision 8) on the bridge's side:
the driver puts it in the ``rollout:`` annotation, the bridge carries it into the
RolloutRequest (on the stream and on unary calls), passes the engine's refusal on
as migratable, and names the weight-change end in the wire form."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc
import pytest
from aiohttp import web
from dynamo.llm.exceptions import Disconnected

from bridge import codec
from bridge.codec import RequestError
from bridge.engine import BridgeEngine
from bridge.errors import MIGRATABLE
from engine_contract.v1 import engine_pb2 as pb
from rl_client import driver, wire
from rl_client.annotation import RolloutSpec
from tests.bridge.bridge_fakes import (
    FakeServer,
    annotated_chunks,
    bridge_on,
    fake_frontend,
    frontend_body,
)

GUARDED = 'rollout:{"greedy":true,"weight_version":"step-7"}'


def test_the_annotation_carries_the_version_into_the_rollout_request() -> None:
    spec = codec.parse_request_kind([GUARDED])
    assert spec == RolloutSpec(greedy=True, weight_version="step-7")
    request = {"token_ids": [5, 6], "stop_conditions": {"max_tokens": 3}}
    message = codec.build_rollout_request("r", request, spec)
    assert message.HasField("required_weight_version")
    assert message.required_weight_version == "step-7"
    unguarded = codec.build_rollout_request("r", request, RolloutSpec())
    assert not unguarded.HasField("required_weight_version")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (7, "must be a string"),
        ("", "must not be empty"),
        ("v\n1", "control character"),
        ("x" * 257, "more than the limit"),
        ("\ud800", "not valid text"),
    ],
)
def test_a_version_that_is_no_label_is_a_request_error(value: object, message: str) -> None:
    annotation = "rollout:" + json.dumps({"weight_version": value})
    with pytest.raises(RequestError, match=message):
        codec.parse_request_kind([annotation])


def test_the_weight_change_end_has_its_own_wire_name() -> None:
    response = pb.RolloutResponse(
        request_id="r",
        token_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        finish_reason=pb.FINISH_REASON_WEIGHT_VERSION_CHANGED,
        weight_versions=[pb.WeightVersionSpan(version="step-7", start=0, end=2)],
    )
    # Dynamo knows no such reason: an early end, as an abort is.
    assert codec.rollout_chunk(response)["finish_reason"] == "cancelled"
    result = driver.parse_rollout_response(frontend_body(response))
    assert result.finish_reason == wire.WEIGHT_VERSION_CHANGED == "weight_version_changed"
    assert result.token_ids == [4, 5] and not result.truncated
    assert result.weight_versions == [("step-7", 0, 2)] and result.weight_version == "step-7"


# -- through the bridge to a fake engine server --------------------------------------


def started(
    server: FakeServer, transport: str = "auto"
) -> AbstractAsyncContextManager[BridgeEngine]:
    return bridge_on(server, connect_timeout_s=5, rollout_transport=transport)


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    async with FakeServer() as server:
        yield server


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_the_bridge_carries_the_version_to_the_engine_server(
    fake: FakeServer, transport: str
) -> None:
    async with started(fake, transport) as engine:
        chunks = await annotated_chunks(engine, GUARDED, "c1")
        assert chunks[-1]["engine_data"]["rollout"]["token_ids"] == [6, 7, 8]
        await annotated_chunks(engine, 'rollout:{"greedy":true}', "c2")
    guarded, unguarded = fake.engine.rollouts
    assert guarded.required_weight_version == "step-7"
    assert not unguarded.HasField("required_weight_version")
    assert fake.engine.streamed_rollouts == (2 if transport == "stream" else 0)


async def test_an_engine_servers_refusal_is_migratable_and_names_the_versions(
    fake: FakeServer,
) -> None:
    refusal = (
        "required_weight_version: the request requires weight version 'step-7', this "
        "server serves 'step-8'; nothing was generated"
    )
    fake.engine.fail_with = (grpc.StatusCode.ABORTED, refusal)
    async with started(fake) as engine:
        with pytest.raises(Disconnected) as refused:
            await annotated_chunks(engine, GUARDED, "c1")
    assert isinstance(refused.value, MIGRATABLE) and refusal in str(refused.value)


# -- the driver -------------------------------------------------------------------------


async def test_the_driver_sends_the_version_in_the_annotation() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        spec = codec.parse_request_kind(body["nvext"]["annotations"])
        assert spec is not None
        response = pb.RolloutResponse(
            request_id="r",
            token_ids=[3],
            logprobs=[-0.5],
            finish_reason=pb.FINISH_REASON_LENGTH,
            weight_versions=[pb.WeightVersionSpan(version=spec.weight_version or "any", end=1)],
        )
        return web.json_response(frontend_body(response))

    runner, url = await fake_frontend(handler)
    try:
        async with driver.RolloutClient(url, "m") as client:
            result = await client.rollout([1, 2], max_tokens=1, weight_version="step-7")
            plain = await client.rollout([1, 2], max_tokens=1)
    finally:
        await runner.cleanup()
    assert result.weight_versions == [("step-7", 0, 1)]
    assert seen[0]["nvext"]["annotations"] == ['rollout:{"greedy":false,"weight_version":"step-7"}']
    assert "weight_version" not in seen[1]["nvext"]["annotations"][0]
    assert plain.weight_versions == [("any", 0, 1)]
