"""One implementation, three spellings of the RL routes (issue 39 #2).

dynamo.vllm's ``/engine/<name>``, vLLM 0.32's root-level routes and the Dynamo
sidecar's ``/engine/control|update/<name>``, each served by the system port in
front of ``RlAdmin``: the same call in any spelling makes the same RPCs, the same
refusal carries the same message, and only the shapes and status codes differ,
as each original answers them. ``SystemServer`` runs on a real loopback socket;
the engine client is a fake whose stub records every RPC and keeps the engine
server's rules (paused before an update, phase order, the writer's fence).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest

from bridge.admin.answers import ErrorKind, error_kind
from bridge.admin.rl_admin import RlAdmin
from bridge.admin.surface import AdminSurface
from bridge.admin.system_server import SystemPort, SystemServer, free_dynamo_port
from bridge.tagged_mux import rpc_error
from engine_contract.refit_rules import STALE_WRITER, UpdateRefusal
from engine_contract.v1 import engine_pb2 as pb
from harness.ports import free_system_port
from harness.prime_rl import PRIME_RL_ROUTES
from rl_client.admin_token import AdminToken
from rl_client.refit_rpc import RefitRpc
from tests.bridge.bridge_fakes import FakeRegistration, scripted_refit, transfer_after

NOT_PAUSED = UpdateRefusal.NOT_PAUSED.value


@dataclass
class Engine:
    """The engine client RlAdmin calls, keeping the engine server's refit rules."""

    address: str = "fake:1"
    paused: bool = False
    sleeping: bool = False
    version: str = "default"
    declared: bool = False
    changes: int = 0
    transfer: bool = False
    rounds: int = 0  # UpdateWeights rounds of the update open
    reset: bool = True
    data_parallel_size: int = 1
    # Methods answered UNIMPLEMENTED, as an engine server that has none of them.
    unimplemented: set[str] = field(default_factory=set)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    refit: RefitRpc = field(init=False)

    def __post_init__(self) -> None:
        self.refit = scripted_refit(self)

    @property
    def rpcs(self) -> list[str]:
        return [name for name, _ in self.calls if name not in ("IsPaused", "IsSleeping")]

    def request(self, method: str) -> Any:
        return next(r for name, r in reversed(self.calls) if name == method)

    def _fence(self, options_or_request: Any) -> None:
        if options_or_request.HasField("expect_weight_changes"):
            expected = options_or_request.expect_weight_changes
            if expected != self.changes:
                raise rpc_error(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{STALE_WRITER}: expected weight change {expected}, but the engine is at "
                    f"{self.changes} (serving {self.version!r})",
                )

    async def handle(self, method: str, request: Any) -> Any:
        self.calls.append((method, request))
        if method in self.unimplemented:
            raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented")
        answers: dict[str, Any] = {
            "IsPaused": lambda: pb.IsPausedResponse(paused=self.paused),
            "IsSleeping": lambda: pb.IsSleepingResponse(sleeping=self.sleeping),
            "ResetPrefixCache": lambda: pb.ResetPrefixCacheResponse(reset=self.reset),
            "GetWeightVersion": lambda: pb.GetWeightVersionResponse(
                weight_version=self.version,
                declared=self.declared,
                weight_changes=self.changes,
                weights_mixed="a weight-transfer update part way" if self.rounds else "",
                weight_update_open=self.transfer,
            ),
        }
        if method in answers:
            return answers[method]()
        if method == "PauseGeneration":
            self.paused = True
        elif method == "ResumeGeneration":
            self.paused = False
        elif method == "Sleep":
            self.sleeping = True
        elif method == "WakeUp":
            self.sleeping = list(request.tags) == ["weights"]  # a partial wake
            return pb.WakeUpResponse(awake=not self.sleeping)
        elif method == "UpdateWeightVersion":
            self._fence(request)
            self.version, self.declared = request.weight_version, True
            self.changes += 1
            return pb.UpdateWeightVersionResponse(
                weight_version=self.version, weight_changes=self.changes
            )
        elif method == "StartWeightUpdate":
            if not self.paused and not request.options.allow_unpaused:
                raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, NOT_PAUSED)
            self._fence(request.options)
            self.transfer = transfer_after(method, self.transfer)
            self.changes += 1
        elif method in ("UpdateWeights", "FinishWeightUpdate"):
            self.transfer = transfer_after(method, self.transfer)
            self.rounds = self.rounds + 1 if self.transfer else 0
            if method == "FinishWeightUpdate" and request.HasField("weight_version"):
                self.version, self.declared = request.weight_version, True
        return None

    # -- what EngineClient has besides its RefitRpc ------------------------------

    async def serving(self) -> bool:
        return True

    async def abort(self, request_id: str, instance_id: str = "") -> pb.AbortResponse:
        self.aborted.append(request_id)
        return pb.AbortResponse(outcome=pb.ABORT_OUTCOME_ABORTED, aborted_count=1)

    async def abort_all(self) -> pb.AbortResponse:
        self.aborted.append("*")
        return pb.AbortResponse(outcome=pb.ABORT_OUTCOME_ABORTED, aborted_count=3)

    async def server_info(self) -> pb.GetServerInfoResponse:
        config = pb.EngineConfig(data_parallel_size=self.data_parallel_size)
        return pb.GetServerInfoResponse(engine_config=config)


