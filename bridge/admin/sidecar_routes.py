"""The Dynamo vLLM sidecar's spelling of the RL routes: ``/engine/control/<name>``
and ``/engine/update/<name>`` on the worker's system port.

Newer Dynamo (its Rust ``dynamo-vllm-sidecar``, ``lib/sidecar/vllm/src/engine.rs``)
serves vLLM's RL operations as a backend's engine controls and updates, and lists
them in the ``rl`` endpoint's ``routes`` answer; Prime-RL's Dynamo client finds a
worker there (``/v1/rl/workers``) and then posts to them. Controls:
``pause_generation``, ``resume_generation``, ``is_paused``, ``is_sleeping``,
``get_weight_version`` (and ``sleep``, ``wake_up``: those two paths are
dynamo.vllm's ``control/sleep`` and ``control/wake_up`` already, served with
dynamo.vllm's answers, which a sidecar client reading ``status != "error"``
takes as well). Updates: ``update_weight_version``, ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``.

Bodies and answers as the sidecar's: vLLM's request fields in a JSON body
(``mode`` default ``abort``, ``new_version``, ``init_info``, ``update_info``,
``weight_version``), answers ``{"status": "paused"}``, ``{"is_paused": ...}``,
``{"weight_version": ...}``, ``{"success": true, "new_version": ...}``,
``{"message": "Weight update started"}``... Errors as Dynamo's runtime answers
them for the sidecar: a body that is not a JSON object, or a control's bad field,
HTTP 200 ``{"status": "error", "message"}``; anything the engine refused or
failed (and an update's bad field, checked inside the sidecar's handler) HTTP 500
``{"error": "Handler error", "message"}``; invalid JSON HTTP 400. Each is the
handler of the same work in dynamo.vllm's spelling (``RlAdmin.operations()``):
the same admin token, refit rules (an update needs generation paused), writer's
fence (``expect_weight_changes`` on ``update_weight_version`` and
``start_weight_update``) and messages. One difference in what a control does:
the sidecar takes a worker out of discovery on ``pause_generation``; here, as in
dynamo.vllm and vLLM, a paused worker stays in the pool and requests wait at its
gate until the resume (sleep takes it out, wake brings it back, in both).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bridge.admin.answers import Body, ErrorKind, error_kind
from bridge.admin.http_routes import HttpRoute, Operations, fence, json_answer, require
from bridge.admin.system_server import engine_route_body

View = Callable[[Body], Awaitable[Body]]


class _Refused(Exception):
    """An answer the sidecar's runtime gives: ``body`` with ``status``."""

    def __init__(self, body: Body, status: int) -> None:
        super().__init__(body.get("message"))
        self.body, self.status = body, status


def _handler_error(message: Any) -> _Refused:
    """What Dynamo's system server answers when an engine route's handler raised."""
    return _Refused({"error": "Handler error", "message": str(message)}, 500)


# The handlers these paths call (RlAdmin.operations()' names).
NEEDS = (
    "pause_generation",
    "resume_generation",
    "is_paused",
    "is_sleeping",
    "get_weight_version",
    "set_weight_version",
    "init_weights_update_group",
    "update_weights_from_distributed",
)


