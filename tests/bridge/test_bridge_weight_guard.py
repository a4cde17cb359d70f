"""A rollout's required weight version (contract revision 8) on the bridge's side:
the driver puts it in the ``rollout:`` annotation, the bridge carries it into the
RolloutRequest (on the stream and on unary calls), never sends it to an engine
server that would ignore it, passes the engine's refusal on as migratable, and
names the weight-change end in the wire form."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from aiohttp import web
from dynamo._core import Context
from dynamo.llm.exceptions import Disconnected

import engine_contract
from bridge import codec
from bridge.codec import RequestError
from bridge.config import BridgeConfig
from bridge.engine import BridgeEngine
from bridge.errors import MIGRATABLE
from engine_contract.v1 import engine_pb2 as pb
from rl_client import driver, wire
from tests.bridge.bridge_fakes import FakeEngine, FakeServer, fake_frontend, frontend_body

GUARDED = 'rollout:{"greedy":true,"weight_version":"step-7"}'


def test_the_annotation_carries_the_version_into_the_rollout_request() -> None:
    spec = codec.parse_request_kind([GUARDED])
    assert spec == codec.RolloutSpec(greedy=True, weight_version="step-7")
    request = {"token_ids": [5, 6], "stop_conditions": {"max_tokens": 3}}
    message = codec.build_rollout_request("r", request, spec)
    assert message.HasField("required_weight_version")
    assert message.required_weight_version == "step-7"
    unguarded = codec.build_rollout_request("r", request, codec.RolloutSpec())
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


async def collect(engine: BridgeEngine, annotation: str, ctx: str) -> list[dict[str, Any]]:
    request = {"token_ids": [5, 6, 7], "annotations": [annotation]}
    return [chunk async for chunk in engine.generate(request, context=Context(id=ctx))]


async def started(server: FakeServer, transport: str = "auto") -> BridgeEngine:
    engine = BridgeEngine(
        BridgeConfig(
            engine_address=server.address,
            model_path="/m",
            connect_timeout_s=5,
            rollout_transport=transport,
        )
    )
    await engine.start(worker_id=1)
    return engine


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    async with FakeServer() as server:
        yield server


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_the_bridge_carries_the_version_to_the_engine_server(
    fake: FakeServer, transport: str
) -> None:
    engine = await started(fake, transport)
    try:
        chunks = await collect(engine, GUARDED, "c1")
        assert chunks[-1]["engine_data"]["rollout"]["token_ids"] == [6, 7, 8]
        await collect(engine, 'rollout:{"greedy":true}', "c2")
    finally:
        await engine.cleanup()
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
    engine = await started(fake)
    try:
        with pytest.raises(Disconnected) as refused:
            await collect(engine, GUARDED, "c1")
    finally:
        await engine.cleanup()
    assert isinstance(refused.value, MIGRATABLE) and refusal in str(refused.value)


async def test_no_guarded_rollout_reaches_a_server_that_would_ignore_the_version() -> None:
    old = FakeEngine(contract_revision=engine_contract.WEIGHT_GUARD_REVISION - 1)
    async with FakeServer(old) as server:
        engine = await started(server)
        try:
            with pytest.raises(Disconnected, match="cannot hold a rollout to a weight version"):
                await collect(engine, GUARDED, "c1")
            assert old.rollouts == []
            # Unguarded rollouts it serves as before.
            assert (await collect(engine, "rollout:{}", "c2"))[-1]["finish_reason"] == "length"
        finally:
            await engine.cleanup()


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