@dataclass
class Port:
    """The system port in front of one fake engine."""

    url: str
    engine: Engine
    session: aiohttp.ClientSession
    headers: dict[str, str] = field(default_factory=dict)

    async def call(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None
    ) -> tuple[int, Any]:
        kwargs: dict[str, Any] = {"headers": self.headers}
        if raw is not None:
            kwargs["data"] = raw
        elif body is not None:
            kwargs["json"] = body
        async with self.session.request(method, self.url + path, **kwargs) as answer:
            return answer.status, await answer.json(content_type=None)

    async def post(self, path: str, body: Any = None) -> tuple[int, Any]:
        return await self.call("POST", path, body)

    async def get(self, path: str) -> tuple[int, Any]:
        return await self.call("GET", path)


@asynccontextmanager
async def system_port(engine: Engine, token: AdminToken | None = None) -> AsyncIterator[Port]:
    admin = RlAdmin(
        lambda: engine,  # type: ignore[arg-type,return-value]
        FakeRegistration(),  # type: ignore[arg-type]
        engine_request_id=lambda request_id: f"engine-{request_id}",
    )
    surface = AdminSurface(admin)
    address = SystemPort("127.0.0.1", free_system_port(), free_dynamo_port())
    server = SystemServer(address, surface.engine_routes, token, http_routes=surface.http_routes)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield Port(address.url, engine, session)
    finally:
        await server.stop()


# -- the same work in every spelling --------------------------------------------------

# One pause and one label, in each spelling: (method, path, body) per step.
SPELLINGS = {
    "dynamo.vllm": [
        ("POST", "/engine/pause_generation", {"mode": "keep", "clear_cache": False}),
        ("POST", "/engine/set_weight_version", {"weight_version": "7", "expect_weight_changes": 0}),
        ("POST", "/engine/resume_generation", {}),
    ],
    "vllm": [
        ("POST", "/pause?mode=keep&clear_cache=false", None),
        ("POST", "/update_weight_version", {"new_version": "7", "expect_weight_changes": 0}),
        ("POST", "/resume", None),
    ],
    "sidecar": [
        ("POST", "/engine/control/pause_generation", {"mode": "keep", "clear_cache": False}),
        (
            "POST",
            "/engine/update/update_weight_version",
            {"new_version": "7", "expect_weight_changes": 0},
        ),
        ("POST", "/engine/control/resume_generation", {}),
    ],
}


