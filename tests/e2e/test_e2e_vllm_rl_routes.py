"""vLLM's RL routes side by side: vLLM 0.32's own API server and a bridge (issue 39 #2).

vLLM's server (``python -m vllm.entrypoints.openai.api_server`` with
``VLLM_SERVER_DEV_MODE=1``, CPU build, the template-less tiny model) and our
stack on the same model and engine (an engine server ``--backend vllm`` behind a
bridge, its system port) are given the same calls in the same order: every
route's status code and JSON shape (keys, nested keys, value types) must match,
and a success's answer must be the same JSON. The calls cover each route's
success, FastAPI's validation refusals, a wrong method, and the engine refusing
a weight-transfer phase.

Where the two differ, each difference is listed with its reason (``DIFFERENT``)
and asserted as it is, so that a change on either side shows: our engine server
refuses a sleep the CPU build cannot do (vLLM's CPU worker logs "sleep mode is
not supported on CPU, ignore it" and answers 200), and a weight-transfer
shutdown without a transfer engine (vLLM's is a no-op); ``/server_info`` (vLLM's
configuration and environment) is not served by the bridge.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.engine import tiny_vllm_args
from harness.ports import free_port, free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from harness.waits import wait_until
from tests.e2e.e2e_stack import VLLM_STACK_MARKS

pytestmark = VLLM_STACK_MARKS

MODEL = "tiny"

# (method, path, JSON body, raw body, content type); the same on both servers, in order.
Call = tuple[str, str, Any, bytes | None, str | None]
FORM = "application/x-www-form-urlencoded"
CALLS: list[Call] = [
    ("GET", "/is_paused", None, None, None),
    ("POST", "/pause?mode=bogus", None, None, None),
    ("POST", "/pause?clear_cache=maybe", None, None, None),
    ("POST", "/pause?mode=keep&clear_cache=false", None, None, None),
    ("GET", "/is_paused", None, None, None),
    ("POST", "/is_paused", None, None, None),
    ("POST", "/start_weight_update", None, None, None),
    ("POST", "/resume", None, None, None),
    ("GET", "/weight_info", None, None, None),
    ("POST", "/update_weight_version", {"new_version": "v1"}, None, None),
    ("POST", "/update_weight_version", {}, None, None),
    ("POST", "/update_weight_version", {"new_version": 3}, None, None),
    ("POST", "/update_weight_version", None, b'{"new_version": "x"}', FORM),
    ("POST", "/update_weight_version", None, b"{bad", "application/json"),
    ("GET", "/weight_info", None, None, None),
    ("POST", "/weight_info", None, None, None),
    ("GET", "/get_world_size", None, None, None),
    ("GET", "/get_world_size?include_dp=false", None, None, None),
    ("GET", "/get_world_size?include_dp=zz", None, None, None),
    ("POST", "/reset_prefix_cache", None, None, None),
    ("POST", "/reset_prefix_cache?reset_external=zz", None, None, None),
    ("POST", "/abort_requests", {}, None, None),
    ("POST", "/abort_requests", None, b"", None),
    ("POST", "/abort_requests", [1], None, None),
    ("POST", "/abort_requests", {"request_ids": ["nope"]}, None, None),
    ("POST", "/sleep?level=3", None, None, None),
    ("POST", "/sleep?level=x", None, None, None),
    ("POST", "/init_weight_transfer_engine", {}, None, None),
    ("POST", "/init_weight_transfer_engine", {"init_info": 5}, None, None),
    ("POST", "/update_weights", {"update_info": 5}, None, None),
    ("POST", "/update_weights", {}, None, None),
    ("POST", "/finish_weight_update", {"weight_version": 3}, None, None),
    ("POST", "/start_weight_update", None, None, None),
    ("POST", "/finish_weight_update", None, None, None),
    ("POST", "/update_weights", {"update_info": {"names": []}}, None, None),
    ("GET", "/pause", None, None, None),
    ("GET", "/is_sleeping", None, None, None),
    ("POST", "/wake_up", None, None, None),
    ("POST", "/sleep?level=1", None, None, None),
    ("POST", "/wake_up?tags=weights", None, None, None),
    ("POST", "/wake_up", None, None, None),
    ("POST", "/shutdown_weight_transfer_engine", None, None, None),
    ("GET", "/server_info", None, None, None),
]
# Calls whose status differs, with each side's code and why.
DIFFERENT = {
    "/sleep?level=1": (200, 500, "the engine server refuses a sleep the CPU build cannot do"),
    "/shutdown_weight_transfer_engine": (
        200,
        500,
        "the engine server refuses it without a transfer engine; vLLM's is a no-op",
    ),
    "/server_info": (200, 404, "vLLM's configuration and environment: not served"),
}
# Successes whose answers differ in value: after vLLM's pretended sleep only
# its weights woke (``sleeping``); ours never slept (``awake``).
DIFFERENT_VALUE = {"/wake_up?tags=weights"}


@dataclass
class Servers:
    vllm: str
    ours: str


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("vllm-rl-routes")
    model = tiny_model_dir("base")  # no chat template
    with ProcessGroup(root / "logs") as group:
        port = free_port()
        # vLLM's own server, as its CPU build needs it (the engine server's defaults).
        from engine_server.backends.vllm._env import CPU_ENV_DEFAULTS  # imports vLLM

        env = {**CPU_ENV_DEFAULTS, "VLLM_SERVER_DEV_MODE": "1"}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        argv += [str(model), "--served-model-name", MODEL, "--host", "127.0.0.1"]
        vllm = group.spawn("vllm-serve", [*argv, "--port", str(port), *tiny_vllm_args()], env)
        stack = Stack.new(root, group, model, MODEL)
        _, address = stack.start_engine("engine", *tiny_vllm_args(), backend="vllm", timeout=300)
        system_port = free_system_port()
        stack.start_bridge("bridge", address, DYN_SYSTEM_PORT=str(system_port))
        found = Servers(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{system_port}")
        for url in (found.vllm, found.ours):
            wait_until(
                lambda url=url: call(url, ("GET", "/is_paused", None, None, None))[0] == 200,
                300,
                f"{url} answering",
                [vllm, *stack.procs],
                interval=0.5,
            )
        yield found


def call(base: str, request: Call) -> tuple[int, Any]:
    method, path, body, raw, content_type = request
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", content_type or "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as answer:
            status, text = answer.status, answer.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, None
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text.decode(errors="replace")


def shape(value: Any) -> Any:
    """A JSON value's keys, nested, and the types of its leaves."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    return type(value).__name__