class _Routes:
    """The sidecar's controls and updates over ``RlAdmin.operations()``."""

    def __init__(self, ops: Operations) -> None:
        self._ops = require(ops, NEEDS, "the sidecar's")

    async def _call(self, name: str, body: Body, *, control: bool) -> Body:
        """The handler's answer; its error as the sidecar answers it: a control's
        bad field (checked before the engine is touched) 200, the rest 500."""
        answer = await self._ops[name](body)
        kind = error_kind(answer)
        if kind is ErrorKind.INVALID and control:
            raise _Refused({"status": "error", "message": answer["message"]}, 200)
        if kind is not None:
            raise _handler_error(answer["message"])
        return answer

    async def pause_generation(self, body: Body) -> Body:
        mode = body.get("mode")
        clear_cache = body.get("clear_cache")
        await self._call(
            "pause_generation",
            {
                "mode": "abort" if mode is None else mode,
                "clear_cache": True if clear_cache is None else clear_cache,
            },
            control=True,
        )
        return {"status": "paused"}

    async def resume_generation(self, body: Body) -> Body:
        await self._call("resume_generation", {}, control=True)
        sleeping = await self._call("is_sleeping", {}, control=True)
        return {"status": "resumed", **({"is_sleeping": True} if sleeping["is_sleeping"] else {})}

    async def is_paused(self, body: Body) -> Body:
        return {"is_paused": (await self._call("is_paused", {}, control=True))["is_paused"]}

    async def is_sleeping(self, body: Body) -> Body:
        answer = await self._call("is_sleeping", {}, control=True)
        return {"is_sleeping": answer["is_sleeping"]}

    async def get_weight_version(self, body: Body) -> Body:
        answer = await self._call("get_weight_version", {}, control=True)
        return {"weight_version": answer["serving"]}

    async def update_weight_version(self, body: Body) -> Body:
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise _handler_error("missing non-empty `new_version` string")
        request = {"weight_version": version, **fence(body)}
        await self._call("set_weight_version", request, control=False)
        return {"success": True, "new_version": version}

    async def init_weight_transfer_engine(self, body: Body) -> Body:
        info = body.get("init_info")
        if not isinstance(info, dict):
            raise _handler_error("missing `init_info` JSON object")
        request = {"engine_rpc": "init_weight_transfer_engine", "init_info": info}
        await self._call("init_weights_update_group", request, control=False)
        return {"message": "Weight transfer initialized"}

    async def _phase(self, body: Body) -> None:
        # vLLM's phases reset no prefix cache (dynamo.vllm's default would).
        request = {**body, "reset_prefix_cache": False}
        await self._call("update_weights_from_distributed", request, control=False)

    async def start_weight_update(self, body: Body) -> Body:
        await self._phase({"engine_rpc": "start_weight_update", **fence(body)})
        return {"message": "Weight update started"}

    async def update_weights(self, body: Body) -> Body:
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise _handler_error("missing `update_info` JSON object")
        await self._phase({"engine_rpc": "update_weights", "update_info": info})
        return {"message": "Weights updated"}

    async def finish_weight_update(self, body: Body) -> Body:
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise _handler_error("`weight_version` must be a string")
        phase: Body = {"engine_rpc": "finish_weight_update"}
        if version is not None:
            phase["weight_version"] = version
        await self._phase(phase)
        return {"message": "Weight update finished"}


def _serve(kind: str, view: View) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """One engine route as Dynamo's system server serves it (any method; an
    empty body is ``{}``; invalid JSON 400) and the sidecar's wrapper checks it
    (a body that is not a JSON object: 200 ``{"status": "error"}``)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            body = await engine_route_body(request)
        except (ValueError, RecursionError) as e:
            return json_answer({"error": "Invalid JSON", "message": f"{e!s:.200}"}, 400)
        if not isinstance(body, dict):
            message = f"engine {kind} request body must be a JSON object"
            return json_answer({"status": "error", "message": message})
        try:
            return json_answer(await view(body))
        except _Refused as e:
            return json_answer(e.body, e.status)

    return handle


def routes(ops: Operations) -> dict[str, HttpRoute]:
    """The sidecar's controls and updates over ``ops``, each listed by its name
    under ``/engine/`` (``control/pause_generation``, ...)."""
    v = _Routes(ops)
    table: list[tuple[str, str, View]] = [
        ("control", "pause_generation", v.pause_generation),
        ("control", "resume_generation", v.resume_generation),
        ("control", "is_paused", v.is_paused),
        ("control", "is_sleeping", v.is_sleeping),
        ("control", "get_weight_version", v.get_weight_version),
        ("update", "update_weight_version", v.update_weight_version),
        ("update", "init_weight_transfer_engine", v.init_weight_transfer_engine),
        ("update", "start_weight_update", v.start_weight_update),
        ("update", "update_weights", v.update_weights),
        ("update", "finish_weight_update", v.finish_weight_update),
    ]
    return {
        f"/engine/{kind}/{name}": HttpRoute(
            f"/engine/{kind}/{name}", f"{kind}/{name}", _serve(kind, view)
        )
        for kind, name, view in table
    }