async def test_each_spelling_makes_the_same_rpcs_with_the_same_requests() -> None:
    made: dict[str, list[tuple[str, Any]]] = {}
    for spelling, steps in SPELLINGS.items():
        async with system_port(Engine()) as port:
            for method, path, body in steps:
                status, answer = await port.call(method, path, body)
                assert status == 200 and answer.get("status") != "error", (spelling, path, answer)
            made[spelling] = [(name, r) for name, r in port.engine.calls if name != "IsSleeping"]
    assert made["vllm"] == made["dynamo.vllm"] == made["sidecar"]
    pause = made["vllm"][0][1]
    assert pause == pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP, clear_cache=False)
    label = dict(made["vllm"])["UpdateWeightVersion"]
    assert label.weight_version == "7" and label.expect_weight_changes == 0


async def test_each_spelling_answers_in_its_own_shape() -> None:
    async with system_port(Engine()) as port:
        assert await port.post("/pause?mode=keep") == (200, {"status": "paused"})
        assert await port.get("/is_paused") == (200, {"is_paused": True})
        assert await port.post("/engine/control/is_paused") == (200, {"is_paused": True})
        assert await port.post("/update_weight_version", {"new_version": "v1"}) == (
            200,
            {"success": True, "new_version": "v1"},
        )
        assert await port.get("/weight_info") == (200, {"weight_version": "v1"})
        assert await port.post("/engine/control/get_weight_version") == (
            200,
            {"weight_version": "v1"},
        )
        _, dynamo = await port.post("/engine/get_weight_version")
        assert dynamo == {
            "status": "ok",
            "version": "v1",
            "version_declared": True,
            "serving": "v1",
            "weight_changes": 1,
            "weights_mixed": "",
            "weight_update_open": False,
        }
        assert await port.post("/resume") == (200, {"status": "resumed"})
        assert await port.post("/engine/control/resume_generation") == (200, {"status": "resumed"})


async def test_the_defaults_are_each_spellings_own() -> None:
    """vLLM and the sidecar pause with ``abort`` and clear the cache; dynamo.vllm
    keeps the requests and the cache."""
    expected = {
        "/pause": pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT, clear_cache=True),
        "/engine/control/pause_generation": pb.PauseGenerationRequest(
            mode=pb.PAUSE_MODE_ABORT, clear_cache=True
        ),
        "/engine/pause_generation": pb.PauseGenerationRequest(
            mode=pb.PAUSE_MODE_KEEP, clear_cache=False
        ),
    }
    for path, request in expected.items():
        async with system_port(Engine()) as port:
            assert (await port.post(path))[0] == 200
            assert port.engine.request("PauseGeneration") == request, path


# -- the same refusal, each spelling's code -------------------------------------------


