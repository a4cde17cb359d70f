"""dynamo.vllm's weight-transfer routes: ``update_weights_from_distributed``'s
dispatch, and the weight-update group's ``init_weights_update_group`` and
``destroy_weights_update_group`` (``RlAdmin`` serves them; ``bridge.admin.rl_admin``).

``update_weights_from_distributed`` dispatches as dynamo.vllm's does:
``engine_rpc`` names one phase, and the body's other keys (less
``allow_unpaused``, ``engine_rpc``, ``reset_prefix_cache``, ``weight_version``)
are its keyword arguments. ``start_weight_update`` (``is_checkpoint_format``:
true, or absent; vLLM 0.32 takes no argument there) -> StartWeightUpdate;
``update_weights`` (``update_info``) -> UpdateWeights with that info;
``finish_weight_update`` -> FinishWeightUpdate, labelled with ``weight_version``;
``update_weights_from_path`` (the default: ``weights_path``, ``model_path`` or
``path``) -> UpdateWeightsFromPath. After the phase, the prefix cache is reset when
``reset_prefix_cache`` (default true) and the version set when one was sent.
``init_weights_update_group``: ``init_info`` is the init info (a body without one
is the info itself); ``destroy_weights_update_group``: ShutdownWeightTransferEngine.
A phase out of order or an unknown ``engine_rpc`` is an error answer naming the
order; the engine keeps its old weights and version. ``expect_weight_changes``
(the writer's fence, as ``update_weights_from_disk`` takes it) guards where a
load begins: ``start_weight_update`` and ``update_weights_from_path``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable

import grpc

from bridge.admin.answers import (
    Body,
    ErrorAnswer,
    ErrorKind,
    check_paused,
    flag,
    refuse,
    strict_json,
    updated,
    version_label,
)
from engine_contract.refit_rules import PHASE_ORDER, PhaseRefusal, update_refusal
from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb
from rl_client.refit_rpc import RefitRpc

log = logging.getLogger(__name__)

# Keys of update_weights_from_distributed that are not the engine's own.
_RESERVED = (
    "allow_unpaused",
    "engine_rpc",
    "expect_weight_changes",
    "reset_prefix_cache",
    "weight_version",
)
# The phases a writer's fence (expect_weight_changes) may guard: where a load begins.
_FENCED = ("start_weight_update", "update_weights_from_path")
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


def _init_timeout_s() -> float:
    raw = os.environ.get(INIT_TIMEOUT_ENV, str(INIT_TIMEOUT_DEFAULT_S))
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ErrorAnswer(f"{INIT_TIMEOUT_ENV}={clip(raw)} is not a positive number of seconds")
    return value


def _kwargs(rpc: str, kwargs: Body, allowed: tuple[str, ...]) -> None:
    """dynamo.vllm passes the body's other keys to the engine as keyword arguments:
    one the phase does not take fails there; here, before any RPC."""
    extra = sorted(k for k in kwargs if k not in allowed)
    if extra:
        takes = f"only {', '.join(repr(a) for a in allowed)}" if allowed else "no arguments"
        raise ErrorAnswer(f"{rpc} takes {takes}; unexpected keys: {', '.join(extra)}")


async def _start(
    refit: RefitRpc, kwargs: Body, options: pb.WeightUpdateOptions, version: str | None
) -> None:
    # vLLM 0.32's start_weight_update takes no arguments: its layerwise reload
    # takes checkpoint-format weights, which is what is_checkpoint_format: true
    # (NeMo RL's) says; false (kernel-format weights) it cannot do.
    _kwargs("start_weight_update", kwargs, ("is_checkpoint_format",))
    fmt = kwargs.get("is_checkpoint_format", True)
    if not isinstance(fmt, bool):
        raise ErrorAnswer("'is_checkpoint_format' must be a boolean")
    if not fmt:
        raise ErrorAnswer(
            "is_checkpoint_format false is not supported: this engine's weight transfer "
            "loads checkpoint-format weights only"
        )
    start = pb.WeightUpdateOptions(allow_unpaused=options.allow_unpaused, reset_prefix_cache=False)
    if options.HasField("expect_weight_changes"):
        start.expect_weight_changes = options.expect_weight_changes
    await refit.start_weight_update(pb.StartWeightUpdateRequest(options=start))


async def _update(
    refit: RefitRpc, kwargs: Body, options: pb.WeightUpdateOptions, version: str | None
) -> None:
    _kwargs("update_weights", kwargs, ("update_info",))
    if "update_info" not in kwargs:
        raise ErrorAnswer("Missing 'update_info' in body")
    info = kwargs["update_info"]
    if not isinstance(info, dict) and not (
        isinstance(info, list) and all(isinstance(i, dict) for i in info)
    ):
        raise ErrorAnswer(
            f"'update_info' must be a JSON object or a list of them, got {clip(info)}"
        )
    await refit.update_weights(pb.UpdateWeightsRequest(update_info_json=strict_json(info).encode()))


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
        raise ErrorAnswer(f"Missing {' or '.join(repr(k) for k in _PATH_KEYS)} in body")
    if not isinstance(path, str) or not path:
        raise ErrorAnswer(f"the checkpoint path must be a non-empty string, got {clip(path)}")
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


# A body -> its writer's fence (``expect_weight_changes``), checked, or None.
Fence = Callable[[Body], int | None]


class WeightTransfer:
    """The weight-transfer routes of one worker, over its engine server's refit RPCs
    (``refit``: asked for them only once the body passed its checks). ``fence``
    reads a body's ``expect_weight_changes`` as every fenced route does."""

    def __init__(self, refit: Callable[[], RefitRpc], fence: Fence = lambda body: None) -> None:
        self._refit = refit
        self._fence = fence

    async def update_weights_from_distributed(self, body: Body) -> Body:
        """dynamo.vllm's dispatch: the one phase ``engine_rpc`` names (default
        ``update_weights_from_path``), with the body's other keys as its keyword
        arguments; then the prefix cache reset when asked, the version set when sent."""
        options = pb.WeightUpdateOptions(
            allow_unpaused=flag(body, "allow_unpaused", False),
            reset_prefix_cache=flag(body, "reset_prefix_cache", True),
        )
        # dynamo.vllm's order: the options' own rule, the body, then "not paused".
        refuse(update_refusal(options))
        version = version_label(body["weight_version"]) if "weight_version" in body else None
        kwargs = {k: v for k, v in body.items() if k not in _RESERVED}
        strict_json(kwargs)
        rpc = body.get("engine_rpc", "update_weights_from_path")
        expect = self._fence(body)
        if expect is not None:
            if rpc not in _FENCED:
                raise ErrorAnswer(
                    f"'expect_weight_changes' fences where a load begins ({' or '.join(_FENCED)}), "
                    f"not engine_rpc {clip(rpc)}"
                )
            options.expect_weight_changes = expect
        await check_paused(self._refit, options)
        phase = _PHASES.get(rpc) if isinstance(rpc, str) else None
        if phase is None:
            raise ErrorAnswer(
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
                raise ErrorAnswer(
                    f"engine_rpc {rpc!r} is out of order: {details} ({PHASE_ORDER}); "
                    "this call changed nothing",
                    ErrorKind.REFUSED,
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
        return updated(body)

    async def init_weights_update_group(self, body: Body) -> Body:
        """``init_info`` is the init info (NeMo RL's ``init_weight_transfer_engine``);
        a body without one (dynamo.vllm's default ``init_broadcaster``) is the info
        itself, less ``engine_rpc``. Bounded by ``DYN_RL_INIT_WEIGHTS_TIMEOUT_S``
        (default 30 s), read as dynamo.vllm reads it: past it the transfer engine is
        shut down and the worker keeps serving (dynamo.vllm terminates the worker)."""
        rpc = body.get("engine_rpc", "init_broadcaster")
        if rpc not in _INIT_RPCS:
            raise ErrorAnswer(
                f"engine_rpc {clip(rpc)} is not one this worker runs to initialize the "
                f"weight-update group; expected one of {', '.join(_INIT_RPCS)}"
            )
        if "init_info" in body:
            info = body["init_info"]
            if not isinstance(info, dict):
                raise ErrorAnswer(f"'init_info' must be a JSON object, got {clip(info)}")
            extra = sorted(k for k in body if k not in ("engine_rpc", "init_info"))
            if extra:
                raise ErrorAnswer(
                    f"{rpc} takes only 'init_info'; unexpected keys: {', '.join(extra)}"
                )
        else:
            info = {k: v for k, v in body.items() if k != "engine_rpc"}
        timeout_s = _init_timeout_s()
        request = pb.InitWeightTransferEngineRequest(
            init_info_json=strict_json(info).encode(),
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
        raise ErrorAnswer(
            f"init_weights_update_group did not finish within {timeout_s:g} s "
            f"({INIT_TIMEOUT_ENV}); the weight-transfer engine {teardown}, and the worker "
            "keeps serving its old weights",
            ErrorKind.FAILED,
        )

    async def destroy_weights_update_group(self, body: Body) -> Body:
        rpc = body.get("engine_rpc", "destroy_broadcaster")
        if rpc not in _DESTROY_RPCS:
            raise ErrorAnswer(
                f"engine_rpc {clip(rpc)} is not one this worker runs to destroy the "
                f"weight-update group; expected one of {', '.join(_DESTROY_RPCS)}"
            )
        await self._refit().shutdown_weight_transfer_engine()
        log.info("RL weight-update group destroyed (engine_rpc=%s)", rpc)
        return {"status": "ok", "message": "Weight update group destroyed"}
