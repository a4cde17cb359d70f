"""vLLM 0.32's own RL routes, at vLLM's paths on the worker's system port.

vLLM serves them from the root of its API server with ``VLLM_SERVER_DEV_MODE=1``
(``vllm/entrypoints/rl/online/api_router.py``, ``serve/dev/sleep`` and
``serve/dev/cache``); SkyRL's remote client and Dynamo's Rust vLLM sidecar speak
them. Each path here is the handler that serves the same work under dynamo.vllm's
name (``RlAdmin.operations()``): vLLM's request (query parameters, a JSON body
read as FastAPI's ``Body(embed=True)`` reads it) becomes that handler's body, and
its answer becomes vLLM's JSON and status code. So the admin token, the refit
rules, the writer's fence and every error message are the same in all three
spellings (``bridge.admin.surface``).

Status codes as vLLM's handlers and exception handlers give them: 200; 400 for a
request FastAPI's validation refuses (``{"error": {"message", "type", "param",
"code"}}``); for what the engine refused or failed, 500 (vLLM's ``collective_rpc``
and engine-core calls raise a plain exception there), 501 where the engine
server does not implement it; ``/pause``, ``/resume``, ``/is_paused`` and
``/abort_requests`` answer their own ``{"error": "Failed to ...: ..."}``; a
wrong method is 405 ``{"detail": "Method Not Allowed"}``.

Where the rules are ours, not vLLM's (one implementation for all spellings): a
weight update needs generation paused, as dynamo.vllm's routes require (vLLM
itself does not ask); ``/init_weight_transfer_engine`` is bounded by
``DYN_RL_INIT_WEIGHTS_TIMEOUT_S``; ``/update_weight_version`` and
``/start_weight_update`` take the writer's fence ``expect_weight_changes`` as
an extra body key (vLLM ignores unknown keys); ``/reset_prefix_cache``'s
``reset_running_requests`` and ``reset_external`` are checked, not carried (the
contract's reset has no such options: ``success`` says whether it reset).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bridge.admin.answers import Body, ErrorKind, error_kind
from bridge.admin.http_routes import HttpRoute, Operations, fence, json_answer, require
from bridge.admin.system_server import strict_json
from engine_contract.text import clip

# vLLM's PauseMode literal, in its order (its validation message names them so).
_PAUSE_MODES = ("abort", "wait", "keep")
# pydantic's lax booleans, as FastAPI reads a bool query parameter.
_BOOLS = {
    **dict.fromkeys(("true", "1", "yes", "on", "t", "y"), True),
    **dict.fromkeys(("false", "0", "no", "off", "f", "n"), False),
}
# An error by its kind: vLLM's status code and error type.
_BY_KIND = {
    ErrorKind.INVALID: (400, "BadRequestError"),
    ErrorKind.REFUSED: (500, "InternalServerError"),
    ErrorKind.FAILED: (500, "InternalServerError"),
    ErrorKind.UNSUPPORTED: (501, "NotImplementedError"),
}
# The keys of a weight-transfer phase that are vLLM's, not dynamo.vllm's: vLLM
# resets no prefix cache after a phase (a trainer pauses with clear_cache).
_PHASE = {"reset_prefix_cache": False}


class _Invalid(Exception):
    """A request FastAPI's validation refuses: HTTP 400 in vLLM's error shape."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _error(message: str, status: int, kind: str, param: str | None = None) -> web.Response:
    """vLLM's ``ErrorResponse``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return json_answer(body, status)


def _failure(answer: Body, kind: ErrorKind) -> web.Response:
    status, name = _BY_KIND[kind]
    return _error(str(answer.get("message")), status, name)


def _query(request: web.Request, name: str) -> str | None:
    """A scalar query parameter as Starlette reads it: the last one given."""
    values = request.query.getall(name, [])
    return values[-1] if values else None


def _query_bool(request: web.Request, name: str, default: bool) -> bool:
    raw = _query(request, name)
    if raw is None:
        return default
    value = _BOOLS.get(raw.strip().lower())
    if value is None:
        raise _Invalid(f"{name}: Input should be a valid boolean, got {clip(raw)}", f"query.{name}")
    return value


def _query_level(request: web.Request) -> int:
    """``level``: an integer 0 to 2 (vLLM's ``Query(ge=0, le=2)``), default 1."""
    raw = _query(request, "level")
    if raw is None:
        return 1
    text = raw.strip()
    if not text.lstrip("+-").isdigit():
        raise _Invalid(f"level: Input should be a valid integer, got {clip(raw)}", "query.level")
    level = int(text)
    if not 0 <= level <= 2:
        raise _Invalid(f"level: Input should be 0, 1 or 2, got {level}", "query.level")
    return level


def _query_mode(request: web.Request) -> str:
    raw = _query(request, "mode")
    if raw is None:
        return "abort"
    if raw not in _PAUSE_MODES:
        raise _Invalid(
            f"mode: Input should be 'abort', 'wait' or 'keep', got {clip(raw)}", "query.mode"
        )
    return raw


def _is_json(content_type: str) -> bool:
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


async def _body(request: web.Request, *required: str) -> Body:
    """The JSON object of an embedded body, as FastAPI takes one: read as JSON
    when the content type is JSON or absent, ``required`` fields present."""
    raw = await request.read()
    body: Any = {}
    if raw:
        content_type = request.headers.get("Content-Type")
        if content_type and not _is_json(content_type):
            raise _Invalid("the body must be JSON (Content-Type: application/json)", "body")
        try:
            body = strict_json(raw)
        except (ValueError, RecursionError) as e:
            raise _Invalid(f"JSON decode error: {e!s:.200}", "body") from None
    if not isinstance(body, dict):
        raise _Invalid("the body must be a JSON object", "body")
    for name in required:
        if body.get(name) is None:
            raise _Invalid(f"{name}: Field required", f"body.{name}")
    return body


async def _extra_body(request: web.Request) -> Body:
    """The body of a route vLLM reads none of: ours takes the writer's fence from
    it when it is a JSON object, and otherwise ignores it, as vLLM does."""
    try:
        body = await _body(request)
    except _Invalid:
        return {}
    return body


# The handlers these paths call (RlAdmin.operations()' names).
NEEDS = (
    "pause_generation",
    "resume_generation",
    "abort_request",
    "abort_all",
    "is_paused",
    "init_weights_update_group",
    "destroy_weights_update_group",
    "update_weights_from_distributed",
    "set_weight_version",
    "get_weight_version",
    "world_size",
    "control/sleep",
    "control/wake_up",
    "is_sleeping",
    "reset_prefix_cache",
)


class _Routes:
    """The handlers of vLLM's paths over ``RlAdmin.operations()``."""

    def __init__(self, ops: Operations) -> None:
        self._ops = require(ops, NEEDS, "vLLM's")

    async def _call(self, name: str, body: Body) -> Body:
        return await self._ops[name](body)

    async def _answer(self, name: str, body: Body, done: Callable[[Body], Body]) -> web.Response:
        """The handler ``name``'s answer in vLLM's words: ``done`` of it (vLLM's
        JSON) on success; its error as vLLM's ``ErrorResponse`` with the status
        code of its kind, as every route but the four with their own words."""
        answer = await self._call(name, body)
        kind = error_kind(answer)
        return _failure(answer, kind) if kind is not None else json_answer(done(answer))

    async def pause(self, request: web.Request) -> web.Response:
        mode = _query_mode(request)
        clear_cache = _query_bool(request, "clear_cache", True)
        answer = await self._call("pause_generation", {"mode": mode, "clear_cache": clear_cache})
        kind = error_kind(answer)
        if kind is ErrorKind.INVALID:  # vLLM's ValueError
            return json_answer({"error": answer["message"]}, 400)
        if kind is not None:
            return json_answer({"error": f"Failed to pause generation: {answer['message']}"}, 500)
        return json_answer({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        answer = await self._call("resume_generation", {})
        if error_kind(answer) is not None:
            return json_answer({"error": f"Failed to resume generation: {answer['message']}"}, 500)
        return json_answer({"status": "resumed"})

    async def abort_requests(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = strict_json(raw)
        except (ValueError, RecursionError):
            raise _Invalid("Invalid JSON format") from None
        if not isinstance(body, dict):
            raise _Invalid("Request body must be a JSON object")
        ids = body.get("request_ids")
        if not ids:  # vLLM: empty or missing aborts everything in flight
            answer = await self._call("abort_all", {})
            count = answer.get("aborted", 0)
        else:
            ids = [ids] if isinstance(ids, str) else ids
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                answer = {"status": "error", "message": "'request_ids' must be a list of strings"}
            else:
                for request_id in ids:
                    answer = await self._call("abort_request", {"request_id": request_id})
                    if error_kind(answer) is not None:
                        break
            count = len(ids)
        if error_kind(answer) is not None:
            return json_answer({"error": f"Failed to abort requests: {answer['message']}"}, 500)
        return json_answer({"status": "aborted", "aborted": count})

    async def is_paused(self, request: web.Request) -> web.Response:
        answer = await self._call("is_paused", {})
        if error_kind(answer) is not None:
            return json_answer({"error": f"Failed to fetch pause status: {answer['message']}"}, 500)
        return json_answer({"is_paused": answer["is_paused"]})

    async def _phase(self, body: Body, done: str) -> web.Response:
        phase = {**body, **_PHASE}
        return await self._answer(
            "update_weights_from_distributed", phase, lambda _: {"message": done}
        )

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        info = (await _body(request, "init_info"))["init_info"]
        if not isinstance(info, dict):
            raise _Invalid("init_info: Input should be a valid dictionary", "body.init_info")
        body = {"engine_rpc": "init_weight_transfer_engine", "init_info": info}
        return await self._answer(
            "init_weights_update_group", body, lambda _: {"message": "Weight transfer initialized"}
        )

    async def shutdown_weight_transfer_engine(self, request: web.Request) -> web.Response:
        body = {"engine_rpc": "shutdown_weight_transfer_engine"}
        return await self._answer(
            "destroy_weights_update_group", body, lambda _: {"message": "Weight transfer shut down"}
        )

    async def start_weight_update(self, request: web.Request) -> web.Response:
        body = {"engine_rpc": "start_weight_update", **fence(await _extra_body(request))}
        return await self._phase(body, "Weight update started")

    async def update_weights(self, request: web.Request) -> web.Response:
        info = (await _body(request, "update_info"))["update_info"]
        if not isinstance(info, dict) and not (
            isinstance(info, list) and all(isinstance(i, dict) for i in info)
        ):
            raise _Invalid(
                "update_info: Input should be a dictionary or a list of dictionaries",
                "body.update_info",
            )
        return await self._phase(
            {"engine_rpc": "update_weights", "update_info": info}, "Weights updated"
        )

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        version = (await _body(request)).get("weight_version")
        if version is not None and not isinstance(version, str):
            raise _Invalid(
                f"weight_version: Input should be a valid string, got {clip(version)}",
                "body.weight_version",
            )
        body: Body = {"engine_rpc": "finish_weight_update"}
        if version is not None:
            body["weight_version"] = version
        return await self._phase(body, "Weight update finished")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request, "new_version")
        version = body["new_version"]
        if not isinstance(version, str):
            raise _Invalid(
                f"new_version: Input should be a valid string, got {clip(version)}",
                "body.new_version",
            )
        return await self._answer(
            "set_weight_version",
            {"weight_version": version, **fence(body)},
            lambda _: {"success": True, "new_version": version},
        )

    async def weight_info(self, request: web.Request) -> web.Response:
        return await self._answer(
            "get_weight_version", {}, lambda answer: {"weight_version": answer["serving"]}
        )

    async def get_world_size(self, request: web.Request) -> web.Response:
        include_dp = _query_bool(request, "include_dp", True)
        return await self._answer(
            "world_size",
            {"include_dp": include_dp},
            lambda answer: {"world_size": answer["world_size"]},
        )

    async def sleep(self, request: web.Request) -> web.Response:
        level, mode = _query_level(request), _query_mode(request)
        return await self._answer(
            "control/sleep",
            {"level": level, "mode": mode},
            lambda _: {"status": "sleeping", "level": level},
        )

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None

        def woken(answer: Body) -> Body:
            return {"status": "sleeping" if answer.get("is_sleeping") else "awake", "tags": tags}

        return await self._answer("control/wake_up", {"tags": tags} if tags else {}, woken)

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return await self._answer(
            "is_sleeping", {}, lambda answer: {"is_sleeping": answer["is_sleeping"]}
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        _query_bool(request, "reset_running_requests", False)
        _query_bool(request, "reset_external", False)
        return await self._answer(
            "reset_prefix_cache", {}, lambda answer: {"success": answer["reset"]}
        )


View = Callable[[web.Request], Awaitable[web.Response]]


def _serve(method: str, view: View) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """One path of vLLM's: its one method (FastAPI's routes add no HEAD),
    and a request its validation refuses answered 400 in vLLM's error shape."""
    allowed = (method,)

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method not in allowed:
            return json_answer(
                {"detail": "Method Not Allowed"}, 405, headers={"Allow": ", ".join(allowed)}
            )
        try:
            return await view(request)
        except _Invalid as e:
            return _error(str(e), 400, "Bad Request", e.param)

    return handle


def routes(ops: Operations) -> dict[str, HttpRoute]:
    """vLLM's paths over ``ops``, each listed by its path from the root."""
    v = _Routes(ops)
    table: list[tuple[str, str, View]] = [
        ("/pause", "POST", v.pause),
        ("/resume", "POST", v.resume),
        ("/abort_requests", "POST", v.abort_requests),
        ("/is_paused", "GET", v.is_paused),
        ("/init_weight_transfer_engine", "POST", v.init_weight_transfer_engine),
        ("/shutdown_weight_transfer_engine", "POST", v.shutdown_weight_transfer_engine),
        ("/start_weight_update", "POST", v.start_weight_update),
        ("/update_weights", "POST", v.update_weights),
        ("/finish_weight_update", "POST", v.finish_weight_update),
        ("/update_weight_version", "POST", v.update_weight_version),
        ("/weight_info", "GET", v.weight_info),
        ("/get_world_size", "GET", v.get_world_size),
        ("/sleep", "POST", v.sleep),
        ("/wake_up", "POST", v.wake_up),
        ("/is_sleeping", "GET", v.is_sleeping),
        ("/reset_prefix_cache", "POST", v.reset_prefix_cache),
    ]
    return {path: HttpRoute(path, path, _serve(method, view)) for path, method, view in table}