async def test_an_engine_refusal_is_one_message_in_three_codes() -> None:
    """Unpaused, a weight update is refused by the engine's rules: vLLM's 500,
    the sidecar's 500 ``Handler error``, dynamo.vllm's 200 ``status: error``."""
    async with system_port(Engine()) as port:
        status, answer = await port.post("/start_weight_update")
        assert status == 500
        assert answer == {
            "error": {
                "message": NOT_PAUSED,
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        assert await port.post("/engine/update/start_weight_update", {}) == (
            500,
            {"error": "Handler error", "message": NOT_PAUSED},
        )
        assert await port.post(
            "/engine/update_weights_from_distributed", {"engine_rpc": "start_weight_update"}
        ) == (200, {"status": "error", "message": NOT_PAUSED})
        assert "StartWeightUpdate" not in port.engine.rpcs  # refused before any RPC


async def test_a_stale_writer_is_refused_in_every_spelling() -> None:
    """The fence (``expect_weight_changes``) on a label and on a transfer's start."""
    async with system_port(Engine(paused=True, changes=4)) as port:
        status, answer = await port.post(
            "/update_weight_version", {"new_version": "x", "expect_weight_changes": 3}
        )
        assert status == 500 and answer["error"]["message"].startswith(STALE_WRITER)
        status, answer = await port.post(
            "/engine/update/update_weight_version", {"new_version": "x", "expect_weight_changes": 3}
        )
        assert status == 500 and answer["message"].startswith(STALE_WRITER)
        status, answer = await port.post(
            "/engine/set_weight_version", {"weight_version": "x", "expect_weight_changes": 3}
        )
        assert status == 200 and answer["message"].startswith(STALE_WRITER)
        status, answer = await port.post("/start_weight_update", {"expect_weight_changes": 3})
        assert status == 500 and answer["error"]["message"].startswith(STALE_WRITER)
        assert port.engine.version == "default" and not port.engine.transfer
        # The right count passes, carried to the engine's start.
        assert await port.post("/start_weight_update", {"expect_weight_changes": 4}) == (
            200,
            {"message": "Weight update started"},
        )
        assert port.engine.request("StartWeightUpdate").options.expect_weight_changes == 4
        # The fence guards where a load begins, not a later phase.
        status, answer = await port.post(
            "/engine/update_weights_from_distributed",
            {"engine_rpc": "update_weights", "update_info": {}, "expect_weight_changes": 5},
        )
        assert answer["status"] == "error" and "fences where a load begins" in answer["message"]


async def test_a_phase_out_of_order_is_refused_naming_the_order() -> None:
    async with system_port(Engine(paused=True)) as port:
        status, answer = await port.post("/update_weights", {"update_info": {"names": []}})
        assert status == 500 and "out of order" in answer["error"]["message"]
        status, answer = await port.post("/engine/update/finish_weight_update", {})
        assert status == 500 and "out of order" in answer["message"]


async def test_what_the_engine_server_lacks_is_vllms_501() -> None:
    async with system_port(Engine(unimplemented={"IsSleeping"})) as port:
        status, answer = await port.get("/is_sleeping")
        assert status == 501 and answer["error"]["type"] == "NotImplementedError"
        status, answer = await port.post("/engine/control/is_sleeping")
        assert status == 500 and answer["error"] == "Handler error"


# -- a bad request, each spelling's code -----------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/pause?mode=bogus", None, "query.mode"),
        ("/pause?clear_cache=maybe", None, "query.clear_cache"),
        ("/sleep?level=3", None, "query.level"),
        ("/sleep?level=x", None, "query.level"),
        ("/get_world_size?include_dp=zz", None, "query.include_dp"),
        ("/update_weight_version", {}, "body.new_version"),
        ("/update_weight_version", {"new_version": 3}, "body.new_version"),
        ("/init_weight_transfer_engine", {}, "body.init_info"),
        ("/init_weight_transfer_engine", {"init_info": 5}, "body.init_info"),
        ("/update_weights", {"update_info": 5}, "body.update_info"),
        ("/finish_weight_update", {"weight_version": 3}, "body.weight_version"),
    ],
)
async def test_vllm_refuses_a_bad_request_400_before_any_rpc(
    path: str, body: Any, param: str
) -> None:
    async with system_port(Engine(paused=True)) as port:
        method = "GET" if path.startswith("/get_world_size") else "POST"
        status, answer = await port.call(method, path, body)
        assert status == 400, answer
        assert set(answer) == {"error"} and answer["error"]["param"] == param
        assert answer["error"]["type"] == "Bad Request" and answer["error"]["code"] == 400
        assert port.engine.rpcs == []


async def test_vllm_reads_a_json_body_only() -> None:
    """As FastAPI does: a body of another content type is not read (its fields
    are missing); invalid JSON is 400; ``/abort_requests`` reads any body."""
    async with system_port(Engine()) as port:
        status, answer = await port.call(
            "POST", "/update_weight_version", raw=b"new_version=x"
        )  # aiohttp: application/octet-stream
        assert status == 400 and answer["error"]["param"] == "body"
        assert (await port.call("POST", "/abort_requests", raw=b"{bad"))[1] == {
            "error": {
                "message": "Invalid JSON format",
                "type": "Bad Request",
                "param": None,
                "code": 400,
            }
        }
        assert (await port.post("/abort_requests", [1]))[1]["error"]["message"] == (
            "Request body must be a JSON object"
        )


