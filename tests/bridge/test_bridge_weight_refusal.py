"""A version-guarded rollout's refusal judged against the fleet's committed record
(``bridge/weight_refusal.py``, issue 37, 10a): the rules, the wire form, the
bridge answering it to a fake engine server's refusal, and the driver raising it
(at once when the fleet has moved on, after its tries while a refit is under way)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from dynamo.llm.exceptions import Disconnected

from bridge import codec, weight_refusal
from bridge.engine import BridgeEngine
from bridge.errors import MIGRATABLE
from bridge.tagged_mux import rpc_error
from engine_contract.v1 import engine_pb2 as pb
from engine_server.errors import WeightVersionMismatch
from harness.engine import refit_state
from rl_client import driver, wire
from rl_client.committed import (
    CheckpointSource,
    CommittedRecord,
    CommittedWeights,
    FileCommittedStore,
)
from tests.bridge.bridge_fakes import (
    FakeEngine,
    FakeServer,
    annotated_chunks,
    bridge_on,
    fake_frontend,
)

NAMESPACE = "nsrefusal"
GUARDED = 'rollout:{"greedy":true,"weight_version":"step-7"}'
REFUSED = (
    "required_weight_version: the request requires weight version 'step-7', this server "
    "serves 'step-8'; nothing was generated: send it again later or to a server serving "
    "that version"
)


def record(version: str) -> CommittedRecord:
    return CommittedRecord(CommittedWeights(version, CheckpointSource("/ckpt")), ("w",), 1.0)


def state(
    version: str,
    *,
    declared: bool = True,
    paused: bool = False,
    sleeping: bool = False,
    update_open: bool = False,
) -> pb.RefitState:
    """An engine serving ``version``, declared by a refit unless said otherwise."""
    return refit_state(version, declared, paused=paused, sleeping=sleeping, update_open=update_open)


# -- the rules ------------------------------------------------------------------------


def test_an_unpaused_worker_on_the_committed_version_refuses_for_good() -> None:
    refusal = weight_refusal.judge(
        "step-7", state("step-8"), record("step-8"), instance_id="i1", request_id="r1"
    )
    assert refusal is not None and not refusal.retryable
    assert (refusal.required, refusal.serving, refusal.committed) == ("step-7", "step-8", "step-8")
    assert (refusal.instance_id, refusal.request_id) == ("i1", "r1")
    assert "required 'step-7', serving 'step-8', committed 'step-8'" in refusal.message
    assert "not retried" in refusal.message and "worker i1" in refusal.message


@pytest.mark.parametrize(
    ("engine", "why"),
    [
        (state("step-8", paused=True), "paused"),
        (state("step-8", sleeping=True), "asleep"),
        # An unpaused weight-transfer update (NeMo RL's), contract revision 12.
        (state("step-8", update_open=True), "taking a weight-transfer update"),
    ],
)
def test_a_refit_under_way_refuses_for_now(engine: pb.RefitState, why: str) -> None:
    # Whatever the version: the refit may bring it (a newer one, or the committed
    # one back after a failed refit).
    for required in ("step-9", "step-7"):
        refusal = weight_refusal.judge(required, engine, record("step-8"))
        assert refusal is not None and refusal.retryable, required
        assert f"{why} for a refit" in refusal.message
        assert f"required {required!r}, serving 'step-8', committed 'step-8'" in refusal.message


@pytest.mark.parametrize(
    ("required", "engine", "committed"),
    [
        # No record: nothing says what the fleet serves; another worker may serve it.
        ("step-7", state("step-8"), None),
        # The engine serves the version by now (a refit labelled it since).
        ("step-7", state("step-7"), record("step-8")),
        # A worker lagging the record, or paused off it: the others serve the
        # committed version the rollout requires.
        ("step-8", state("step-6"), record("step-8")),
        ("step-8", state("step-9", paused=True), record("step-8")),
        ("step-8", state("step-6", sleeping=True), record("step-8")),
        # Neither the committed version nor the required one here: not judged.
        ("step-7", state("step-6"), record("step-8")),
        # An engine's initial label is its start checkpoint, whatever it reads.
        ("step-7", state("step-8", declared=False), record("step-8")),
    ],
)
def test_anything_else_is_passed_on_migratable(
    required: str, engine: pb.RefitState, committed: CommittedRecord | None
) -> None:
    assert weight_refusal.judge(required, engine, committed) is None


def test_only_the_engines_guard_refusal_is_judged() -> None:
    assert weight_refusal.is_guard_refusal(rpc_error(grpc.StatusCode.ABORTED, REFUSED))
    # As the engine server words and codes it, both ways it refuses.
    for mismatch in (
        WeightVersionMismatch("step-7", "step-8"),
        WeightVersionMismatch("step-7", "step-8", engine_changed=True),
    ):
        assert weight_refusal.is_guard_refusal(rpc_error(mismatch.code, str(mismatch)))
    pause = "aborted by PauseGeneration(ABORT) for a weight update; no partial result"
    assert not weight_refusal.is_guard_refusal(rpc_error(grpc.StatusCode.ABORTED, pause))
    assert not weight_refusal.is_guard_refusal(rpc_error(grpc.StatusCode.UNAVAILABLE, REFUSED))
    assert not weight_refusal.is_guard_refusal(ValueError(REFUSED))


async def test_an_unreadable_state_or_record_passes_the_refusal_on(tmp_path: Path) -> None:
    store = FileCommittedStore(tmp_path, NAMESPACE)
    store.publish(record("step-8"))

    async def load() -> pb.GetLoadResponse:
        return pb.GetLoadResponse(refit_state=state("step-8"))

    async def down() -> pb.GetLoadResponse:
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")

    async def stuck() -> pb.GetLoadResponse:
        await asyncio.sleep(10)
        raise AssertionError("not reached")

    judged = await weight_refusal.refusal_for("step-7", load, store, 1.0)
    assert judged is not None and not judged.retryable
    assert await weight_refusal.refusal_for("step-7", down, store, 1.0) is None
    assert await weight_refusal.refusal_for("step-7", stuck, store, 0.05) is None
    store.path.write_bytes(b"{not json")
    assert await weight_refusal.refusal_for("step-7", load, store, 1.0) is None


# -- the wire form ----------------------------------------------------------------------


def test_the_refusal_round_trips_and_a_malformed_one_is_a_wire_error() -> None:
    refusal = wire.WeightVersionRefusal("a", "b", "b", False, "words", "r", "i")
    assert wire.decode_refusal(wire.encode_refusal(refusal)) == refusal
    good = wire.encode_refusal(refusal)
    for bad in (
        "x",
        {**good, "extra": 1},
        {**good, "retryable": "no"},
        {**good, "serving": 3},
        {k: v for k, v in good.items() if k != "committed"},
    ):
        with pytest.raises(wire.WireError):
            wire.decode_refusal(bad)


def test_the_refusal_chunk_holds_the_refusal_instead_of_a_result() -> None:
    refusal = wire.WeightVersionRefusal("a", "b", "b", False, "words")
    chunk = codec.refusal_chunk(refusal, prompt_tokens=3)
    assert chunk["token_ids"] == [] and chunk["finish_reason"] == "cancelled"
    assert chunk["engine_data"] == {wire.REFUSAL_KEY: wire.encode_refusal(refusal)}
    assert chunk["completion_usage"]["prompt_tokens"] == 3


# -- the bridge, to a fake engine server --------------------------------------------------


@pytest.fixture
async def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeServer]:
    """A fake engine server on "step-8", committed, refusing every rollout as the
    real one refuses "step-7"; the record in a file store the bridge reads."""
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    FileCommittedStore(tmp_path, NAMESPACE).publish(record("step-8"))
    engine = FakeEngine(refit_state=state("step-8"))
    engine.fail_with = (grpc.StatusCode.ABORTED, REFUSED)
    async with FakeServer(engine) as server:
        yield server


def started(
    server: FakeServer, transport: str, catch_up: bool = True
) -> AbstractAsyncContextManager[BridgeEngine]:
    """A bridge reading the committed record from the file store (catch-up on)."""
    return bridge_on(
        server,
        connect_timeout_s=5,
        rollout_transport=transport,
        namespace=NAMESPACE,
        discovery_backend="file",
        catch_up=catch_up,
    )


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_the_bridge_answers_a_refusal_for_good_with_the_versions(
    fake: FakeServer, transport: str
) -> None:
    async with started(fake, transport) as engine:
        (chunk,) = await annotated_chunks(engine, GUARDED)
    refusal = wire.decode_refusal(chunk["engine_data"][wire.REFUSAL_KEY])
    assert not refusal.retryable
    assert (refusal.required, refusal.serving, refusal.committed) == ("step-7", "step-8", "step-8")
    assert refusal.instance_id == "inst-1" and chunk["token_ids"] == []


async def test_the_bridge_answers_a_refusal_during_a_refit_as_retryable(fake: FakeServer) -> None:
    async with started(fake, "stream") as engine:
        fake.engine.refit_state = state("step-8", paused=True)
        (chunk,) = await annotated_chunks(engine, GUARDED)
    refusal = wire.decode_refusal(chunk["engine_data"][wire.REFUSAL_KEY])
    assert refusal.retryable and "paused for a refit" in refusal.message


async def test_without_a_record_or_catch_up_the_refusal_stays_migratable(
    fake: FakeServer, tmp_path: Path
) -> None:
    for catch_up in (False, True):
        if catch_up:
            FileCommittedStore(tmp_path, NAMESPACE).delete()
        async with started(fake, "stream", catch_up=catch_up) as engine:
            with pytest.raises(Disconnected) as refused:
                await annotated_chunks(engine, GUARDED)
        assert isinstance(refused.value, MIGRATABLE) and REFUSED in str(refused.value)
    # Without catch-up the engine's state was not even asked.
    assert fake.engine.loads == 1


async def test_other_failures_of_a_guarded_rollout_go_on_as_before(fake: FakeServer) -> None:
    fake.engine.fail_with = (grpc.StatusCode.ABORTED, "aborted by PauseGeneration(ABORT)")
    async with started(fake, "stream") as engine:
        with pytest.raises(Disconnected, match="PauseGeneration"):
            await annotated_chunks(engine, GUARDED)
    assert fake.engine.loads == 0


# -- the driver -----------------------------------------------------------------------------


async def frontend(refusals: list[wire.WeightVersionRefusal | None]) -> tuple[Any, str, list[Any]]:
    """A frontend answering each try with the next refusal (None: a rollout of step-7)."""
    seen: list[Any] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        refusal = refusals[len(seen) - 1]
        if refusal is None:
            rollout = {
                "version": wire.WIRE_VERSION,
                "token_ids": [4],
                "logprobs": wire.encode_logprobs([-0.5]),
                "truncated": False,
                "finish_reason": "stop",
                "weight_versions": [{"version": "step-7", "start": 0, "end": 1}],
            }
            engine_data: dict[str, Any] = {wire.WIRE_KEY: rollout}
        else:
            engine_data = codec.refusal_chunk(refusal, 3)["engine_data"]
        body = {
            "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
            "nvext": {"engine_data": engine_data},
        }
        return web.json_response(body)

    runner, url = await fake_frontend(handler)
    return runner, url, seen


FAST = driver.RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02)
STALE = wire.WeightVersionRefusal("step-7", "step-8", "step-8", False, "refused for good")
UNDER_WAY = wire.WeightVersionRefusal("step-7", "step-6", "step-6", True, "refused for now")


async def test_the_driver_never_retries_a_version_the_fleet_moved_on_from() -> None:
    runner, url, seen = await frontend([STALE, None, None])
    try:
        async with driver.RolloutClient(url, "m", retry=FAST) as client:
            with pytest.raises(driver.WeightVersionRefusedError) as refused:
                await client.rollout([1, 2], weight_version="step-7")
    finally:
        await runner.cleanup()
    assert len(seen) == 1
    err = refused.value
    assert (err.required, err.serving, err.committed, err.retryable) == (
        "step-7",
        "step-8",
        "step-8",
        False,
    )
    assert str(err) == "refused for good"


async def test_the_driver_retries_a_refusal_during_a_refit() -> None:
    runner, url, seen = await frontend([UNDER_WAY, None, None])
    try:
        async with driver.RolloutClient(url, "m", retry=FAST) as client:
            result = await client.rollout([1, 2], weight_version="step-7", request_id="r")
            assert len(seen) == 2 and result.weight_version == "step-7"
            seen.clear()
        runner2, url2, seen2 = await frontend([UNDER_WAY] * 3)
        try:
            async with driver.RolloutClient(url2, "m", retry=FAST) as client:
                with pytest.raises(driver.WeightVersionRefusedError) as refused:
                    await client.rollout([1, 2], weight_version="step-7")
            assert len(seen2) == 3 and refused.value.retryable
        finally:
            await runner2.cleanup()
    finally:
        await runner.cleanup()


def test_a_refusal_without_words_still_names_the_versions() -> None:
    refusal = wire.WeightVersionRefusal("a", "b", "c", False, "")
    body = {"nvext": {"engine_data": {wire.REFUSAL_KEY: wire.encode_refusal(refusal)}}}
    with pytest.raises(driver.WeightVersionRefusedError, match="required 'a', serving 'b'"):
        driver.parse_rollout_response(body)