def test_every_route_answers_as_vllms_own(servers: Servers) -> None:
    compared = 0
    for request in CALLS:
        method, path = request[0], request[1]
        theirs = call(servers.vllm, request)
        ours = call(servers.ours, request)
        where = f"{method} {path}: vLLM {theirs}, ours {ours}"
        if path in DIFFERENT:
            their_status, our_status, _why = DIFFERENT[path]
            assert (theirs[0], ours[0]) == (their_status, our_status), where
            continue
        assert theirs[0] == ours[0] and theirs[0] in (200, 400, 405, 500), where
        assert shape(theirs[1]) == shape(ours[1]), where
        if theirs[0] == 200 and path not in DIFFERENT_VALUE:
            assert theirs[1] == ours[1], where
        compared += 1
    assert compared == len(CALLS) - len(DIFFERENT)


def test_every_vllm_route_of_ours_is_one_of_vllms(servers: Servers) -> None:
    """Each of our vLLM-spelled paths exists on vLLM's server with the same method
    (vLLM answers 405 to the other, never 404)."""
    from bridge.admin import vllm_routes

    ours = set(vllm_routes.routes({name: _unused for name in vllm_routes.NEEDS}))
    assert ours == {path.split("?")[0] for _, path, *_ in CALLS} - {"/server_info"}
    for path in ours:
        status, _ = call(servers.vllm, ("DELETE", path, None, None, None))
        assert status == 405, path


async def _unused(body: Any) -> dict[str, Any]:
    raise AssertionError("not called")


def test_the_model_has_no_chat_template() -> None:
    assert not (tiny_model_dir("base") / "chat_template.jinja").exists()
    config = json.loads((Path(tiny_model_dir("base")) / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