async def test_a_bad_control_body_is_the_sidecars_200_and_an_updates_500() -> None:
    """The sidecar checks a control's fields before the engine (200 ``status:
    error``); an update's inside its handler (500); the message is dynamo.vllm's."""
    async with system_port(Engine()) as port:
        _, dynamo = await port.post("/engine/pause_generation", {"mode": "bogus"})
        assert await port.post("/engine/control/pause_generation", {"mode": "bogus"}) == (
            200,
            dynamo,
        )
        assert dynamo == {
            "status": "error",
            "message": "Invalid mode 'bogus'; expected keep|wait|abort",
        }
        assert await port.post("/engine/update/update_weight_version", {"new_version": ""}) == (
            500,
            {"error": "Handler error", "message": "missing non-empty `new_version` string"},
        )
        assert await port.post("/engine/control/is_paused", [1]) == (
            200,
            {"status": "error", "message": "engine control request body must be a JSON object"},
        )
        assert await port.post("/engine/update/start_weight_update", "x") == (
            200,
            {"status": "error", "message": "engine update request body must be a JSON object"},
        )
        status, answer = await port.call("POST", "/engine/control/is_paused", raw=b"{bad")
        assert status == 400 and answer["error"] == "Invalid JSON"
        assert port.engine.rpcs == []


async def test_vllms_methods_are_its_own_and_the_sidecars_any() -> None:
    async with system_port(Engine()) as port:
        for method, path, allow in (("POST", "/is_paused", "GET"), ("GET", "/pause", "POST")):
            async with port.session.request(method, port.url + path) as answer:
                assert answer.status == 405 and answer.headers["Allow"] == allow
                assert await answer.json() == {"detail": "Method Not Allowed"}
        assert await port.get("/engine/control/is_paused") == (200, {"is_paused": False})


# -- the rest of vLLM's routes ------------------------------------------------------------


async def test_abort_requests_by_id_or_all() -> None:
    async with system_port(Engine()) as port:
        assert await port.post("/abort_requests", {"request_ids": ["a", "b"]}) == (
            200,
            {"status": "aborted", "aborted": 2},
        )
        assert await port.post("/abort_requests", {"request_ids": "c"}) == (
            200,
            {"status": "aborted", "aborted": 1},
        )
        # Dynamo's request ids, aborted under the engine's ids as abort_request does.
        assert port.engine.aborted == ["engine-a", "engine-b", "engine-c"]
        assert await port.post("/abort_requests", {}) == (200, {"status": "aborted", "aborted": 3})
        assert port.engine.aborted[-1] == "*"
        status, answer = await port.post("/abort_requests", {"request_ids": [1]})
        assert status == 500 and answer["error"].startswith("Failed to abort requests: ")


async def test_sleep_wake_and_the_cache_in_vllms_words() -> None:
    async with system_port(Engine()) as port:
        assert await port.post("/sleep?level=2&mode=wait") == (
            200,
            {"status": "sleeping", "level": 2},
        )
        assert port.engine.request("Sleep") == pb.SleepRequest(level=2, mode=pb.PAUSE_MODE_WAIT)
        assert await port.get("/is_sleeping") == (200, {"is_sleeping": True})
        assert await port.post("/engine/control/is_sleeping") == (200, {"is_sleeping": True})
        assert await port.post("/wake_up?tags=weights") == (
            200,
            {"status": "sleeping", "tags": ["weights"]},
        )
        assert await port.post("/wake_up") == (200, {"status": "awake", "tags": None})
        assert await port.post("/reset_prefix_cache?reset_running_requests=true") == (
            200,
            {"success": True},
        )
        port.engine.reset = False
        assert await port.post("/reset_prefix_cache") == (200, {"success": False})


