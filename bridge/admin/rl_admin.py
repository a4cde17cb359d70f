"""Dynamo's RL admin routes, as ``dynamo.vllm --enable-rl`` serves them, on the engine server.

Same names, request bodies and answer shapes as dynamo.vllm 1.6.1, so that a
trainer that drives Dynamo's vLLM worker (NeMo RL's managed Dynamo backend)
drives this worker unchanged. Every answer carries ``"status": "ok"|"error"``
and errors a ``"message"``; a bad body is an error answer and the engine keeps
serving. Each route is one or a few contract RPCs (``rl_client.refit_rpc``); the
engine server holds the rules (one lock for pause, resume, updates, sleep and
wake; updates refused unless paused, and an unpaused one may not reset the
prefix cache; versions set only on success) and refuses in dynamo.vllm's words,
which a route passes on. Where dynamo.vllm answers a refusal before looking at
the rest of the body, the route asks the same rules first
(``engine_contract.refit_rules``), so the answers come in dynamo.vllm's order.

Differences from dynamo.vllm, all in the direction of more: ``set_weight_version``
labels the engine's tokens (each result's ``weight_versions``), not only the
answer of ``get_weight_version``; ``update_weights_from_distributed`` with a
``weights_path`` loads that checkpoint, and otherwise runs the engine's
weight-transfer phases with the body as the update info. Sleep and wake take
the worker out of the router's pool and back, as dynamo.vllm does.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from bridge.client import EngineClient
from bridge.codec import clip
from bridge.registration import Registration
from engine_contract.labels import label_problem
from engine_contract.refit_rules import (
    PAUSE_MODE_CHOICES,
    PAUSE_MODES,
    UpdateRefusal,
    needs_pause,
    update_refusal,
)
from engine_contract.v1 import engine_pb2 as pb
from rl_client.refit_rpc import RefitRpc

log = logging.getLogger(__name__)

Body = dict[str, Any]
Route = Callable[[Any], Awaitable[Body]]

# Keys of update_weights_from_distributed that are not the engine's own.
_RESERVED = ("allow_unpaused", "engine_rpc", "reset_prefix_cache", "weight_version")
_PATH_KEYS = ("weights_path", "model_path", "path")


class RouteError(ValueError):
    """An answer ``{"status": "error", "message": ...}`` (plus any extra fields)."""

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.extra = extra


def _route(
    handler: Callable[[RlAdmin, Body], Awaitable[Body]],
) -> Callable[[RlAdmin, Any], Awaitable[Body]]:
    """Body rules and error answers shared by every route."""

    @functools.wraps(handler)
    async def wrapper(self: RlAdmin, body: Any) -> Body:
        if body is None:
            body = {}
        elif not isinstance(body, dict):
            return {"status": "error", "message": "request body must be a JSON object"}
        try:
            return await handler(self, body)
        except RouteError as e:
            return {"status": "error", **e.extra, "message": str(e)}
        except grpc.aio.AioRpcError as e:
            log.warning("RL route %s: %s: %s", handler.__name__, e.code().name, e.details())
            return {"status": "error", "message": e.details() or e.code().name}
        except Exception as e:
            log.exception("RL route %s failed", handler.__name__)
            return {"status": "error", "message": str(e) or type(e).__name__}

    return wrapper


def _version(value: Any) -> str:
    """dynamo.vllm takes any JSON scalar as a version; the engine labels with text,
    which must be printable (``engine_contract.labels``): checked here, before any
    RPC, so a bad label never reaches the engine server or an answer."""
    if value is None or isinstance(value, (dict, list)):
        raise RouteError(f"'weight_version' must be a string or a number, got {clip(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RouteError(f"'weight_version' must be a finite number, got {value}")
    label = value if isinstance(value, str) else _json(value)
    problem = label_problem(label)
    if problem is not None:
        raise RouteError(f"'weight_version' {problem}")
    return label


def _json(value: Any) -> str:
    """Strict JSON text: a non-finite number is an error, never ``NaN``."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError as e:
        raise RouteError(f"the body holds a number JSON cannot carry: {e}") from None


def _updated(body: Body) -> Body:
    """A successful update's answer, as dynamo.vllm gives it: the version the body
    declared (as sent), or "unknown" when it declared none (the label is kept)."""
    return {
        "status": "ok",
        "version": body.get("weight_version", "unknown"),
        "version_declared": "weight_version" in body,
    }


def _refuse(refusal: UpdateRefusal | None) -> None:
    """The engine server's own answer to an update the rules refuse, before any RPC."""
    if refusal is not None:
        raise RouteError(refusal.value)


