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

The weight-transfer routes (``update_weights_from_distributed``'s dispatch, the
weight-update group's init and destroy) are ``bridge.admin.weight_transfer``'s;
what every route shares (the error answer and its kind, the body's values, an
update's answer) is ``bridge.admin.answers``'.

These handlers are the one implementation behind all three spellings of the
routes (``bridge.admin.surface``: dynamo.vllm's ``/engine/<name>``, vLLM's own
root-level routes, the Dynamo sidecar's ``/engine/control|update/<name>``).
``operations()`` adds what only the other two spellings ask for (whether the
engine is paused or asleep, aborting every request, the cache reset's outcome,
the weight world size), with the same body rules and error answers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from bridge.admin.answers import (
    Body,
    ErrorAnswer,
    ErrorBody,
    ErrorKind,
    check_paused,
    flag,
    status_kind,
    updated,
    version_label,
)
from bridge.admin.weight_transfer import WeightTransfer
from bridge.client import EngineClient
from bridge.engine_watch import EngineWatch
from bridge.registration import Registration
from engine_contract.refit_rules import PAUSE_MODE_CHOICES, PAUSE_MODES
from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb
from rl_client.refit_rpc import RefitRpc

log = logging.getLogger(__name__)

Route = Callable[[Any], Awaitable[Body]]

# How long control/wake_up waits for the worker to be back in the pool.
_REJOIN_WAIT_S = 10.0


def _route(
    handler: Callable[[RlAdmin, Body], Awaitable[Body]],
) -> Callable[[RlAdmin, Any], Awaitable[Body]]:
    """Body rules and error answers shared by every route."""

    @functools.wraps(handler)
    async def wrapper(self: RlAdmin, body: Any) -> Body:
        if body is None:
            body = {}
        elif not isinstance(body, dict):
            return _error("request body must be a JSON object", ErrorKind.INVALID)
        try:
            return await handler(self, body)
        except ErrorAnswer as e:
            return _error(str(e), e.kind, **e.extra)
        except grpc.aio.AioRpcError as e:
            log.warning("RL route %s: %s: %s", handler.__name__, e.code().name, e.details())
            return _error(e.details() or e.code().name, status_kind(e.code()))
        except Exception as e:
            log.exception("RL route %s failed", handler.__name__)
            return _error(str(e) or type(e).__name__, ErrorKind.FAILED)

    return wrapper


def _error(message: str, kind: ErrorKind, **extra: Any) -> ErrorBody:
    return ErrorBody({"status": "error", **extra, "message": message}, kind)


def _pause_mode(body: Body, default: str) -> str:
    """The body's pause mode by name (``default`` when absent), as dynamo.vllm checks it."""
    mode = body.get("mode", default)
    if not isinstance(mode, str) or mode not in PAUSE_MODES:
        shown = mode if isinstance(mode, str) and len(mode) <= 40 else clip(mode)
        raise ErrorAnswer(f"Invalid mode '{shown}'; expected {PAUSE_MODE_CHOICES}")
    return mode


def weight_world_size(info: pb.GetServerInfoResponse, *, include_dp: bool = True) -> int:
    """The ranks of this worker in a trainer's weight-transfer group, counted as
    vLLM's ``get_world_size`` counts them: tensor x pipeline ranks per
    data-parallel replica, times the replicas this engine server hosts when
    ``include_dp``. The contract carries no tensor or pipeline size, so each
    replica counts as one rank (the ``rl`` endpoint's ``world_size`` is this too)."""
    return max(1, info.engine_config.data_parallel_size) if include_dp else 1


def _expected_changes(body: Body) -> int | None:
    """The fence a writer sends (``expect_weight_changes``: the engine's count of
    weight changes it read), or None."""
    value = body.get("expect_weight_changes")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise ErrorAnswer(
            f"'expect_weight_changes' must be a count of weight changes (an integer >= 0), "
            f"got {clip(value)}"
        )
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
        self._transfer = WeightTransfer(self._refit, _expected_changes)

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

    def operations(self) -> dict[str, Route]:
        """Every handler by name: dynamo.vllm's routes and what the other spellings
        of them need besides (``bridge.admin.surface``)."""
        return {
            **self.routes(),
            "is_paused": self.is_paused,
            "is_sleeping": self.is_sleeping,
            "abort_all": self.abort_all,
            "reset_prefix_cache": self.reset_prefix_cache,
            "world_size": self.world_size,
        }

    def _engine(self) -> EngineClient:
        client = self._client()
        if client is None:
            raise ErrorAnswer("the bridge is not connected to its engine server", ErrorKind.FAILED)
        return client

    def _refit(self) -> RefitRpc:
        return self._engine().refit

    async def _version_state(self) -> Body:
        answer = await self._refit().get_weight_version()
        declared = bool(answer.declared)
        return {
            "version": answer.weight_version if declared else None,
            "version_declared": declared,
            "serving": answer.weight_version,
            "weight_changes": answer.weight_changes,
            # Contract revision 12: why the weights are not whole under the label
            # ("" when they are), and whether a weight-transfer update is open.
            "weights_mixed": answer.weights_mixed,
            "weight_update_open": answer.weight_update_open,
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
        mode = _pause_mode(body, "keep")
        clear_cache = flag(body, "clear_cache", False)
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
    async def is_paused(self, body: Body) -> Body:
        return {"status": "ok", "is_paused": bool((await self._refit().is_paused()).paused)}

    @_route
    async def flush_cache(self, body: Body) -> Body:
        await self._refit().reset_prefix_cache()
        return {"status": "ok", "message": "Cache flushed"}

    @_route
    async def reset_prefix_cache(self, body: Body) -> Body:
        """As ``flush_cache``, answering whether the engine could reset (it cannot
        while blocks are in use, on an engine that does not reset then)."""
        answer = await self._refit().reset_prefix_cache()
        return {"status": "ok", "reset": bool(answer.reset)}

    @_route
    async def abort_request(self, body: Body) -> Body:
        request_id = body.get("request_id")
        if not request_id:
            raise ErrorAnswer("Missing 'request_id' in body")
        if not isinstance(request_id, str):
            raise ErrorAnswer(f"'request_id' must be a string, got {clip(request_id)}")
        await self._engine().abort(self._engine_request_id(request_id))
        return {"status": "ok", "request_id": request_id}

    @_route
    async def abort_all(self, body: Body) -> Body:
        """Every request the engine server runs ends now (generation is not paused)."""
        answer = await self._engine().abort_all()
        return {"status": "ok", "aborted": int(answer.aborted_count)}

    @_route
    async def world_size(self, body: Body) -> Body:
        """The weight receivers of this worker (``weight_world_size``)."""
        info = await self._engine().server_info()
        include_dp = flag(body, "include_dp", True)
        return {"status": "ok", "world_size": weight_world_size(info, include_dp=include_dp)}

    # -- weights ----------------------------------------------------------------

    @_route
    async def update_weights_from_disk(self, body: Body) -> Body:
        # A bad label before any RPC; otherwise dynamo.vllm's order: "not paused"
        # before anything else about the body.
        version = version_label(body["weight_version"]) if "weight_version" in body else None
        expect = _expected_changes(body)
        options = pb.WeightUpdateOptions()
        await check_paused(self._refit, options)
        path = body.get("model_path")
        if not path:
            raise ErrorAnswer("Missing 'model_path' in body")
        if not isinstance(path, str):
            raise ErrorAnswer(f"'model_path' must be a string, got {clip(path)}")
        engine_rpc = body.get("engine_rpc", "reload_weights")
        if engine_rpc != "reload_weights":
            raise ErrorAnswer(
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
        return {**updated(body), "weight_changes": answer.result.weight_changes}

    @_route
    async def update_weights_from_distributed(self, body: Body) -> Body:
        return await self._transfer.update_weights_from_distributed(body)

    @_route
    async def update_weights_from_tensor(self, body: Body) -> Body:
        raise ErrorAnswer(
            "update_weights_from_tensor is not implemented over HTTP: stream the tensors to "
            "the engine server's UpdateWeightsFromTensors (engine_contract.tensors.update_requests)"
        )

    @_route
    async def init_weights_update_group(self, body: Body) -> Body:
        return await self._transfer.init_weights_update_group(body)

    @_route
    async def destroy_weights_update_group(self, body: Body) -> Body:
        return await self._transfer.destroy_weights_update_group(body)

    @_route
    async def get_weight_version(self, body: Body) -> Body:
        return {"status": "ok", **await self._version_state()}

    @_route
    async def set_weight_version(self, body: Body) -> Body:
        if "weight_version" not in body:
            raise ErrorAnswer("Missing 'weight_version' in body")
        value = body["weight_version"]
        label = version_label(value)
        expect = _expected_changes(body)
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
            raise ErrorAnswer(f"'level' must be an integer, got {clip(level)}")
        if not 0 <= level < 2**32:
            raise ErrorAnswer(f"'level' must be a sleep level (0 or more), got {level}")
        # How requests in flight end first (vLLM's sleep takes a pause mode).
        mode = PAUSE_MODES[_pause_mode(body, "abort")]
        refit = self._refit()
        if (await refit.is_sleeping()).sleeping:
            return {"status": "ok", "message": "Engine already sleeping"}
        # Out of the pool first: no request should be routed to a sleeping engine.
        await self._registration.leave("the engine goes to sleep")
        try:
            await refit.sleep(pb.SleepRequest(level=level, mode=mode))
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
    async def is_sleeping(self, body: Body) -> Body:
        return {"status": "ok", "is_sleeping": bool((await self._refit().is_sleeping()).sleeping)}

    @_route
    async def wake_up(self, body: Body) -> Body:
        tags = body.get("tags")
        if tags is not None and (
            not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)
        ):
            raise ErrorAnswer(f"'tags' must be a list of strings, got {clip(tags)}")
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