async def test_weight_transfer_in_vllms_words() -> None:
    """init, start, update, finish and shutdown, each one RPC, no cache reset after
    a phase (vLLM resets none), the version set with the finish."""
    async with system_port(Engine(paused=True)) as port:
        steps = [
            (
                "/init_weight_transfer_engine",
                {"init_info": {"master_port": 1}},
                "Weight transfer initialized",
            ),
            ("/start_weight_update", None, "Weight update started"),
            ("/update_weights", {"update_info": {"names": ["w"]}}, "Weights updated"),
            ("/finish_weight_update", {"weight_version": "9"}, "Weight update finished"),
            ("/shutdown_weight_transfer_engine", None, "Weight transfer shut down"),
        ]
        # dynamo.vllm's get_weight_version says, besides, whether the update is open
        # and why the weights are not whole (contract revision 12).
        reported = []
        for path, body, message in steps:
            assert await port.post(path, body) == (200, {"message": message}), path
            _, answer = await port.post("/engine/get_weight_version")
            reported.append((answer["weight_update_open"], answer["weights_mixed"]))
        part_way = (True, "a weight-transfer update part way")
        assert reported == [(False, ""), (True, ""), part_way, (False, ""), (False, "")]
        assert [rpc for rpc in port.engine.rpcs if rpc != "GetWeightVersion"] == [
            "InitWeightTransferEngine",
            "StartWeightUpdate",
            "UpdateWeights",
            "FinishWeightUpdate",
            "ShutdownWeightTransferEngine",
        ]
        assert port.engine.version == "9"
        assert await port.get("/get_world_size") == (200, {"world_size": 1})


async def test_the_world_size_counts_data_parallel_replicas_when_asked() -> None:
    async with system_port(Engine(data_parallel_size=2)) as port:
        assert await port.get("/get_world_size") == (200, {"world_size": 2})
        assert await port.get("/get_world_size?include_dp=false") == (200, {"world_size": 1})


# -- one admin token, one listing -------------------------------------------------------------


async def test_the_admin_token_guards_every_spelling() -> None:
    token = AdminToken("t0ken-" + "x" * 20, "test")
    async with system_port(Engine(), token) as port:
        for method, path in (
            ("GET", "/is_paused"),
            ("POST", "/pause"),
            ("POST", "/engine/control/is_paused"),
            ("POST", "/engine/update/update_weight_version"),
            ("POST", "/engine/get_weight_version"),
        ):
            status, answer = await port.call(method, path, {})
            assert status == 401 and answer["status"] == "error", path
        assert port.engine.calls == []
        port.headers = token.header()
        assert await port.get("/is_paused") == (200, {"is_paused": False})
        assert await port.post("/engine/control/is_paused") == (200, {"is_paused": False})


def test_every_route_of_the_three_spellings_is_listed_once() -> None:
    admin = RlAdmin(lambda: None, FakeRegistration())  # type: ignore[arg-type]
    surface = AdminSurface(admin)
    listed = surface.listed()
    assert {"pause_generation", "control/sleep", "update_weights_from_disk"} <= set(listed)
    assert PRIME_RL_ROUTES <= set(listed)
    vllm = {name for name in listed if name.startswith("/")}
    assert vllm == {
        "/pause",
        "/resume",
        "/abort_requests",
        "/is_paused",
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/weight_info",
        "/get_world_size",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/reset_prefix_cache",
    }
    # No path is served twice (the sidecar's sleep and wake are dynamo.vllm's own).
    assert not {f"/engine/{n}" for n in surface.engine_routes} & set(surface.http_routes)


async def test_no_engine_is_a_failure_in_every_spelling() -> None:
    """A bridge not connected to its engine server: the engine's fault, not the caller's."""
    admin = RlAdmin(lambda: None, FakeRegistration())  # type: ignore[arg-type]
    ops = admin.operations()
    answer = await ops["is_paused"]({})
    assert answer["status"] == "error" and error_kind(answer) is ErrorKind.FAILED
