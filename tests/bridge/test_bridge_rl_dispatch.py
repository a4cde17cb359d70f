"""The RL weight-transfer routes dispatch as dynamo.vllm 1.6.1 does (issue 30 #2).

``update_weights_from_distributed`` runs the one phase ``engine_rpc`` names with
the body's other keys as its arguments; ``init_weights_update_group`` takes
``init_info`` as the init info, under ``DYN_RL_INIT_WEIGHTS_TIMEOUT_S``. RlAdmin
runs against a fake engine client whose stub records every RPC and keeps the
engine server's phase order (``engine_contract.refit_rules.PhaseRefusal``).
NeMo RL's calls are replayed by ``DynamoWeightSyncClient`` over real HTTP.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from bridge.admin.weight_transfer import INIT_TIMEOUT_ENV
from engine_contract.refit_rules import PHASE_ORDER, PhaseRefusal
from engine_contract.v1 import engine_pb2 as pb
from rl_client.weight_sync import DynamoWeightSyncClient, RouteError
from tests.bridge.bridge_fakes import (
    TRANSFER_PHASES,
    rl_admin,
    scripted_refit,
    serve_loopback,
    transfer_after,
)

NEMO_FLAGS = {"allow_unpaused": True, "reset_prefix_cache": False}
INIT_INFO = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
UPDATE_INFO = {
    "names": ["a.weight", "b.bias"],
    "dtype_names": ["bfloat16", "float32"],
    "shapes": [[4, 8], [8]],
    "packed": True,
}


class Engine:
    """The engine client RlAdmin calls: RefitRpc around a stub that records
    (method, request) and refuses phases out of order as the engine server does."""

    address = "fake:1"

    def __init__(self, paused: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.paused = paused
        self.in_progress = False
        self.version = "default"
        self.hang_init = False
        self.refit = scripted_refit(self)

    @property
    def rpcs(self) -> list[str]:
        return [name for name, _ in self.calls if name != "IsPaused"]

    def request(self, method: str) -> Any:
        return next(r for name, r in self.calls if name == method)

    async def handle(self, method: str, request: Any) -> Any:
        self.calls.append((method, request))
        if method == "IsPaused":
            return pb.IsPausedResponse(paused=self.paused)
        if method in TRANSFER_PHASES:
            self.in_progress = transfer_after(method, self.in_progress)
            if method == "FinishWeightUpdate" and request.HasField("weight_version"):
                self.version = request.weight_version
        elif method == "UpdateWeightVersion":
            self.version = request.weight_version
        elif method == "InitWeightTransferEngine" and self.hang_init:
            await asyncio.Event().wait()  # a trainer that never connects
        elif method == "ShutdownWeightTransferEngine":
            self.in_progress = False
        return None


def _json_of(raw: bytes) -> Any:
    return json.loads(raw)


# -- update_weights_from_distributed: one phase per call --------------------------------


async def test_nemo_rl_step_runs_each_phase_once_with_its_arguments() -> None:
    engine = Engine()
    admin = rl_admin(engine)
    start = {"engine_rpc": "start_weight_update", "is_checkpoint_format": True, **NEMO_FLAGS}
    answer = await admin.update_weights_from_distributed(start)
    assert answer == {"status": "ok", "version": "unknown", "version_declared": False}
    assert engine.rpcs == ["StartWeightUpdate"]
    options = engine.request("StartWeightUpdate").options
    assert options.allow_unpaused and options.HasField("reset_prefix_cache")
    assert not options.reset_prefix_cache

    engine.calls.clear()
    update = {"engine_rpc": "update_weights", "update_info": UPDATE_INFO, **NEMO_FLAGS}
    assert (await admin.update_weights_from_distributed(update))["status"] == "ok"
    assert engine.rpcs == ["UpdateWeights"]
    # update_info IS the update info: not wrapped, no flags in it.
    assert _json_of(engine.request("UpdateWeights").update_info_json) == UPDATE_INFO

    engine.calls.clear()
    finish = {"engine_rpc": "finish_weight_update", **NEMO_FLAGS}
    assert (await admin.update_weights_from_distributed(finish))["status"] == "ok"
    assert engine.rpcs == ["FinishWeightUpdate"]
    assert not engine.request("FinishWeightUpdate").HasField("weight_version")
    assert engine.calls == [("FinishWeightUpdate", pb.FinishWeightUpdateRequest())]


async def test_finish_labels_the_new_weights_with_the_version_sent() -> None:
    engine = Engine()
    admin = rl_admin(engine)
    await admin.update_weights_from_distributed({"engine_rpc": "start_weight_update", **NEMO_FLAGS})
    answer = await admin.update_weights_from_distributed(
        {"engine_rpc": "finish_weight_update", "weight_version": 7, **NEMO_FLAGS}
    )
    assert answer == {"status": "ok", "version": 7, "version_declared": True}
    assert engine.request("FinishWeightUpdate").weight_version == "7"
    assert "UpdateWeightVersion" not in engine.rpcs  # set with the finish, not after
    assert engine.version == "7"


async def test_reset_and_version_after_the_phase_as_dynamo_does() -> None:
    """dynamo.vllm's defaults: reset_prefix_cache true (paused), and a version sent
    with any phase is set once that phase succeeded."""
    engine = Engine(paused=True)
    admin = rl_admin(engine)
    answer = await admin.update_weights_from_distributed(
        {"engine_rpc": "start_weight_update", "weight_version": "s1"}
    )
    assert answer["status"] == "ok", answer
    assert engine.rpcs == ["StartWeightUpdate", "ResetPrefixCache", "UpdateWeightVersion"]
    assert engine.version == "s1"
    engine.calls.clear()
    await admin.update_weights_from_distributed(
        {"engine_rpc": "update_weights", "update_info": [UPDATE_INFO, UPDATE_INFO]}
    )
    assert engine.rpcs == ["UpdateWeights", "ResetPrefixCache"]
    assert _json_of(engine.request("UpdateWeights").update_info_json) == [UPDATE_INFO] * 2


async def test_the_default_is_update_weights_from_path() -> None:
    engine = Engine(paused=True)
    admin = rl_admin(engine)
    for key in ("weights_path", "model_path", "path"):
        engine.calls.clear()
        answer = await admin.update_weights_from_distributed(
            {key: "/ckpt/9", "weight_version": "9"}
        )
        assert answer == {"status": "ok", "version": "9", "version_declared": True}
        assert engine.rpcs == ["UpdateWeightsFromPath"]
        request = engine.request("UpdateWeightsFromPath")
        assert request.path == "/ckpt/9" and request.options.weight_version == "9"
        assert request.options.reset_prefix_cache  # the engine resets after loading
    engine.calls.clear()
    answer = await admin.update_weights_from_distributed(
        {"engine_rpc": "update_weights_from_path", "weights_path": "/ckpt/10"}
    )
    assert answer["status"] == "ok" and engine.rpcs == ["UpdateWeightsFromPath"]
    engine.calls.clear()
    answer = await admin.update_weights_from_distributed({"names": ["a"]})
    assert answer["status"] == "error" and "Missing 'weights_path'" in answer["message"]
    assert engine.rpcs == []


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"engine_rpc": "start_draft_weight_update"}, "is not one this worker runs"),
        ({"engine_rpc": "bogus"}, "is not one this worker runs"),
        ({"engine_rpc": 3}, "is not one this worker runs"),
        ({"engine_rpc": "update_weights"}, "Missing 'update_info'"),
        ({"engine_rpc": "update_weights", "update_info": [1]}, "must be a JSON object"),
        (
            {"engine_rpc": "update_weights", "update_info": {}, "names": []},
            "unexpected keys: names",
        ),
        ({"engine_rpc": "start_weight_update", "foo": 1}, "unexpected keys: foo"),
        ({"engine_rpc": "start_weight_update", "is_checkpoint_format": False}, "not supported"),
        ({"engine_rpc": "finish_weight_update", "update_info": {}}, "takes no arguments"),
    ],
)
async def test_unknown_phases_and_arguments_are_refused_before_any_rpc(
    body: dict[str, Any], words: str
) -> None:
    engine = Engine()
    answer = await rl_admin(engine).update_weights_from_distributed({**body, **NEMO_FLAGS})
    assert answer["status"] == "error" and words in answer["message"], answer
    if "not one this worker runs" in words:
        assert "start_weight_update, update_weights, finish_weight_update" in answer["message"]
    assert engine.rpcs == []


@pytest.mark.parametrize(
    ("before", "rpc", "refusal"),
    [
        ([], "update_weights", PhaseRefusal.NOT_STARTED),
        ([], "finish_weight_update", PhaseRefusal.NOT_STARTED),
        (["start_weight_update"], "start_weight_update", PhaseRefusal.ALREADY_STARTED),
        (
            ["start_weight_update", "finish_weight_update"],
            "update_weights",
            PhaseRefusal.NOT_STARTED,
        ),
    ],
)
async def test_phases_out_of_order_are_error_answers_naming_the_order(
    before: list[str], rpc: str, refusal: PhaseRefusal
) -> None:
    engine = Engine()
    admin = rl_admin(engine)
    for earlier in before:
        assert (await admin.update_weights_from_distributed({"engine_rpc": earlier, **NEMO_FLAGS}))[
            "status"
        ] == "ok"
    body: dict[str, Any] = {"engine_rpc": rpc, "weight_version": "new", **NEMO_FLAGS}
    if rpc == "update_weights":
        body["update_info"] = UPDATE_INFO
    answer = await admin.update_weights_from_distributed(body)
    assert answer["status"] == "error", answer
    message = answer["message"]
    assert message.startswith(f"engine_rpc '{rpc}' is out of order: {refusal.value}")
    assert PHASE_ORDER in message and "changed nothing" in message
    # Nothing after the refused phase: no version, no reset.
    assert engine.version == "default"
    assert "UpdateWeightVersion" not in engine.rpcs


async def test_not_paused_keeps_dynamo_words_before_the_phase() -> None:
    engine = Engine(paused=False)
    answer = await rl_admin(engine).update_weights_from_distributed(
        {"engine_rpc": "update_weights", "update_info": UPDATE_INFO, "reset_prefix_cache": False}
    )
    assert answer["status"] == "error" and answer["message"].startswith("Worker must be paused")
    assert engine.rpcs == []


# -- the group: init and destroy ----------------------------------------------------------


async def test_init_info_is_the_init_info() -> None:
    engine = Engine()
    answer = await rl_admin(engine).init_weights_update_group(
        {"engine_rpc": "init_weight_transfer_engine", "init_info": INIT_INFO}
    )
    assert answer == {"status": "ok", "message": "Weight update group initialized"}
    assert engine.rpcs == ["InitWeightTransferEngine"]
    request = engine.request("InitWeightTransferEngine")
    assert _json_of(request.init_info_json) == INIT_INFO
    assert request.timeout_ms == 30_000  # dynamo.vllm's default


async def test_a_body_without_init_info_is_the_info_itself() -> None:
    engine = Engine()
    for body in (INIT_INFO, {"engine_rpc": "init_broadcaster", **INIT_INFO}):
        engine.calls.clear()
        assert (await rl_admin(engine).init_weights_update_group(body))["status"] == "ok"
        assert _json_of(engine.request("InitWeightTransferEngine").init_info_json) == INIT_INFO


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"engine_rpc": "init_nccl", "init_info": INIT_INFO}, "is not one this worker runs"),
        ({"engine_rpc": "init_weight_transfer_engine", "init_info": [1]}, "must be a JSON object"),
        ({"init_info": INIT_INFO, "extra": 1}, "unexpected keys: extra"),
    ],
)
async def test_bad_init_bodies_are_refused_before_any_rpc(body: dict[str, Any], words: str) -> None:
    engine = Engine()
    answer = await rl_admin(engine).init_weights_update_group(body)
    assert answer["status"] == "error" and words in answer["message"], answer
    assert engine.rpcs == []


async def test_init_timeout_shuts_the_transfer_engine_down_and_answers_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(INIT_TIMEOUT_ENV, "0.2")
    engine = Engine()
    engine.hang_init = True
    started = asyncio.get_running_loop().time()
    answer = await rl_admin(engine).init_weights_update_group(
        {"engine_rpc": "init_weight_transfer_engine", "init_info": INIT_INFO}
    )
    assert asyncio.get_running_loop().time() - started < 5
    assert answer["status"] == "error"
    assert "did not finish within 0.2 s (DYN_RL_INIT_WEIGHTS_TIMEOUT_S)" in answer["message"]
    assert "was shut down" in answer["message"] and "keeps serving" in answer["message"]
    assert engine.rpcs == ["InitWeightTransferEngine", "ShutdownWeightTransferEngine"]
    # The engine server is told the same deadline, so it gives up too.
    assert engine.request("InitWeightTransferEngine").timeout_ms == 200


async def test_a_huge_init_timeout_fits_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INIT_TIMEOUT_ENV, "1e12")
    engine = Engine()
    assert (await rl_admin(engine).init_weights_update_group({"init_info": {}}))["status"] == "ok"
    assert engine.request("InitWeightTransferEngine").timeout_ms == 2**32 - 1


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan"])
async def test_a_bad_init_timeout_is_an_error_answer(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(INIT_TIMEOUT_ENV, value)
    engine = Engine()
    answer = await rl_admin(engine).init_weights_update_group({"init_info": INIT_INFO})
    assert answer["status"] == "error" and INIT_TIMEOUT_ENV in answer["message"]
    assert engine.rpcs == []


async def test_destroy_is_shutdown_weight_transfer_engine() -> None:
    engine = Engine()
    for body in ({}, {"engine_rpc": "shutdown_weight_transfer_engine"}):
        engine.calls.clear()
        answer = await rl_admin(engine).destroy_weights_update_group(body)
        assert answer == {"status": "ok", "message": "Weight update group destroyed"}
        assert engine.rpcs == ["ShutdownWeightTransferEngine"]
    answer = await rl_admin(engine).destroy_weights_update_group({"engine_rpc": "nope"})
    assert answer["status"] == "error" and "is not one this worker runs" in answer["message"]


# -- the trainer's client: NeMo RL's calls over HTTP -------------------------------------


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Engine, list[tuple[str, Any]]]]:
    """The routes on a loopback port (the admin token checked), recording each body."""
    engine = Engine()
    admin = rl_admin(engine)
    routes = admin.routes()
    bodies: list[tuple[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer tok-1":
            return web.json_response({"status": "error", "message": "no token"}, status=401)
        name = request.match_info["name"]
        body = await request.json()
        bodies.append((name, body))
        return web.json_response(await routes[name](body))

    app = web.Application()
    app.router.add_post("/engine/{name:.+}", handle)
    runner, url = await serve_loopback(app)
    try:
        yield url, engine, bodies
    finally:
        await runner.cleanup()


async def test_the_sync_client_sends_nemo_rl_bodies(
    served: tuple[str, Engine, list[tuple[str, Any]]],
) -> None:
    url, engine, bodies = served
    client = DynamoWeightSyncClient(url, weight_version="v3", admin_token="tok-1")
    await asyncio.to_thread(client.init_weight_transfer_engine, INIT_INFO)
    await asyncio.to_thread(client.start_weight_update)
    await asyncio.to_thread(client.update_weights, UPDATE_INFO)
    await asyncio.to_thread(client.finish_weight_update)
    await asyncio.to_thread(client.shutdown_weight_transfer_engine)
    assert bodies == [
        (
            "init_weights_update_group",
            {"engine_rpc": "init_weight_transfer_engine", "init_info": INIT_INFO},
        ),
        (
            "update_weights_from_distributed",
            {"engine_rpc": "start_weight_update", "is_checkpoint_format": True, **NEMO_FLAGS},
        ),
        (
            "update_weights_from_distributed",
            {"engine_rpc": "update_weights", "update_info": UPDATE_INFO, **NEMO_FLAGS},
        ),
        (
            "update_weights_from_distributed",
            {"engine_rpc": "finish_weight_update", "weight_version": "v3", **NEMO_FLAGS},
        ),
        ("destroy_weights_update_group", {"engine_rpc": "shutdown_weight_transfer_engine"}),
    ]
    assert engine.rpcs == [
        "InitWeightTransferEngine",
        "StartWeightUpdate",
        "UpdateWeights",
        "FinishWeightUpdate",
        "ShutdownWeightTransferEngine",
    ]
    assert engine.version == "v3"
    # An error answer raises with the route's message; a missing token, with HTTP 401.
    with pytest.raises(RouteError, match="out of order"):
        await asyncio.to_thread(client.finish_weight_update)
    anonymous = DynamoWeightSyncClient(url, admin_token="wrong-token")
    with pytest.raises(RouteError, match="HTTP 401"):
        await asyncio.to_thread(anonymous.start_weight_update)
