"""BridgeEngine against an in-process fake engine server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from dynamo._core import Context
from dynamo.common.backend.health_check import is_probe
from dynamo.common.backend.publisher import PushSource
from dynamo.llm.exceptions import Disconnected, InvalidArgument

import engine_contract
from bridge.client import EngineNotReadyError, IncompatibleServerError
from bridge.config import BridgeConfig
from bridge.engine import BridgeEngine
from harness.waits import wait_until_async
from rl_client import wire
from tests.bridge.bridge_fakes import FakeEngine, FakeServer, bridge_on

pytestmark = pytest.mark.serial


def bridge_for(address: str, timeout: float = 5.0) -> BridgeEngine:
    return BridgeEngine(
        BridgeConfig(engine_address=address, model_path="/m", connect_timeout_s=timeout)
    )


async def collect(engine: BridgeEngine, request: dict[str, Any], ctx: Context) -> list[dict]:
    return [chunk async for chunk in engine.generate(request, context=ctx)]


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeServer, BridgeEngine]]:
    async with FakeServer() as server, bridge_on(server, connect_timeout_s=5.0) as engine:
        yield server, engine


async def test_start_registers_the_engine_configuration(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    _, engine = served
    config = await engine.start(worker_id=1)
    assert config.model == "/m" and config.served_model_name == "fake-model"
    llm = config.llm
    assert llm is not None
    assert (
        llm.context_length,
        llm.kv_cache_block_size,
        llm.total_kv_blocks,
        llm.max_num_seqs,
        llm.max_num_batched_tokens,
    ) == (512, 4, 100, 8, 256)


async def test_a_server_older_than_the_window_refused_with_a_clear_message() -> None:
    old = engine_contract.MINIMUM_SERVER_REVISION - 1
    async with FakeServer(FakeEngine(contract_revision=old)) as server:
        engine = bridge_for(server.address)
        says = (
            f"implements contract revision {old}, but this bridge needs at least revision "
            f"{old + 1}: upgrade the engine server"
        )
        with pytest.raises(IncompatibleServerError, match=says):
            await engine.start(worker_id=1)
        await engine.cleanup()
        await engine.cleanup()


async def test_server_that_needs_a_newer_bridge_refused() -> None:
    fake = FakeEngine(minimum_client_revision=engine_contract.CONTRACT_REVISION + 1)
    async with FakeServer(fake) as server:
        engine = bridge_for(server.address)
        with pytest.raises(IncompatibleServerError, match="refused this bridge"):
            await engine.start(worker_id=1)
        await engine.cleanup()


async def test_cleanup_after_failed_start_and_twice() -> None:
    engine = bridge_for("127.0.0.1:1", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(EngineNotReadyError, match="not ready after"):
        await engine.start(worker_id=1)
    assert time.monotonic() - started < 5
    await engine.cleanup()
    await engine.cleanup()
    never_started = bridge_for("127.0.0.1:1")
    await never_started.cleanup()


async def test_rollout_is_one_chunk_with_engine_data(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    server, engine = served
    request = {
        "token_ids": [5, 6, 7],
        "stop_conditions": {"max_tokens": 2},
        "annotations": ['rollout:{"greedy":true,"request_id":"mine"}'],
    }
    chunks = await collect(engine, request, Context(id="ctx-1"))
    assert len(chunks) == 1
    chunk = chunks[0]
    assert (
        chunk["token_ids"] == [6, 7] and chunk["text"] == "" and chunk["finish_reason"] == "length"
    )
    data = chunk["engine_data"]["rollout"]
    assert data["token_ids"] == [6, 7]
    assert wire.decode_logprobs(data["logprobs"], data["version"]) == [-0.5, -1.0]
    sent = server.engine.rollouts[0]
    assert sent.request_id == "mine" and sent.greedy and sent.max_new_tokens == 2


async def test_ordinary_completion_streams(served: tuple[FakeServer, BridgeEngine]) -> None:
    server, engine = served
    chunks = await collect(
        engine, {"token_ids": [1, 2], "output_options": {"logprobs": 0}}, Context(id="ctx-2")
    )
    # Deltas that queue up while a write is in flight arrive merged (Generates stream).
    assert [t for c in chunks for t in c["token_ids"]] == [10, 11, 12, 13]
    assert [lp for c in chunks for lp in c.get("log_probs", [])] == [-1.0] * 4
    assert all("finish_reason" not in c for c in chunks[:-1])
    assert chunks[-1]["finish_reason"] == "length"
    assert server.engine.generate_streams == 1
    assert chunks[-1]["completion_usage"]["completion_tokens"] == 4
    assert server.engine.generates[0].request_id == "ctx-2"
    assert server.engine.generates[0].output.logprobs == 0


async def test_bad_annotation_and_engine_invalid_argument(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    server, engine = served
    with pytest.raises(InvalidArgument, match="unknown keys"):
        await collect(
            engine, {"token_ids": [1], "annotations": ['rollout:{"x":1}']}, Context(id="c")
        )
    server.engine.fail_with = (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[0] too big")
    with pytest.raises(InvalidArgument, match=r"prompt_token_ids\[0\] too big"):
        await collect(engine, {"token_ids": [1], "annotations": ["rollout:{}"]}, Context(id="d"))


async def test_an_out_of_vocabulary_token_data_id_keeps_the_engines_message(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    """NeMo-Gym's chat path (``nvext.token_data`` as the prompt, ``engine_data``
    asked for): the engine server's refusal of an id reaches the client as
    Dynamo's InvalidArgument (HTTP 400) with its message whole, naming the id,
    its position and the vocabulary; never a bare "Invalid request". (Ids past
    the tokenizer's vocabulary never get here: Dynamo's frontend refuses them.)"""
    server, engine = served
    refusal = "prompt_token_ids[2]: token id 1500 is outside the vocabulary [0, 1000)"
    server.engine.fail_with = (grpc.StatusCode.INVALID_ARGUMENT, refusal)
    chat = {
        "token_ids": [5, 6, 1500],
        "stop_conditions": {"max_tokens": 4},
        "extra_args": {"nvext": {"extra_fields": ["engine_data"], "token_in": True}},
    }
    with pytest.raises(InvalidArgument) as refused:
        await collect(engine, chat, Context(id="gym"))
    assert str(refused.value) == refusal
    assert list(server.engine.generates[-1].prompt_token_ids) == [5, 6, 1500]


async def test_abort_cancels_and_tells_the_engine(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    server, engine = served
    server.engine.hold_rollout = True
    ctx = Context(id="ctx-abort")
    task = asyncio.create_task(
        collect(engine, {"token_ids": [1], "annotations": ["rollout:{}"]}, ctx)
    )
    await wait_until_async(lambda: server.engine.running, 5, "the rollout running")
    assert server.engine.running == {"ctx-abort"}
    ctx.stop_generating()
    await engine.abort(ctx)
    chunks = await asyncio.wait_for(task, 5)
    assert chunks[-1]["finish_reason"] == "cancelled"
    assert [(a.request_id, a.instance_id) for a in server.engine.aborts] == [
        ("ctx-abort", "inst-1")
    ]
    await wait_until_async(lambda: not server.engine.running, 5, "the rollout ended")
    assert engine.inflight_request_ids() == []


async def test_an_abort_for_an_earlier_attempt_of_a_migrated_request_stops_nothing(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    """The frontend's migration sends a failed request again under the same context
    id, often to the same worker; the kill of the failed attempt can reach the
    worker after the next attempt started. Only the attempt Dynamo ended stops."""
    server, engine = served
    server.engine.hold_rollout = True
    rollout = {"token_ids": [1, 2], "annotations": ["rollout:{}"]}
    again = Context(id="migrated")
    task = asyncio.create_task(collect(engine, rollout, again))
    await wait_until_async(lambda: server.engine.running, 5, "the second attempt running")
    earlier = Context(id="migrated")
    earlier.stop_generating()
    await engine.abort(earlier)
    assert server.engine.aborts == []
    assert not task.done()
    server.engine.release("migrated")
    chunks = await asyncio.wait_for(task, 5)
    assert chunks[-1]["finish_reason"] == "length"
    assert wire.WIRE_KEY in chunks[-1]["engine_data"]
    assert engine.inflight_request_ids() == []


async def test_an_abort_ends_the_attempt_dynamo_ended_and_leaves_the_later_one(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    """Both attempts of a migrated request still here (the first one's stream
    broke while its call ran): the abort of the first ends it alone, by
    cancelling its call; an engine abort by the id they share would end both."""
    server, engine = served
    server.engine.hold_rollout = True
    rollout = {"token_ids": [1, 2], "annotations": ["rollout:{}"]}
    first, again = Context(id="overlap"), Context(id="overlap")
    first_task = asyncio.create_task(collect(engine, rollout, first))
    await wait_until_async(lambda: len(server.engine.rollouts) == 1, 5, "the first attempt")
    again_task = asyncio.create_task(collect(engine, rollout, again))
    await wait_until_async(lambda: len(server.engine.rollouts) == 2, 5, "the second attempt")
    first.stop_generating()
    await engine.abort(first)
    assert (await asyncio.wait_for(first_task, 5))[-1]["finish_reason"] == "cancelled"
    assert server.engine.aborts == []
    assert not again_task.done()
    server.engine.release("overlap")
    chunks = await asyncio.wait_for(again_task, 5)
    assert wire.WIRE_KEY in chunks[-1]["engine_data"]
    assert engine.inflight_request_ids() == []


async def test_lost_engine_server_is_disconnected_not_a_hang() -> None:
    server = FakeServer(FakeEngine(generate_tokens=1000, generate_delay_s=0.01))
    await server.__aenter__()
    async with bridge_on(server, connect_timeout_s=5.0) as engine:
        gen = engine.generate({"token_ids": [1]}, context=Context(id="x"))
        first = await gen.__anext__()
        assert first["token_ids"] == [10]
        await server.server.stop(grace=None)
        with pytest.raises(Disconnected):
            async with asyncio.timeout(10):
                async for _ in gen:
                    pass
        # And a new request fails fast too.
        with pytest.raises(Disconnected):
            async with asyncio.timeout(10):
                await collect(
                    engine, {"token_ids": [1], "annotations": ["rollout:{}"]}, Context(id="y")
                )


async def test_the_kv_event_source_subscribes_with_a_snapshot_and_cleanup_is_idempotent(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    server, engine = served
    sources = await engine.kv_event_sources()
    assert len(sources) == 1 and isinstance(sources[0], PushSource)
    await wait_until_async(lambda: server.engine.kv_requests, 5, "a KV-event subscription")
    assert server.engine.kv_requests[0].include_snapshot
    await engine.cleanup()
    await engine.cleanup()


async def test_health_probe_follows_the_engine_servers_health(
    served: tuple[FakeServer, BridgeEngine],
) -> None:
    """Dynamo's canary: answered from the server's gRPC health, never run on the engine."""
    server, engine = served
    payload = await engine.health_check_payload()
    assert payload is not None and is_probe(payload)
    chunks = await collect(engine, dict(payload), Context())
    assert chunks == [{"token_ids": [], "index": 0, "finish_reason": "stop"}]
    assert server.engine.generates == [] and server.engine.rollouts == []
    await server.set_serving(False)
    with pytest.raises(Disconnected, match="not serving"):
        await collect(engine, dict(payload), Context())
