"""The worker's admin port through the real stack (issue 28): the admin token,
the start-up warning, strict JSON and labels, and what the bridge listens on.

A bridge started with ``--admin-token-file`` refuses every admin call without
the token (the engine is not touched), answers with it, and leaves the probes
open; a trainer's RefitClient with the token runs a whole refit. A bridge whose
routes listen beyond loopback without a token says so once at start.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.engine import load
from harness.listeners import Listener, listeners, process_tree
from harness.ports import free_port, free_system_port
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client.committed import CheckpointSource, CommittedWeights
from rl_client.refit import RefitClient

pytestmark = pytest.mark.dynamo

MODEL = "tiny-admin"
TOKEN = "e2e-admin-token-7f3a9c0d51"
WARNING = "with no admin token"
# Dynamo 1.6.1's event-plane publishers in direct ZMQ mode (DYN_EVENT_PLANE=zmq,
# no broker) bind tcp://0.0.0.0:0 whatever DYN_EVENT_PLANE_HOST says (that is
# only the address they advertise): the one wildcard listeners a bridge has.
# Each is named by its topic in the bridge's log.
ZMQ_PUBLISHER_TOPICS = {"kv-events", "active_sequences_events"}
_ZMQ_BOUND = re.compile(
    r"ZMQ PUB transport bound.*?endpoint=tcp://(?:0\.0\.0\.0|\[::\]):(\d+) topic=(\S+)"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class AdminStack:
    stack: Stack
    bridge: Proc
    admin: str  # the bridge's system URL
    token_file: Path


@pytest.fixture(scope="module")
def admin_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[AdminStack]:
    root = tmp_path_factory.mktemp("admin-stack")
    token_file = root / "admin-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        _, address = stack.start_engine("engine", "--eos-rate", "0", "--block-size", "16")
        system_port = free_system_port()
        bridge = stack.start_bridge(
            "bridge",
            address,
            "--enable-rl",
            "--admin-token-file",
            str(token_file),
            DYN_SYSTEM_PORT=str(system_port),
        )
        stack.start_frontend()
        stack.wait_serving(timeout=60)
        yield AdminStack(stack, bridge, f"http://127.0.0.1:{system_port}", token_file)


def call(
    url: str, body: bytes | None = b"{}", token: str | None = None
) -> tuple[int, str, dict[str, str]]:
    """(status, body text, headers), errors included; POST unless ``body`` is None."""
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def route(s: AdminStack, name: str, body: Any = None, token: str | None = TOKEN) -> Any:
    status, text, _ = call(f"{s.admin}/engine/{name}", json.dumps(body or {}).encode(), token)
    assert status == 200, (name, status, text)
    return json.loads(text)


def paused(s: AdminStack) -> bool:
    return bool(load(s.stack.address()).refit_state.paused)


def log_text(proc: Proc) -> str:
    return _ANSI.sub("", proc.log_tail(2_000_000))


def test_admin_routes_need_the_token_and_the_probes_do_not(admin_stack: AdminStack) -> None:
    s = admin_stack
    before = route(s, "get_weight_version")
    for token in (None, "wrong-token", TOKEN + "x"):
        for name, body in (
            ("pause_generation", {"mode": "abort"}),
            ("set_weight_version", {"weight_version": "forged"}),
            ("control/sleep", {}),
            ("control/start_profile", {}),  # Dynamo's own route, behind ours
        ):
            status, text, headers = call(
                f"{s.admin}/engine/{name}", json.dumps(body).encode(), token
            )
            assert status == 401, (name, token, status, text)
            answer = json.loads(text)
            assert answer["status"] == "error" and "admin token" in answer["message"]
            assert headers["WWW-Authenticate"].startswith("Bearer")
    # Nothing reached the engine.
    assert not paused(s)
    assert not load(s.stack.address()).refit_state.sleeping
    assert route(s, "get_weight_version") == before
    # The probes stay open.
    for path in ("/health", "/live", "/metrics"):
        status, text, _ = call(f"{s.admin}{path}", None, None)
        assert status == 200, (path, status, text)
    # With the token the routes work.
    assert route(s, "pause_generation", {"mode": "wait"})["status"] == "ok"
    assert paused(s)
    assert route(s, "resume_generation") == {"status": "ok", "message": "Engine resumed"}
    assert not paused(s)
    # The token is never written to the bridge's log; no warning with a token.
    text = log_text(s.bridge)
    assert TOKEN not in text and WARNING not in text
    assert "needs the admin token" in text


async def test_refit_client_with_the_token_runs_a_refit(
    admin_stack: AdminStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = admin_stack
    monkeypatch.setenv("BRIDGE_ADMIN_TOKEN_FILE", str(s.token_file))
    start = CommittedWeights("default", CheckpointSource(str(s.stack.model_dir)))
    # The token read as a bridge reads it.
    async with RefitClient([s.admin], committed=start) as trainer:
        report = await trainer.refit(str(s.stack.model_dir), "sec-1", mode="wait")
        assert report.ok and report.workers[0].version == "sec-1" and report.workers[0].resumed
        assert await trainer.versions() == {s.admin: "sec-1"}
    assert not paused(s)
    assert load(s.stack.address()).refit_state.weight_version == "sec-1"


def test_labels_and_json_are_strict_through_the_stack(admin_stack: AdminStack) -> None:
    s = admin_stack
    before = route(s, "get_weight_version")
    for constant in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"weight_version": {constant}}}'.encode()
        status, text, _ = call(f"{s.admin}/engine/set_weight_version", body, TOKEN)
        assert status == 400 and json.loads(text)["error"] == "Invalid JSON", text
    status, text, _ = call(
        f"{s.admin}/engine/set_weight_version", b'{"weight_version": 1e999}', TOKEN
    )
    answer = json.loads(text)  # strict: no NaN/Infinity could parse
    assert status == 200 and answer["status"] == "error" and "finite" in answer["message"]
    for label, problem in (("v\x00", "U+0000"), ("v\nx", "U+000A"), ("v\u202e1", "U+202E")):
        answer = route(s, "set_weight_version", {"weight_version": label})
        assert answer["status"] == "error" and problem in answer["message"], answer
        assert answer["message"].startswith("'weight_version' ")
    assert route(s, "get_weight_version") == before
    # clear_cache is a boolean, as every other flag.
    for value in ("no", 0, 1, None):
        answer = route(s, "pause_generation", {"clear_cache": value})
        assert answer == {"status": "error", "message": "'clear_cache' must be a boolean"}
    assert not paused(s)


def test_the_bridge_listens_beyond_loopback_only_where_dynamo_forces_it(
    admin_stack: AdminStack,
) -> None:
    """Loopback settings (DYN_SYSTEM_HOST, DYN_TCP_RPC_HOST, DYN_EVENT_PLANE_HOST =
    127.0.0.1): every socket of the bridge is on loopback but Dynamo's direct-ZMQ
    event publishers, each named by its topic."""
    s = admin_stack
    found = listeners(process_tree(s.bridge.pid))
    assert any(sock.port == int(s.admin.rsplit(":", 1)[1]) for sock in found), found
    forced = {int(port): topic for port, topic in _ZMQ_BOUND.findall(log_text(s.bridge))}
    assert set(forced.values()) <= ZMQ_PUBLISHER_TOPICS, forced
    wildcard: list[Listener] = [sock for sock in found if sock.wildcard]
    unexplained = [str(sock) for sock in wildcard if sock.port not in forced]
    assert not unexplained, f"listening beyond loopback: {unexplained} (known: {forced})"
    assert all(sock.protocol == "tcp" for sock in wildcard)


@pytest.mark.parametrize("with_token", [False, True])
def test_start_up_warning_when_open_beyond_loopback(
    admin_stack: AdminStack, with_token: bool
) -> None:
    """DYN_SYSTEM_HOST=0.0.0.0: the warning once without a token, none with one.
    (The bridge's system port is up before it reaches its engine server, so this
    one is given none: it never registers.)"""
    s = admin_stack
    name = f"open-bridge-{'token' if with_token else 'none'}"
    args = ("--admin-token-file", str(s.token_file)) if with_token else ()
    proc = s.stack.group.bridge(
        name,
        f"127.0.0.1:{free_port()}",
        s.stack.model_dir,
        MODEL,
        f"nsopen{int(with_token)}",
        s.stack.bridge_env(DYN_SYSTEM_PORT=str(free_system_port()), DYN_SYSTEM_HOST="0.0.0.0"),
        "--disable-kv-events",
        *args,
    )
    try:
        wait_until(lambda: "RL admin routes here" in log_text(proc), 60, f"{name} up", [proc])
        text = log_text(proc)
        assert text.count(WARNING) == (0 if with_token else 1), text[-3000:]
        if not with_token:
            line = next(line for line in text.splitlines() if WARNING in line)
            assert "WARNING" in line and "0.0.0.0" in line
            assert "--admin-token-file" in line and "DYN_SYSTEM_HOST=127.0.0.1" in line
        assert TOKEN not in text
    finally:
        proc.kill()
        s.stack.group.stop(proc)
