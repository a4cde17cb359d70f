"""The ways new weights arrive, each run under the refit control's rules: a checkpoint
folder, a stream of tensors, a weight-transfer engine's phases.

Apart from ``RefitControl`` because the rules are one thing (the lock, paused
first, the fence, the label set only once the whole update succeeded, weights
unknown after a load that failed part way) and the ways in are several: each
takes the lock and passes those rules (``RefitControl.check_update``, ``begin``,
``load``, ``finish_update``), and does only its own engine work here, bounded by
the refit deadlines. The control holds every piece of state, the transfer
phases' included (``RefitControl.transfer``); nothing here keeps any.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb
from engine_server.admission import check_length
from engine_server.backends.base import EngineBackend
from engine_server.backends.checkpoint import FolderNotAllowed, preflight
from engine_server.backends.refit import (
    RefitUnsupported,
    TensorSpec,
    WeightUpdateError,
    WeightWriter,
)
from engine_server.config import RefitConfig
from engine_server.deadlines import Expired, in_daemon_thread, to_the_end
from engine_server.errors import InvalidRequest, RefitRefused, RefitTimedOut, WeightsPathDenied
from engine_server.refit_control import RefitControl, check_version

log = logging.getLogger(__name__)

# The longest path an update may name (PATH_MAX).
MAX_PATH_LENGTH = 4096


class WeightUpdates:
    """Updates from a path, from streamed tensors, and through a transfer engine."""

    def __init__(self, refit: RefitControl, backend: EngineBackend, config: RefitConfig) -> None:
        self._refit = refit
        self._backend = backend
        self._config = config

    # -- a checkpoint folder ------------------------------------------------------

    async def update_from_path(
        self, request: pb.UpdateWeightsFromPathRequest
    ) -> pb.UpdateWeightsFromPathResponse:
        if not request.path:
            raise InvalidRequest("path", "must name a checkpoint directory")
        check_length("path", request.path, MAX_PATH_LENGTH)
        if "\0" in request.path:
            raise InvalidRequest("path", "holds a NUL character")
        refit = self._refit
        async with refit.lock:
            reset = refit.check_update(request.options)
            started = time.monotonic()
            path = request.path
            if self._backend.rl_capabilities().update_from_path:  # else: it says why not
                path = await self._checked_path(path)
            refit.begin()
            load = await refit.load(
                self._backend.load_weights_from_path(
                    path, allow_partial=request.options.allow_partial
                ),
                "path",
                f"loading the weights from {clip(path)}",
                self._config.timeout_s,
            )
            result = await refit.finish_update(request.options, load, reset, started)
            log.info("weights loaded from %s: version %s", path, result.weight_version)
            return pb.UpdateWeightsFromPathResponse(result=result)

    async def _checked_path(self, path: str) -> str:
        """The path the backend loads: resolved, allowed, every header readable
        (``preflight``), within the check deadline; otherwise a refusal."""
        limit = self._config.check_timeout_s
        allowed = self._config.allowed_dirs
        try:
            async with asyncio.timeout(limit):
                return await in_daemon_thread(lambda: preflight(path, allowed))
        except TimeoutError:  # preflight raises none of its own (it wraps them)
            raise RefitTimedOut(
                f"checking the checkpoint at {clip(path)} took longer than the check "
                f"deadline of {limit:g} s (--refit-check-timeout-s); nothing was loaded, "
                "the old weights still serve"
            ) from None
        except FolderNotAllowed as e:
            raise WeightsPathDenied(str(e)) from e
        except WeightUpdateError as e:
            raise InvalidRequest("path", f"{e}; the old weights still serve") from e

    # -- a stream of tensors ------------------------------------------------------

    async def update_from_tensors(
        self,
        options: pb.WeightUpdateOptions,
        specs: list[TensorSpec],
        chunks: AsyncIterator[memoryview],
    ) -> pb.UpdateWeightsFromTensorsResponse:
        """A streamed update, its manifest decoded (``specs``); ``chunks``: its bytes
        in order, as they arrive (``refit_requests`` checks them). Every byte
        arrives within the refit deadline, or nothing loads."""
        refit = self._refit
        async with refit.lock:
            reset = refit.check_update(options)
            started = time.monotonic()
            limit = self._config.timeout_s
            loop = asyncio.get_running_loop()
            deadline = loop.time() + limit
            late = RefitTimedOut(
                f"the streamed weight update did not arrive whole within the refit "
                f"deadline of {limit:g} s (--refit-timeout-s); nothing was loaded, the "
                "old weights still serve"
            )
            try:
                writer = await self._begin_tensor_update(specs, options, limit)
            except Expired:
                raise late from None
            timer = asyncio.timeout_at(deadline)
            try:
                async with timer:
                    async for data in chunks:
                        await writer.write(data)
            except BaseException as e:
                await writer.discard()
                if isinstance(e, TimeoutError) and timer.expired():
                    raise late from None
                raise
            left = deadline - loop.time()
            if left <= 0:  # every byte came, just too late: still nothing loaded
                await writer.discard()
                raise late
            refit.begin()
            try:
                load = await refit.load(
                    writer.commit(), "tensors", "committing the streamed weights", left
                )
            finally:
                await writer.discard()  # nothing once committed; else what was received
            result = await refit.finish_update(options, load, reset, started)
            log.info(
                "weights streamed: %d tensors, %d bytes in %d ms: version %s",
                load.tensors,
                load.bytes,
                result.load_ms,
                result.weight_version,
            )
            return pb.UpdateWeightsFromTensorsResponse(result=result)

    async def _begin_tensor_update(
        self, specs: list[TensorSpec], options: pb.WeightUpdateOptions, timeout_s: float
    ) -> WeightWriter:
        """The backend's writer once it checked the manifest; a check past the
        deadline is cancelled (``Expired``): it had loaded nothing."""
        step = asyncio.ensure_future(
            self._backend.begin_tensor_update(specs, allow_partial=options.allow_partial)
        )
        try:
            return await to_the_end(step, timeout_s)
        except Expired:
            step.cancel()
            raise
        except WeightUpdateError as e:
            raise InvalidRequest("manifest", f"{e}; the old weights still serve") from e
        except RefitUnsupported as e:
            raise RefitRefused(str(e)) from e

    # -- a weight-transfer engine (vLLM's NCCL and the like) ------------------------

    async def init_weight_transfer(
        self, info: dict[str, Any], timeout_s: float | None = None
    ) -> None:
        """``timeout_s``: the caller's deadline (the request's ``timeout_ms``; never
        past the refit deadline). Past it the transfer engine is shut down and the
        answer is DEADLINE_EXCEEDED naming that deadline; the old weights serve. A
        ``gloo`` init info without its own ``timeout_s`` gets this one, so that the
        rendezvous the engine is blocked in gives up too (and the teardown behind it
        can run)."""
        limit, source = self._config.timeout_s, "the refit deadline of {:g} s (--refit-timeout-s)"
        if timeout_s is not None and 0 < timeout_s < limit:
            limit, source = timeout_s, "the caller's init deadline of {:g} s (timeout_ms)"
            if (
                self._backend.rl_capabilities().weight_transfer_backend == "gloo"
                and "timeout_s" not in info
            ):
                info["timeout_s"] = timeout_s
        async with self._refit.lock:
            await self._refit.transfer.init(info, limit, source.format(limit))

    async def start_weight_update(self, options: pb.WeightUpdateOptions) -> None:
        refit = self._refit
        async with refit.lock:
            refit.transfer.refuse_if_started()
            reset = refit.check_update(options)
            refit.begin()
            await refit.transfer.start(
                refit.changing(self._backend.start_weight_update()), options, reset
            )

    async def update_weights(self, info: dict[str, Any] | list[dict[str, Any]]) -> None:
        refit = self._refit
        async with refit.lock:
            refit.transfer.started()
            try:
                await refit.transfer.load_round(refit.changing(self._backend.update_weights(info)))
            except WeightUpdateError as e:  # refused before the engine saw it
                raise InvalidRequest(
                    "update_info_json", f"{e}; nothing was loaded, the weights serving stay"
                ) from e

    async def finish_weight_update(
        self, request: pb.FinishWeightUpdateRequest
    ) -> pb.FinishWeightUpdateResponse:
        if request.HasField("weight_version"):
            check_version("weight_version", request.weight_version)
        refit = self._refit
        async with refit.lock:
            update = refit.transfer.started()
            # The label, and whether the update may have named only some tensors.
            options = pb.WeightUpdateOptions(allow_partial=update.options.allow_partial)
            if request.HasField("weight_version"):
                options.weight_version = request.weight_version
            try:
                load = await refit.load(
                    self._backend.finish_weight_update(),
                    "update",
                    "FinishWeightUpdate",
                    self._config.timeout_s,
                    begun_here=False,  # counted at StartWeightUpdate, loaded since
                )
                if update.orphaned is None:
                    result = await refit.finish_update(options, load, update.reset, update.started)
            except BaseException:
                # Loaded or not, its label is not set: the rounds stay as they are.
                refit.transfer.drop("its FinishWeightUpdate failed or its caller left")
                raise
            if update.orphaned is not None:
                refit.transfer.drop("its FinishWeightUpdate, which set no label")
                left = (
                    "load whole weights (a new update to its finish, or a checkpoint) "
                    "before resuming"
                    if update.rounds
                    else "no round of it reached the engine: the old weights still serve"
                )
                raise RefitRefused(
                    f"FinishWeightUpdate ended the engine's update, but {update.orphaned}, on "
                    "an engine that cannot roll it back: its rounds are no one update, so "
                    f"its label is not set; {left}"
                )
            refit.transfer.close()
            return pb.FinishWeightUpdateResponse(result=result)

    async def shutdown_weight_transfer(self) -> None:
        async with self._refit.lock:
            await self._refit.transfer.shut_down()
