"""The system port's admin surface: the token (issue 28 #3), strict JSON and
printable version labels (#4), and pause_generation's boolean (#5).

SystemServer runs on a real loopback socket in front of a stand-in for Dynamo's
own system server; RlAdmin runs against a fake engine client that records RPCs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bridge.admin import system_server
from bridge.admin.auth import exposure_warning, is_loopback
from bridge.admin.system_server import SystemPort, SystemServer, strict_json
from bridge.config import MODEL_FILES, parse_args
from engine_contract.v1 import engine_pb2 as pb
from harness.ports import free_system_port
from rl_client.admin_token import MAX_TOKEN_BYTES, TOKEN_ENV, TOKEN_FILE_ENV, AdminToken
from rl_client.refit import RefitClient
from rl_client.refit_rpc import RefitRpc
from rl_client.weight_sync import RouteError
from tests.bridge.bridge_fakes import rl_admin, serve_loopback

TOKEN = "s3cret-Token_0123456789"


# -- the token ---------------------------------------------------------------------


def test_token_file_is_read_stripped_and_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    token = AdminToken.from_file(path)
    assert token.matches(f"Bearer {TOKEN}") and token.matches(f"bearer  {TOKEN} ")
    assert token.header() == {"Authorization": f"Bearer {TOKEN}"}
    for wrong in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer", "Bearer é"):
        assert not token.matches(wrong), wrong
    assert TOKEN not in repr(token) and str(path) in repr(token)


@pytest.mark.parametrize("content", ["", "\n", "  \t\n"])
def test_an_empty_token_file_is_refused_naming_the_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty-token"
    path.write_text(content)
    with pytest.raises(ValueError, match="empty") as refused:
        AdminToken.from_file(path)
    assert str(path) in str(refused.value)
    with pytest.raises(ValueError, match=r"cannot read the admin token file .*missing"):
        AdminToken.from_file(tmp_path / "missing")


def test_a_token_is_visible_ascii_and_never_quoted() -> None:
    with pytest.raises(ValueError, match="index 3") as refused:
        AdminToken("abc def", "test")
    assert "abc" not in str(refused.value)
    with pytest.raises(ValueError, match="index 1"):
        AdminToken("aé", "test")


def test_token_sources_file_then_environment() -> None:
    assert AdminToken.resolve(None, {}) is None
    token = AdminToken.resolve(None, {TOKEN_ENV: TOKEN})
    assert token is not None and token.matches(f"Bearer {TOKEN}")
    # Set but empty: refused, not taken as "no token" (fail closed).
    with pytest.raises(ValueError, match=r"\$BRIDGE_ADMIN_TOKEN is empty"):
        AdminToken.resolve(None, {TOKEN_ENV: " "})
    assert AdminToken.from_env({}) is None


def bridge_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A bridge command line on a model folder of its own, no token in the environment."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    for name in MODEL_FILES:
        (model / name).write_text("{}")
    return ["--engine", "h:1", "--model-path", str(model)]


def test_the_cli_takes_a_token_file_and_refuses_an_empty_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = bridge_args(tmp_path, monkeypatch)
    assert parse_args(base)[0].admin_token is None
    good = tmp_path / "token"
    good.write_text(TOKEN + "\n")
    config = parse_args([*base, "--admin-token-file", str(good)])[0]
    assert config.admin_token is not None and config.admin_token.matches(f"Bearer {TOKEN}")
    assert TOKEN not in repr(config)
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(SystemExit):
        parse_args([*base, "--admin-token-file", str(empty)])
    assert f"the admin token from file {empty} is empty" in capsys.readouterr().err
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    config = parse_args(base)[0]
    assert config.admin_token is not None and config.admin_token.source == f"${TOKEN_ENV}"


def test_a_token_over_the_cap_is_refused_at_start_naming_source_and_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token past what one header field carries would have every request refused
    (HTTP 400/431): the bridge exits at start instead, saying where it came from
    and how long it is, never quoting it."""
    base = bridge_args(tmp_path, monkeypatch)
    long = "T" * 9000
    path = tmp_path / "long-token"
    path.write_text(long + "\n")
    with pytest.raises(SystemExit) as exited:
        parse_args([*base, "--admin-token-file", str(path)])
    assert exited.value.code not in (0, None)
    err = capsys.readouterr().err
    assert f"the admin token from file {path} is 9000 bytes long" in err
    assert str(MAX_TOKEN_BYTES) in err and long[:100] not in err
    with pytest.raises(ValueError, match=rf"\$BRIDGE_ADMIN_TOKEN is {MAX_TOKEN_BYTES + 1} bytes"):
        AdminToken.resolve(None, {TOKEN_ENV: "T" * (MAX_TOKEN_BYTES + 1)})
    # The cap itself is taken, and leaves the header inside the server's limit.
    AdminToken("T" * MAX_TOKEN_BYTES, "test")
    assert len(f"Authorization: Bearer {'T' * MAX_TOKEN_BYTES}") < system_server.MAX_LINE_BYTES


