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
answer of ``get_weight_version``; a timed-out ``init_weights_update_group``
(``DYN_RL_INIT_WEIGHTS_TIMEOUT_S``) shuts the transfer engine down and answers an
error, where dynamo.vllm terminates the worker. Sleep and wake take the worker
out of the router's pool and back, as dynamo.vllm does; it rejoins whenever the
engine serves again, whoever woke it (``control/wake_up`` on an awake engine
included).
``update_weights_from_disk`` and ``set_weight_version`` take the fence
``expect_weight_changes`` (the engine's count of weight changes the writer read:
``get_weight_version`` answers it, with the label ``serving`` even when none was
declared) and answer the new count; a stale writer is refused, nothing changed.

The weight-transfer routes dispatch as dynamo.vllm's do: ``engine_rpc`` names one
phase, and the body's other keys (less ``allow_unpaused``, ``engine_rpc``,
``reset_prefix_cache``, ``weight_version``) are its keyword arguments.
``update_weights_from_distributed``: ``start_weight_update`` (``is_checkpoint_format``:
true, or absent; vLLM 0.32 takes no argument there) -> StartWeightUpdate;
``update_weights`` (``update_info``) -> UpdateWeights with that info;
``finish_weight_update`` -> FinishWeightUpdate, labelled with ``weight_version``;
``update_weights_from_path`` (the default: ``weights_path``, ``model_path`` or
``path``) -> UpdateWeightsFromPath. After the phase, the prefix cache is reset when
``reset_prefix_cache`` (default true) and the version set when one was sent.
``init_weights_update_group``: ``init_info`` is the init info (a body without one
is the info itself); ``destroy_weights_update_group``: ShutdownWeightTransferEngine.
A phase out of order or an unknown ``engine_rpc`` is an error answer naming the
order; the engine keeps its old weights and version.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from bridge.client import EngineClient
from bridge.codec import clip
from bridge.engine_watch import EngineWatch
from bridge.registration import Registration
from engine_contract import WEIGHT_FENCE_REVISION
from engine_contract.labels import label_problem
from engine_contract.refit_rules import (
    PAUSE_MODE_CHOICES,
    PAUSE_MODES,
    PHASE_ORDER,
    PhaseRefusal,
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
# init_weights_update_group's and destroy_weights_update_group's engine_rpc: vLLM's
# weight-transfer names, and dynamo.vllm's defaults.
_INIT_RPCS = ("init_weight_transfer_engine", "init_broadcaster")
_DESTROY_RPCS = ("shutdown_weight_transfer_engine", "destroy_broadcaster")
# dynamo.vllm's bound on init_weights_update_group, read as it reads it.
INIT_TIMEOUT_ENV = "DYN_RL_INIT_WEIGHTS_TIMEOUT_S"
INIT_TIMEOUT_DEFAULT_S = 30.0
# How long a timed-out init's teardown may hold the answer.
_TEARDOWN_S = 10.0
_MAX_TIMEOUT_MS = 2**32 - 1  # a uint32 on the wire (some 50 days)
_OUT_OF_ORDER = {refusal.value for refusal in PhaseRefusal}
# How long control/wake_up waits for the worker to be back in the pool.
_REJOIN_WAIT_S = 10.0


def _init_timeout_s() -> float:
    raw = os.environ.get(INIT_TIMEOUT_ENV, str(INIT_TIMEOUT_DEFAULT_S))
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise RouteError(f"{INIT_TIMEOUT_ENV}={clip(raw)} is not a positive number of seconds")
    return value


def _kwargs(rpc: str, kwargs: Body, allowed: tuple[str, ...]) -> None:
    """dynamo.vllm passes the body's other keys to the engine as keyword arguments:
    one the phase does not take fails there; here, before any RPC."""
    extra = sorted(k for k in kwargs if k not in allowed)
    if extra:
        takes = f"only {', '.join(repr(a) for a in allowed)}" if allowed else "no arguments"
        raise RouteError(f"{rpc} takes {takes}; unexpected keys: {', '.join(extra)}")


async def _start(
    refit: RefitRpc, kwargs: Body, options: pb.WeightUpdateOptions, version: str | None
) -> None:
    # vLLM 0.32's start_weight_update takes no arguments: its layerwise reload
    # takes checkpoint-format weights, which is what is_checkpoint_format: true
    # (NeMo RL's) says; false (kernel-format weights) it cannot do.
    _kwargs("start_weight_update", kwargs, ("is_checkpoint_format",))
    fmt = kwargs.get("is_checkpoint_format", True)
    if not isinstance(fmt, bool):
        raise RouteError("'is_checkpoint_format' must be a boolean")
    if not fmt:
        raise RouteError(
            "is_checkpoint_format false is not supported: this engine's weight transfer "
            "loads checkpoint-format weights only"
        )
    await refit.start_weight_update(
        pb.StartWeightUpdateRequest(
            options=pb.WeightUpdateOptions(
                allow_unpaused=options.allow_unpaused, reset_prefix_cache=False
            )
        )
    )


async def _update(
    refit: RefitRpc, kwargs: Body, options: pb.WeightUpdateOptions, version: str | None
) -> None:
    _kwargs("update_weights", kwargs, ("update_info",))
    if "update_info" not in kwargs:
        raise RouteError("Missing 'update_info' in body")
    info = kwargs["update_info"]
    if not isinstance(info, dict) and not (
        isinstance(info, list) and all(isinstance(i, dict) for i in info)
    ):
        raise RouteError(f"'update_info' must be a JSON object or a list of them, got {clip(info)}")
    await refit.update_weights(pb.UpdateWeightsRequest(update_info_json=_json(info).encode()))


async def _finish(
    refit: RefitRpc, kwargs: Body, options: pb.WeightUpdateOptions, version: str | None
) -> None:
    _kwargs("finish_weight_update", kwargs, ())
    finish = pb.FinishWeightUpdateRequest()
    if version is not None:
        finish.weight_version = version
    await refit.finish_weight_update(finish)


async def _from_path(
    refit: RefitRpc, kwargs: Body, options: pb.WeightUpdateOptions, version: str | None
) -> None:
    path = next((kwargs[k] for k in _PATH_KEYS if k in kwargs), None)
    if path is None:
        raise RouteError(f"Missing {' or '.join(repr(k) for k in _PATH_KEYS)} in body")
    if not isinstance(path, str) or not path:
        raise RouteError(f"the checkpoint path must be a non-empty string, got {clip(path)}")
    if version is not None:
        options.weight_version = version
    await refit.update_weights_from_path(
        pb.UpdateWeightsFromPathRequest(path=path, options=options)
    )


Phase = Callable[[RefitRpc, Body, pb.WeightUpdateOptions, str | None], Awaitable[None]]
# update_weights_from_distributed's engine_rpc -> its contract RPC.
_PHASES: dict[str, Phase] = {
    "start_weight_update": _start,
    "update_weights": _update,
    "finish_weight_update": _finish,
    "update_weights_from_path": _from_path,
}


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


def _expected_changes(body: Body) -> int | None:
    """The fence a writer sends (``expect_weight_changes``: the engine's count of
    weight changes it read), or None."""
    value = body.get("expect_weight_changes")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise RouteError(
            f"'expect_weight_changes' must be a count of weight changes (an integer >= 0), "
            f"got {clip(value)}"
        )
    return value


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
        watch: Callable[[], EngineWatch | None] = lambda: None,
    ) -> None:
        self._client = client
        self._registration = registration
        # The engine's health watch: sleep and wake ask it to recheck (pool membership).
        self._watch = watch
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

    def _fenceable(self, expect: int | None) -> int | None:
        """``expect``, once the engine server is known to honour it (an older one
        would ignore the fence: refused rather than unfenced)."""
        if expect is None:
            return None
        revision = self._engine().server_revision
        if revision < WEIGHT_FENCE_REVISION:
            raise RouteError(
                f"'expect_weight_changes' needs an engine server of contract revision "
                f"{WEIGHT_FENCE_REVISION} or later; this one implements {revision}"
            )
        return expect

    async def _version_state(self) -> Body:
        answer = await self._refit().get_weight_version()
        declared = bool(answer.declared)
        return {
            "version": answer.weight_version if declared else None,
            "version_declared": declared,
            "serving": answer.weight_version,
            "weight_changes": answer.weight_changes,
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
        expect = self._fenceable(_expected_changes(body))
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
        if expect is not None:
            options.expect_weight_changes = expect
        answer = await self._refit().update_weights_from_path(
            pb.UpdateWeightsFromPathRequest(path=path, options=options)
        )
        return {**_updated(body), "weight_changes": answer.result.weight_changes}

    @_route
    async def update_weights_from_distributed(self, body: Body) -> Body:
        """dynamo.vllm's dispatch: the one phase ``engine_rpc`` names (default
        ``update_weights_from_path``), with the body's other keys as its keyword
        arguments; then the prefix cache reset when asked, the version set when sent."""
        options = pb.WeightUpdateOptions(
            allow_unpaused=_bool(body, "allow_unpaused", False),
            reset_prefix_cache=_bool(body, "reset_prefix_cache", True),
        )
        # dynamo.vllm's order: the options' own rule, the body, then "not paused".
        _refuse(update_refusal(options))
        version = _version(body["weight_version"]) if "weight_version" in body else None
        kwargs = {k: v for k, v in body.items() if k not in _RESERVED}
        _json(kwargs)
        await self._check_paused(options)
        rpc = body.get("engine_rpc", "update_weights_from_path")
        phase = _PHASES.get(rpc) if isinstance(rpc, str) else None
        if phase is None:
            raise RouteError(
                f"engine_rpc {clip(rpc)} is not one this worker runs; expected one of "
                f"{', '.join(_PHASES)} ({PHASE_ORDER})"
            )
        refit = self._refit()
        try:
            # The reset is the route's, after the phase, as dynamo.vllm does it;
            # a path update carries it (and its version) to the engine server.
            await phase(refit, kwargs, options, version)
        except grpc.aio.AioRpcError as e:
            details = e.details() or ""
            if details in _OUT_OF_ORDER:
                raise RouteError(
                    f"engine_rpc {rpc!r} is out of order: {details} ({PHASE_ORDER}); "
                    "this call changed nothing"
                ) from None
            raise
        if rpc != "update_weights_from_path":
            if options.reset_prefix_cache:
                await refit.reset_prefix_cache()
            if version is not None and rpc != "finish_weight_update":
                await refit.update_weight_version(
                    pb.UpdateWeightVersionRequest(weight_version=version)
                )
        log.info("RL update_weights_from_distributed: %s done (version %s)", rpc, version)
        return _updated(body)

    @_route
    async def update_weights_from_tensor(self, body: Body) -> Body:
        raise RouteError(
            "update_weights_from_tensor is not implemented over HTTP: stream the tensors to "
            "the engine server's UpdateWeightsFromTensors (engine_contract.tensors.update_requests)"
        )

    @_route
    async def init_weights_update_group(self, body: Body) -> Body:
        """``init_info`` is the init info (NeMo RL's ``init_weight_transfer_engine``);
        a body without one (dynamo.vllm's default ``init_broadcaster``) is the info
        itself, less ``engine_rpc``. Bounded by ``DYN_RL_INIT_WEIGHTS_TIMEOUT_S``
        (default 30 s), read as dynamo.vllm reads it: past it the transfer engine is
        shut down and the worker keeps serving (dynamo.vllm terminates the worker)."""
        rpc = body.get("engine_rpc", "init_broadcaster")
        if rpc not in _INIT_RPCS:
            raise RouteError(
                f"engine_rpc {clip(rpc)} is not one this worker runs to initialize the "
                f"weight-update group; expected one of {', '.join(_INIT_RPCS)}"
            )
        if "init_info" in body:
            info = body["init_info"]
            if not isinstance(info, dict):
                raise RouteError(f"'init_info' must be a JSON object, got {clip(info)}")
            extra = sorted(k for k in body if k not in ("engine_rpc", "init_info"))
            if extra:
                raise RouteError(
                    f"{rpc} takes only 'init_info'; unexpected keys: {', '.join(extra)}"
                )
        else:
            info = {k: v for k, v in body.items() if k != "engine_rpc"}
        timeout_s = _init_timeout_s()
        request = pb.InitWeightTransferEngineRequest(
            init_info_json=_json(info).encode(),
            timeout_ms=min(max(1, round(timeout_s * 1000)), _MAX_TIMEOUT_MS),
        )
        refit = self._refit()
        init = asyncio.ensure_future(refit.init_weight_transfer_engine(request))
        try:
            done, _ = await asyncio.wait({init}, timeout=timeout_s)
        except asyncio.CancelledError:
            init.cancel()
            raise
        if init in done:
            init.result()
            log.info("RL weight-update group initialized (engine_rpc=%s)", rpc)
            return {"status": "ok", "message": "Weight update group initialized"}
        init.cancel()
        await asyncio.gather(init, return_exceptions=True)
        log.error(
            "RL init_weights_update_group timed out after %g s (%s); shutting the "
            "weight-transfer engine down",
            timeout_s,
            INIT_TIMEOUT_ENV,
        )
        teardown = "was shut down"
        try:
            await asyncio.wait_for(refit.shutdown_weight_transfer_engine(), _TEARDOWN_S)
        except Exception as e:
            log.warning("shutting the weight-transfer engine down failed: %r", e)
            teardown = "is being shut down by the engine server"
        raise RouteError(
            f"init_weights_update_group did not finish within {timeout_s:g} s "
            f"({INIT_TIMEOUT_ENV}); the weight-transfer engine {teardown}, and the worker "
            "keeps serving its old weights"
        )

    @_route
    async def destroy_weights_update_group(self, body: Body) -> Body:
        rpc = body.get("engine_rpc", "destroy_broadcaster")
        if rpc not in _DESTROY_RPCS:
            raise RouteError(
                f"engine_rpc {clip(rpc)} is not one this worker runs to destroy the "
                f"weight-update group; expected one of {', '.join(_DESTROY_RPCS)}"
            )
        await self._refit().shutdown_weight_transfer_engine()
        log.info("RL weight-update group destroyed (engine_rpc=%s)", rpc)
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
        expect = self._fenceable(_expected_changes(body))
        request = pb.UpdateWeightVersionRequest(weight_version=label)
        if expect is not None:
            request.expect_weight_changes = expect
        answer = await self._refit().update_weight_version(request)
        return {"status": "ok", "version": value, "weight_changes": answer.weight_changes}

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
        # Back at the engine's next SERVING answer, whoever wakes it: a wake over
        # gRPC within the watch's window would otherwise leave the worker out.
        watch = self._watch()
        if watch is not None:
            watch.recheck()
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
            # Woken elsewhere (over gRPC, by another caller): in the pool all the same.
            await self._back_in_pool("the engine is awake")
            return {"status": "ok", "message": "Engine already awake"}
        answer = await refit.wake_up(pb.WakeUpRequest(tags=tags or []))
        if not answer.awake:
            return {"status": "ok", "message": "Engine partially awake", "is_sleeping": True}
        await self._back_in_pool("the engine woke up")
        return {"status": "ok", "message": "Engine woke"}

    async def _back_in_pool(self, reason: str) -> None:
        """The engine is awake: the worker rejoins the pool if it is out, through the
        watch (which re-reads the server and keeps a refused or catching-up one out),
        awaited so that the answer finds the worker back."""
        if self._registration.in_pool:
            return
        watch = self._watch()
        if watch is None:  # nothing watches the engine yet: no other way back
            await self._registration.rejoin(reason)
            return
        mark = watch.recheck()
        try:
            async with asyncio.timeout(_REJOIN_WAIT_S):
                await watch.checked(mark)
        except TimeoutError:
            log.warning("%s, but its health did not answer within %g s", reason, _REJOIN_WAIT_S)