def _bool(body: Body, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise RouteError(f"'{key}' must be a boolean")
    return value


class RlAdmin:
    """The routes of one worker; ``routes()`` maps each name to its handler."""

    def __init__(
        self,
        client: Callable[[], EngineClient | None],
        registration: Registration,
        engine_request_id: Callable[[str], str] = lambda request_id: request_id,
    ) -> None:
        self._client = client
        self._registration = registration
        # A Dynamo request id -> the engine request id it runs under.
        self._engine_request_id = engine_request_id

    def routes(self) -> dict[str, Route]:
        return {
            "liveness_probe": self.liveness_probe,
            "pause_generation": self.pause_generation,
            "resume_generation": self.resume_generation,
            "flush_cache": self.flush_cache,
            "abort_request": self.abort_request,
            "update_weights_from_disk": self.update_weights_from_disk,
            "update_weights_from_distributed": self.update_weights_from_distributed,
            "update_weights_from_tensor": self.update_weights_from_tensor,
            "init_weights_update_group": self.init_weights_update_group,
            "destroy_weights_update_group": self.destroy_weights_update_group,
            "get_weight_version": self.get_weight_version,
            "set_weight_version": self.set_weight_version,
            "control/sleep": self.sleep,
            "control/wake_up": self.wake_up,
        }

    def _engine(self) -> EngineClient:
        client = self._client()
        if client is None:
            raise RouteError("the bridge is not connected to its engine server")
        return client

    def _refit(self) -> RefitRpc:
        return self._engine().refit

    async def _check_paused(self, options: pb.WeightUpdateOptions) -> None:
        """dynamo.vllm's "not paused" answer before anything else of the body; the
        engine server refuses the same (a pause ending meanwhile) in the same words."""
        if needs_pause(options):
            paused = (await self._refit().is_paused()).paused
            _refuse(update_refusal(options, paused=paused))

    async def _version_state(self) -> Body:
        answer = await self._refit().get_weight_version()
        declared = bool(answer.declared)
        return {
            "version": answer.weight_version if declared else None,
            "version_declared": declared,
        }

    # -- generation ----------------------------------------------------------

    @_route
    async def liveness_probe(self, body: Body) -> Body:
        client = self._engine()
        if not await client.serving():
            return {
                "status": "error",
                "alive": False,
                "message": f"engine server at {client.address} is not serving",
            }
        return {"status": "ok", "alive": True}

    @_route
    async def pause_generation(self, body: Body) -> Body:
        mode = body.get("mode", "keep")
        if not isinstance(mode, str) or mode not in PAUSE_MODES:
            shown = mode if isinstance(mode, str) and len(mode) <= 40 else clip(mode)
            raise RouteError(f"Invalid mode '{shown}'; expected {PAUSE_MODE_CHOICES}")
        clear_cache = _bool(body, "clear_cache", False)
        await self._refit().pause_generation(
            pb.PauseGenerationRequest(mode=PAUSE_MODES[mode], clear_cache=clear_cache)
        )
        log.info("engine paused (mode=%s, clear_cache=%s)", mode, clear_cache)
        return {
            "status": "ok",
            "message": "Engine paused",
            "mode": mode,
            "clear_cache": clear_cache,
        }

    @_route
    async def resume_generation(self, body: Body) -> Body:
        await self._refit().resume_generation()
        log.info("engine resumed")
        return {"status": "ok", "message": "Engine resumed"}

    @_route
    async def flush_cache(self, body: Body) -> Body:
        await self._refit().reset_prefix_cache()
        return {"status": "ok", "message": "Cache flushed"}

    @_route
    async def abort_request(self, body: Body) -> Body:
        request_id = body.get("request_id")
        if not request_id:
            raise RouteError("Missing 'request_id' in body")
        if not isinstance(request_id, str):
            raise RouteError(f"'request_id' must be a string, got {clip(request_id)}")
        await self._engine().abort(self._engine_request_id(request_id))
        return {"status": "ok", "request_id": request_id}

    # -- weights ----------------------------------------------------------------

    @_route
    async def update_weights_from_disk(self, body: Body) -> Body:
        # A bad label before any RPC; otherwise dynamo.vllm's order: "not paused"
        # before anything else about the body.
        version = _version(body["weight_version"]) if "weight_version" in body else None
        options = pb.WeightUpdateOptions()
        await self._check_paused(options)
        path = body.get("model_path")
        if not path:
            raise RouteError("Missing 'model_path' in body")
        if not isinstance(path, str):
            raise RouteError(f"'model_path' must be a string, got {clip(path)}")
        engine_rpc = body.get("engine_rpc", "reload_weights")
        if engine_rpc != "reload_weights":
            raise RouteError(
                f"engine_rpc {clip(engine_rpc)} is not supported: this worker's engine server "
                "loads checkpoints with reload_weights"
            )
        if version is not None:
            options.weight_version = version
        await self._refit().update_weights_from_path(
            pb.UpdateWeightsFromPathRequest(path=path, options=options)
        )
        return _updated(body)

    @_route
    async def update_weights_from_distributed(self, body: Body) -> Body:
        options = pb.WeightUpdateOptions(
            allow_unpaused=_bool(body, "allow_unpaused", False),
            reset_prefix_cache=_bool(body, "reset_prefix_cache", True),
        )
        # dynamo.vllm's order: the options' own rule, the body, then "not paused".
        _refuse(update_refusal(options))
        version = _version(body["weight_version"]) if "weight_version" in body else None
        kwargs = {k: v for k, v in body.items() if k not in _RESERVED}
        update_info = _json(kwargs)
        await self._check_paused(options)
        refit = self._refit()
        path = next((kwargs[k] for k in _PATH_KEYS if isinstance(kwargs.get(k), str)), None)
        if path is not None:
            if version is not None:
                options.weight_version = version
            await refit.update_weights_from_path(
                pb.UpdateWeightsFromPathRequest(path=path, options=options)
            )
        else:
            await refit.start_weight_update(pb.StartWeightUpdateRequest(options=options))
            await refit.update_weights(
                pb.UpdateWeightsRequest(update_info_json=update_info.encode())
            )
            finish = pb.FinishWeightUpdateRequest()
            if version is not None:
                finish.weight_version = version
            await refit.finish_weight_update(finish)
        return _updated(body)

    @_route
    async def update_weights_from_tensor(self, body: Body) -> Body:
        raise RouteError(
            "update_weights_from_tensor is not implemented over HTTP: stream the tensors to "
            "the engine server's UpdateWeightsFromTensors (engine_contract.tensors.update_requests)"
        )

    @_route
    async def init_weights_update_group(self, body: Body) -> Body:
        info = {k: v for k, v in body.items() if k != "engine_rpc"}
        await self._refit().init_weight_transfer_engine(
            pb.InitWeightTransferEngineRequest(init_info_json=_json(info).encode())
        )
        return {"status": "ok", "message": "Weight update group initialized"}

    @_route
    async def destroy_weights_update_group(self, body: Body) -> Body:
        await self._refit().shutdown_weight_transfer_engine()
        return {"status": "ok", "message": "Weight update group destroyed"}

    @_route
    async def get_weight_version(self, body: Body) -> Body:
        return {"status": "ok", **await self._version_state()}

    @_route
    async def set_weight_version(self, body: Body) -> Body:
        if "weight_version" not in body:
            raise RouteError("Missing 'weight_version' in body")
        value = body["weight_version"]
        label = _version(value)
        await self._refit().update_weight_version(
            pb.UpdateWeightVersionRequest(weight_version=label)
        )
        return {"status": "ok", "version": value}

    # -- sleep --------------------------------------------------------------------

    @_route
    async def sleep(self, body: Body) -> Body:
        level = body.get("level", 1)
        if isinstance(level, bool) or not isinstance(level, int):
            raise RouteError(f"'level' must be an integer, got {clip(level)}")
        refit = self._refit()
        if (await refit.is_sleeping()).sleeping:
            return {"status": "ok", "message": "Engine already sleeping"}
        # Out of the pool first: no request should be routed to a sleeping engine.
        await self._registration.leave("the engine goes to sleep")
        try:
            await refit.sleep(pb.SleepRequest(level=level, mode=pb.PAUSE_MODE_ABORT))
        except BaseException:
            await self._registration.rejoin("the engine did not go to sleep")
            raise
        return {"status": "ok", "message": f"Engine slept (level={level})"}

    @_route
    async def wake_up(self, body: Body) -> Body:
        tags = body.get("tags")
        if tags is not None and (
            not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)
        ):
            raise RouteError(f"'tags' must be a list of strings, got {clip(tags)}")
        refit = self._refit()
        if not (await refit.is_sleeping()).sleeping:
            return {"status": "ok", "message": "Engine already awake"}
        answer = await refit.wake_up(pb.WakeUpRequest(tags=tags or []))
        if not answer.awake:
            return {"status": "ok", "message": "Engine partially awake", "is_sleeping": True}
        await self._registration.rejoin("the engine woke up")
        return {"status": "ok", "message": "Engine woke"}