def test_exposure_warning_only_beyond_loopback_without_a_token() -> None:
    token = AdminToken(TOKEN, "test")
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host) and exposure_warning(host, 1, None) is None
    for host in ("0.0.0.0", "", "::", "10.1.2.3", "worker-0.example"):
        assert not is_loopback(host)
        warning = exposure_warning(host, 8081, None)
        assert warning is not None and "--admin-token-file" in warning
        assert "DYN_SYSTEM_HOST=127.0.0.1" in warning and TOKEN_ENV in warning
        assert exposure_warning(host, 8081, token) is None


# -- the system server -------------------------------------------------------------


@dataclass
class Upstream:
    """Stands in for Dynamo's own system server; records what reached it."""

    url: str
    port: int
    seen: list[str] = field(default_factory=list)
    # The Authorization headers that reached it (the token must not).
    authorization: list[str | None] = field(default_factory=list)


@dataclass
class Served:
    url: str
    upstream: Upstream
    calls: list[tuple[str, Any]]


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    seen: list[str] = []
    authorization: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.path)
        authorization.append(request.headers.get("Authorization"))
        return web.json_response({"upstream": request.path})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner, url = await serve_loopback(app)
    yield Upstream(url, runner.addresses[0][1], seen, authorization)
    await runner.cleanup()


@asynccontextmanager
async def _serving(
    upstream: Upstream, token: AdminToken | None, host: str = "127.0.0.1"
) -> AsyncIterator[Served]:
    """A SystemServer in front of ``upstream``, stopped after the block."""
    calls: list[tuple[str, Any]] = []

    def route(name: str, answer: dict[str, Any]) -> Any:
        async def handler(body: Any) -> dict[str, Any]:
            calls.append((name, body))
            return answer

        return handler

    routes = {
        "pause_generation": route("pause_generation", {"status": "ok"}),
        "control/sleep": route("control/sleep", {"status": "ok"}),
        "nan_answer": route("nan_answer", {"status": "ok", "version": math.nan}),
    }
    port = free_system_port()
    server = SystemServer(SystemPort(host, port, upstream.port), routes, token)
    await server.start()
    try:
        yield Served(f"http://127.0.0.1:{port}", upstream, calls)
    finally:
        await server.stop()


async def _call(
    url: str, body: bytes | None = None, headers: dict[str, str] | None = None, method: str = "POST"
) -> tuple[int, Any, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, data=body, headers=headers or {}) as resp,
    ):
        text = await resp.text()
        return resp.status, json.loads(text, parse_constant=_no_constant), resp.headers


def _no_constant(name: str) -> Any:
    raise AssertionError(f"the answer holds {name}: not JSON")


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_with_a_token_every_admin_path_needs_it_and_probes_stay_open(
    upstream: Upstream,
) -> None:
    async with _serving(upstream, AdminToken(TOKEN, "test")) as s:
        for path in ("/engine/pause_generation", "/engine/control/sleep"):
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                status, answer, resp_headers = await _call(s.url + path, b"{}", headers)
                assert status == 401, (path, headers, status)
                assert answer["status"] == "error" and "admin token" in answer["message"]
                assert resp_headers["WWW-Authenticate"].startswith("Bearer")
        assert s.calls == []  # no route ran
        # Dynamo's own routes behind us, under any spelling of the path: refused
        # before they reach it.
        for path in (
            "/engine/control/start_profile",
            "/engine/no_such_route",
            "//engine/pause_generation",
            "/%65ngine/pause_generation",
            "/health/../engine/pause_generation",
            "/metadata",
            "/",
        ):
            status, _, _ = await _call(s.url + path, b"{}")
            assert status == 401, (path, status)
        assert upstream.seen == []
        # The probes need nothing.
        for path in ("/health", "/live", "/metrics"):
            status, answer, _ = await _call(s.url + path, method="GET")
            assert status == 200 and answer == {"upstream": path}
        # With the token: our routes and Dynamo's.
        status, answer, _ = await _call(s.url + "/engine/pause_generation", b"{}", AUTH)
        assert status == 200 and answer == {"status": "ok"}
        assert s.calls == [("pause_generation", {})]
        status, answer, _ = await _call(s.url + "/engine/control/start_profile", b"{}", AUTH)
        assert status == 200 and answer == {"upstream": "/engine/control/start_profile"}
        assert upstream.authorization == [None] * 4  # the token stays with us


async def test_a_token_of_the_largest_length_passes_the_real_server(upstream: Upstream) -> None:
    longest = "T" * MAX_TOKEN_BYTES
    async with _serving(upstream, AdminToken(longest, "test")) as s:
        headers = {"Authorization": f"Bearer {longest}"}
        status, answer, _ = await _call(s.url + "/engine/pause_generation", b"{}", headers)
        assert status == 200 and answer == {"status": "ok"}


async def _raw(port: int, data: bytes) -> bytes:
    """What the server answers to ``data`` sent as is (no client parsing it first)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_an_unparsable_request_is_answered_without_its_bytes_in_any_log(
    upstream: Upstream, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp's own answer quotes a refused header back and logs a traceback
    carrying it (an oversized token's first ~94 characters): ours is 431 for a
    line or field over the limit, 400 for a malformed one, one log line for many,
    and no byte of the request anywhere in the log."""
    caplog.set_level(logging.DEBUG)  # aiohttp's loggers too
    secret = "SeCrEt-" * 2000  # about 14 KB: over the field limit
    async with _serving(upstream, AdminToken(TOKEN, "test")) as s:
        served = int(s.url.rsplit(":", 1)[1])
        for _ in range(3):
            answer = await _raw(
                served,
                f"GET /engine/pause_generation HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {secret}\r\n\r\n".encode(),
            )
            assert answer.startswith(b"HTTP/1.0 431 "), answer[:200]
            assert b"SeCrEt" not in answer
        over_line = await _raw(served, f"GET /{secret} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert over_line.startswith(b"HTTP/1.0 431 ") and b"SeCrEt" not in over_line
        for malformed in (
            b"GET /health HTTP/1.1\r\nHost: x\r\nSeCrEt header\r\n\r\n",
            b"SeCrEt\x01 /health HTTP/1.1\r\nHost: x\r\n\r\n",
        ):
            answer = await _raw(served, malformed)
            assert answer.startswith(b"HTTP/1.0 400 ") and b"SeCrEt" not in answer
        # Still serving, and the token still works.
        status, _, _ = await _call(s.url + "/engine/pause_generation", b"{}", AUTH)
        assert status == 200
        lines = [r.getMessage() for r in caplog.records if "answered 4" in r.getMessage()]
        assert len(lines) == 1 and "answered 431" in lines[0], lines
        # The next line, once due, counts those it held back.
        monkeypatch.setattr(system_server, "_UNPARSABLE_LOG_INTERVAL_S", 0.0)
        await _raw(served, b"GET /health HTTP/1.1\r\nHost: x\r\nSeCrEt header\r\n\r\n")
    lines = [r.getMessage() for r in caplog.records if "answered 4" in r.getMessage()]
    assert len(lines) == 2 and "(6 such since" in lines[1], lines
    assert "SeCrEt" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info], "no traceback"


async def test_without_a_token_the_routes_are_open_as_before(upstream: Upstream) -> None:
    async with _serving(upstream, None) as s:
        status, answer, _ = await _call(s.url + "/engine/pause_generation", b"{}")
        assert status == 200 and answer == {"status": "ok"}
        status, _, _ = await _call(s.url + "/engine/control/start_profile", b"{}")
        assert status == 200 and upstream.seen == ["/engine/control/start_profile"]


async def test_refit_client_sends_the_token(
    upstream: Upstream, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    async with _serving(upstream, AdminToken(TOKEN, "test")) as s:
        async with RefitClient([s.url]) as anonymous:
            with pytest.raises(RouteError, match="HTTP 401"):
                await anonymous.call(s.url, "pause_generation")
        async with RefitClient([s.url], admin_token=TOKEN) as given:
            assert await given.call(s.url, "pause_generation") == {"status": "ok"}
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        async with RefitClient([s.url]) as from_env:
            assert await from_env.call(s.url, "pause_generation") == {"status": "ok"}
        monkeypatch.delenv(TOKEN_ENV)
        path = tmp_path / "token"
        path.write_text(TOKEN)
        monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
        async with RefitClient([s.url]) as from_file:
            assert await from_file.call(s.url, "pause_generation") == {"status": "ok"}
        async with RefitClient([s.url], admin_token="wrong") as wrong:
            with pytest.raises(RouteError, match="HTTP 401"):
                await wrong.call(s.url, "pause_generation")
        assert len(s.calls) == 3


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [("0.0.0.0", None, True), ("0.0.0.0", TOKEN, False), ("127.0.0.1", None, False)],
)
async def test_start_warns_once_when_open_beyond_loopback(
    upstream: Upstream,
    caplog: pytest.LogCaptureFixture,
    host: str,
    token: str | None,
    warned: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="bridge")
    async with _serving(upstream, AdminToken(token, "test") if token else None, host):
        pass
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (1 if warned else 0), [r.getMessage() for r in warnings]
    if warned:
        assert "with no admin token" in warnings[0].getMessage()
    assert all(TOKEN not in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
async def test_non_json_constants_are_invalid_json(upstream: Upstream, constant: str) -> None:
    async with _serving(upstream, None) as s:
        body = f'{{"weight_version": {constant}}}'.encode()
        status, answer, _ = await _call(s.url + "/engine/pause_generation", body)
        assert status == 400 and answer["error"] == "Invalid JSON", answer
        assert constant in answer["message"]
        assert s.calls == []
        with pytest.raises(ValueError):
            strict_json(body)
        assert strict_json(b'{"weight_version": 1e999}') == {"weight_version": math.inf}


async def test_an_answer_never_leaves_as_non_json(upstream: Upstream) -> None:
    async with _serving(upstream, None) as s:
        status, answer, _ = await _call(s.url + "/engine/nan_answer", b"{}")
        assert status == 500 and answer["status"] == "error"


# -- the routes: labels and booleans ------------------------------------------------------


class FakeClient:
    """The engine client RlAdmin calls; its typed refit RPCs run on a stub that
    records every RPC by name."""

    address = "fake:1"

    def __init__(self, paused: bool = True) -> None:
        self.rpcs: list[str] = []
        self.requests: list[Any] = []
        self.paused = paused
        self.refit = RefitRpc(_RecordingStub(self))  # type: ignore[arg-type]


class _RecordingStub:
    def __init__(self, client: FakeClient) -> None:
        self._client = client

    def __getattr__(self, method: str) -> Any:
        async def call(request: Any, timeout: float | None = None) -> Any:
            self._client.rpcs.append(method)
            self._client.requests.append(request)
            if method == "IsPaused":
                return pb.IsPausedResponse(paused=self._client.paused)
            answer = getattr(pb, f"{method}Response", None)  # each RPC's empty answer
            return answer() if answer is not None else None

        return call


BAD_LABELS = [
    (math.nan, "finite"),
    (math.inf, "finite"),
    (-math.inf, "finite"),
    ("v\x001", "control character U+0000"),
    ("v1\nforged log line", "control character U+000A"),
    ("v\u202e1", "format character U+202E"),
    ("", "must not be empty"),
    ("x" * 300, "more than the limit"),
]


@pytest.mark.parametrize(("value", "problem"), BAD_LABELS)
async def test_bad_version_labels_are_refused_before_any_rpc(value: Any, problem: str) -> None:
    client = FakeClient(paused=True)
    admin = rl_admin(client)
    for route, body in (
        (admin.set_weight_version, {"weight_version": value}),
        (admin.update_weights_from_disk, {"model_path": "/ckpt", "weight_version": value}),
        (admin.update_weights_from_distributed, {"weight_version": value}),
        (admin.update_weights_from_distributed, {"weights_path": "/c", "weight_version": value}),
    ):
        answer = await route(body)
        assert answer["status"] == "error", answer
        assert answer["message"].startswith("'weight_version' ") and problem in answer["message"]
        json.dumps(answer, allow_nan=False)
    assert client.rpcs == []


async def test_good_version_labels_still_pass() -> None:
    client = FakeClient()
    admin = rl_admin(client)
    assert await admin.set_weight_version({"weight_version": 7}) == {
        "status": "ok",
        "version": 7,
        "weight_changes": 0,
    }
    assert await admin.set_weight_version({"weight_version": "step-8 é"}) == {
        "status": "ok",
        "version": "step-8 é",
        "weight_changes": 0,
    }
    assert await admin.set_weight_version({"weight_version": 1.5}) == {
        "status": "ok",
        "version": 1.5,
        "weight_changes": 0,
    }
    labels = [r.weight_version for r in client.requests]
    assert labels == ["7", "step-8 é", "1.5"]


async def test_update_info_that_json_cannot_carry_is_refused() -> None:
    client = FakeClient()
    answer = await rl_admin(client).update_weights_from_distributed({"scale": math.inf})
    assert answer["status"] == "error" and "JSON cannot carry" in answer["message"]
    assert client.rpcs == []


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None, [], {}])
async def test_clear_cache_must_be_a_boolean(value: Any) -> None:
    client = FakeClient()
    answer = await rl_admin(client).pause_generation({"mode": "wait", "clear_cache": value})
    assert answer == {"status": "error", "message": "'clear_cache' must be a boolean"}
    assert client.rpcs == []


@pytest.mark.parametrize(("body", "expected"), [({}, False), ({"clear_cache": True}, True)])
async def test_clear_cache_booleans_pass(body: dict[str, Any], expected: bool) -> None:
    client = FakeClient()
    answer = await rl_admin(client).pause_generation(body)
    assert answer["status"] == "ok" and answer["clear_cache"] is expected
    assert client.rpcs == ["PauseGeneration"]
    assert client.requests[0].clear_cache is expected


async def test_a_system_port_whose_internal_port_another_process_holds_is_refused() -> None:
    """The internal port drawn for Dynamo's system server, taken by someone else
    before Dynamo could bind it (another worker's system port, as happened to a
    two-worker NeMo RL fleet): every request passed there would reach that process,
    so the worker refuses to start, naming the port. One held here passes."""
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        ours = SystemServer(SystemPort("127.0.0.1", 0, mine.getsockname()[1]), {})
        await ours.check_internal_port()
    other = subprocess.Popen(
        [sys.executable, "-c", LISTEN_AND_WAIT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None
        port = int(other.stdout.readline())
        theirs = SystemServer(SystemPort("127.0.0.1", 0, port), {})
        with pytest.raises(RuntimeError, match=rf"internal port 127\.0\.0\.1:{port} "):
            await theirs.check_internal_port()
    finally:
        other.kill()
        other.wait()


LISTEN_AND_WAIT = (
    "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); time.sleep(60)"
)
