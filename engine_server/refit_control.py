"""The refit cycle's rules, whatever the engine: pause, update weights, version, resume.

``RefitControl`` is the core's part of the cycle; the backend acts on its
engine (``backends/refit.py``). What lives here:

- **One lock.** Pause, resume, weight updates, version changes, sleep and wake
  run one at a time: a resume never races an update.
- **The gate.** While paused (or asleep) new requests wait here, registered
  (so Abort and GetLoad see them), until resume, their own deadline, or an
  abort. They never reach the engine meanwhile.
- **Pause(ABORT)** marks every registered request first, so that each ends with
  ABORTED "aborted by a pause" (retryable), never a partial result that looks
  finished.
- **Updates** are refused unless paused (or ``allow_unpaused``, which then
  forbids the cache reset, as dynamo.vllm rules: ``engine_contract.refit_rules``,
  refused in the RL routes' words); the version is set only when
  the whole update succeeded; the prefix cache is reset after loading, and the
  reset reaches the KV-event stream at once.
- **Versions**: the label serving now, and whether anyone declared one.
- **The fence** (contract revision 10): ``weight_changes`` counts every weight
  or label change begun (one that failed part way too). A writer that read it
  may say which count it expects; when another writer came first (a second
  trainer, a catching-up bridge, a keeper) the change is refused before
  anything is touched, so no writer's load is overtaken by another's label.
- **Deadlines** (``RefitConfig``): no refit call holds the lock for good. A path
  is resolved, held to the allowed folders and its headers read (in a thread,
  under the check deadline) before the backend sees it: anything wrong there,
  the deadline included, is a refusal. Past the refit deadline, a step that had
  loaded nothing (a stream still arriving, a transfer engine starting) is
  refused; one that was loading leaves the weights unknown (``broken``), and
  the answer says so. Either way the lock is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from engine_contract import refit_rules
from engine_contract.labels import label_problem
from engine_contract.tensors import TENSOR_DTYPE_NAMES
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.base import EngineBackend
from engine_server.backends.checkpoint import checkpoint_schema
from engine_server.backends.refit import (
    PauseMode,
    RefitUnsupported,
    TensorSpec,
    WeightLoad,
    WeightUpdateError,
    WeightWriter,
)
from engine_server.config import RefitConfig
from engine_server.errors import (
    UPDATE_REFUSALS,
    EngineFailed,
    EngineUnavailable,
    InvalidRequest,
    RefitRefused,
    RefitTimedOut,
    ServerError,
    StaleWriter,
    UpdateStalled,
    WeightsPathDenied,
    clip,
)
from engine_server.handlers import Undecodable
from engine_server.metrics import ABORT_PAUSE
from engine_server.registry import ActiveRequest, RequestRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")

# The contract's pause modes (engine_contract.refit_rules: UNSPECIFIED is ABORT,
# as in vLLM) as the backends' PauseMode, which carries the same names.
PAUSE_MODES = {value: PauseMode(name) for value, name in refit_rules.PAUSE_MODE_NAMES.items()}
PAUSE_MODE_PB = {PauseMode(name): value for name, value in refit_rules.PAUSE_MODES.items()}
# Lengths of the refit cycle's strings: a path (PATH_MAX), a checkpoint's tensor
# name, a wake-up tag (version labels: engine_contract.labels).
MAX_PATH_LENGTH = 4096
MAX_TENSOR_NAME_LENGTH = 1024
MAX_TAG_LENGTH = 64


def _bounded(field: str, value: str, most: int) -> str:
    if len(value) > most:
        raise InvalidRequest(field, f"{len(value)} characters, more than the limit of {most}")
    return value


class _Expired(Exception):
    """An engine step ran past its deadline; it may still be running, unawaited."""


async def _to_the_end(step: Awaitable[T], timeout_s: float | None = None) -> T:
    """Run an engine step to its end even when the caller is cancelled (a client's
    deadline or disconnect): the lock stays held and the state stays true to what
    the engine did; the cancellation is raised afterwards. With ``timeout_s``,
    waiting stops there (``_Expired``, the step left running): the caller says
    what that leaves, and the lock is released."""
    task = asyncio.ensure_future(step)
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    cancelled = False
    while not task.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            task.add_done_callback(_ended_late)
            raise _Expired
        try:
            await asyncio.wait({task}, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the caller left, the cancellation wins
        raise asyncio.CancelledError
    return task.result()


def _ended_late(task: asyncio.Future[Any]) -> None:
    """A step given up on at its deadline ended after all: say how, once."""
    if task.cancelled():
        log.warning("a refit step given up on at its deadline was cancelled")
    elif task.exception() is not None:
        log.warning("a refit step given up on at its deadline failed: %s", task.exception())
    else:
        log.warning("a refit step given up on at its deadline ended after all")


def _in_daemon_thread(work: Callable[[], T]) -> asyncio.Future[T]:
    """``work`` on a thread of its own, a daemon: a check stuck in the kernel (a
    hung network mount) then neither keeps a pool's thread for good nor keeps the
    process from exiting, as a thread of the default executor would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # given up on (the deadline, a cancelled caller)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result: T | None = work()
            error: BaseException | None = None
        except BaseException as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="refit-check", daemon=True).start()
    return future


def _preflight(path: str, allowed: tuple[Path, ...]) -> str:
    """The path resolved (symlinks, ``..``), held to the allowed folders, and every
    file's header read: whatever is wrong is found before anything loads, and the
    path checked is the path the backend is given. Blocking: run off the loop."""
    try:
        resolved = os.path.realpath(path)
        if allowed:
            _check_allowed(path, resolved, allowed)
        checkpoint_schema(resolved)
    except (WeightUpdateError, WeightsPathDenied):
        raise
    except Exception as e:  # nothing loaded whatever it is: still a refusal
        raise WeightUpdateError(f"the checkpoint could not be checked: {clip(e, 300)}") from e
    return resolved


def _check_allowed(path: str, resolved: str, allowed: tuple[Path, ...]) -> None:
    roots = [os.path.realpath(folder) for folder in allowed]
    if any(os.path.commonpath([root, resolved]) == root for root in roots):
        return
    raise WeightsPathDenied(
        f"path: {clip(path)} resolves to {clip(resolved)}, outside the folders weight "
        f"updates may load from (--weights-allowed-dir {', '.join(clip(r) for r in roots)}); "
        "nothing was loaded, the old weights still serve"
    )


def _check_version(field: str, version: str) -> None:
    problem = label_problem(version)
    if problem is not None:
        raise InvalidRequest(field, problem)


# What a weight-transfer phase does, for what its deadline leaves (_transfer_step).
_SETUP = "setup"
_LOADING = "loading"

# How strongly a mode stops generation: pausing again may only strengthen it.
_STRENGTH = {PauseMode.KEEP: 0, PauseMode.WAIT: 1, PauseMode.ABORT: 2}


def _unsupported(e: RefitUnsupported) -> RefitRefused:
    return RefitRefused(str(e))


class RefitControl:
    def __init__(
        self,
        backend: EngineBackend,
        registry: RequestRegistry,
        *,
        on_state_change: Callable[[], object] | None = None,
        idle_timeout_s: float | None = 30.0,
        config: RefitConfig | None = None,
        on_weights_change: Callable[[str | None], Awaitable[None]] | None = None,
    ) -> None:
        self._backend = backend
        self._config = config or RefitConfig()
        # The longest a streamed update may go without its next message: a
        # trainer that stalls must not hold the refit lock for good.
        self._idle_timeout_s = idle_timeout_s
        self._registry = registry
        self._lock = asyncio.Lock()
        self.paused: PauseMode | None = None
        self.sleeping = False
        self.version_declared = False
        self._version = "default"
        # Weight and label changes begun (the fence; revision 10).
        self.weight_changes = 0
        self._changed = asyncio.Event()
        # Told when paused or asleep changes (the server's health follows sleep).
        self.on_state_change = on_state_change
        # Awaited just before the weights (None) or their label (the new one)
        # change: the core ends the version-guarded requests the change would alter.
        self.on_weights_change = on_weights_change
        # A weight-transfer update between StartWeightUpdate and FinishWeightUpdate:
        # (its options, whether to reset the cache after, when it started).
        self._transfer: tuple[pb.WeightUpdateOptions, bool, float] | None = None
        # Why the engine's weights can no longer be trusted (an update that failed
        # part way, after its checks): nothing is served until a restart.
        self.broken: str | None = None

    async def start(self) -> None:
        """Read the engine's own initial label (vLLM: "default")."""
        self._version = await self._backend.weight_version()

    @property
    def version(self) -> str:
        return self._version

    def state(self) -> pb.RefitState:
        return pb.RefitState(
            paused=self.paused is not None,
            pause_mode=(
                PAUSE_MODE_PB[self.paused] if self.paused is not None else pb.PAUSE_MODE_UNSPECIFIED
            ),
            sleeping=self.sleeping,
            weight_version=self._version,
            weight_version_declared=self.version_declared,
            weight_changes=self.weight_changes,
        )

    def _fence(self, expect: int | None) -> None:
        """Refuse a writer that expects another count of changes: someone changed
        the weights or their label since it looked. Under the lock, before
        anything is touched (the change counts once it begins: ``_begin``)."""
        if expect is not None and expect != self.weight_changes:
            raise StaleWriter(
                f"{refit_rules.STALE_WRITER}: it expected weight change {expect}, but the "
                f"engine is at {self.weight_changes} (serving {self._version!r}): another writer "
                "changed the weights or their label since; nothing was changed"
            )

    def _begin(self) -> None:
        """A weight or label change begins: counted, whether or not it ends well
        (a load refused before anything loaded is uncounted: ``_load``)."""
        self.weight_changes += 1

    async def _changing(self, step: Awaitable[T], version: str | None = None) -> T:
        """``step``, which changes the weights (or sets the label ``version``), once
        ``on_weights_change`` has ended what must not see the change."""
        if self.on_weights_change is not None:
            await self.on_weights_change(version)
        return await step

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()
        if self.on_state_change is not None:
            self.on_state_change()

    # -- the gate --------------------------------------------------------------

    async def gate(self, entry: ActiveRequest) -> None:
        """Wait while generation is paused or asleep. Raises for a request a pause
        or the server's shutdown ended meanwhile; returns for one an Abort ended
        (``entry.abort_requested``: it answers ABORTED with nothing generated)."""
        while (self.paused is not None or self.sleeping) and not entry.abort_requested:
            entry.raise_if_ended()
            waits = {
                asyncio.ensure_future(self._changed.wait()),
                asyncio.ensure_future(entry.interrupted.wait()),
            }
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waits:
                    waiter.cancel()
        entry.raise_if_ended()

    # -- pause and resume -----------------------------------------------------

    async def pause(self, request: pb.PauseGenerationRequest) -> pb.PauseGenerationResponse:
        mode = PAUSE_MODES.get(request.mode)
        if mode is None:
            raise InvalidRequest("mode", f"unknown PauseMode value {request.mode}")
        clear = request.clear_cache if request.HasField("clear_cache") else True
        if not self._backend.rl_capabilities().pause:
            name = type(self._backend).__name__
            raise RefitRefused(f"pausing generation is not supported by the {name} engine")
        async with self._lock:
            if self.paused is not None and _STRENGTH[mode] < _STRENGTH[self.paused]:
                mode = self.paused  # already stopped harder than asked
            # Paused from now: requests arriving during a WAIT drain wait at the gate.
            previous, self.paused = self.paused, mode
            marked = self._registry.mark_all_for_pause() if mode is PauseMode.ABORT else []
            ABORT_PAUSE.inc(len(marked))
            try:
                await _to_the_end(self._backend.pause(mode, clear))
            except asyncio.CancelledError:
                self._notify()  # the engine paused all the same; the caller left
                raise
            except BaseException as e:
                # The engine may have stopped part way: back to where it was.
                self._registry.unmark_for_pause(marked)
                if previous is None:
                    with contextlib.suppress(Exception):
                        await _to_the_end(self._backend.resume())
                self.paused = previous
                self._notify()
                if isinstance(e, RefitUnsupported):
                    raise _unsupported(e) from e
                raise
            self._notify()
            log.info(
                "generation paused (%s, clear_cache=%s): %d aborted",
                mode.value,
                clear,
                len(marked),
            )
            return pb.PauseGenerationResponse(aborted_count=len(marked), cache_cleared=clear)

    async def resume(self) -> pb.ResumeGenerationResponse:
        async with self._lock:
            if self._transfer is not None:
                raise RefitRefused(
                    "a weight update is in progress (StartWeightUpdate without "
                    "FinishWeightUpdate): finish it before resuming"
                )
            was_paused = self.paused is not None
            try:
                # Always, also when not paused: an engine paused by a pause whose
                # caller went away is released this way.
                await _to_the_end(self._backend.resume())
            except RefitUnsupported as e:
                if was_paused:
                    raise _unsupported(e) from e
            self.paused = None
            self._notify()
            if was_paused:
                log.info("generation resumed (weight version %s)", self._version)
            return pb.ResumeGenerationResponse(resumed=was_paused)

    # -- weight updates -------------------------------------------------------

    def _check_update(self, options: pb.WeightUpdateOptions) -> bool:
        """Whether to reset the prefix cache afterwards; refuses what the refit rules
        refuse (``engine_contract.refit_rules``: not paused, or unpaused with a cache
        reset; in the RL routes' words), a version it could not set (before
        anything is loaded), and any update once the weights are unknown (a load
        given up on at its deadline may still be running: nothing may load beside
        it)."""
        if self.broken is not None:
            raise EngineUnavailable(f"engine is not serving: {self.broken}")
        if options.HasField("weight_version"):
            _check_version("options.weight_version", options.weight_version)
        refusal = refit_rules.update_refusal(options, paused=self.paused is not None)
        if refusal is not None:
            raise UPDATE_REFUSALS[refusal]()
        self._fence(
            options.expect_weight_changes if options.HasField("expect_weight_changes") else None
        )
        # An unpaused update resets nothing (running requests hold the cache).
        reset = options.reset_prefix_cache if options.HasField("reset_prefix_cache") else True
        return reset and refit_rules.needs_pause(options)

    async def _load(
        self, step: Awaitable[WeightLoad], field: str, what: str, timeout_s: float
    ) -> WeightLoad:
        """Run a load to its end (a cancelled caller does not stop the engine's load
        half way) or its deadline; a refusal from its checks keeps the old weights,
        anything else, the deadline included, leaves them unknown: the server stops
        serving until restarted."""
        try:
            return await _to_the_end(self._changing(step), timeout_s)
        except WeightUpdateError as e:
            self.weight_changes -= 1  # refused before anything loaded: no change
            raise InvalidRequest(field, f"{e}; the old weights still serve") from e
        except RefitUnsupported as e:
            raise _unsupported(e) from e
        except _Expired:
            raise self._break(
                f"{what} did not end within the refit deadline of "
                f"{self._config.timeout_s:g} s (--refit-timeout-s)"
            ) from None
        except Exception as e:
            raise self._break(f"a weight update failed part way ({clip(e, 300)})") from e

    def _break(self, what: str) -> EngineFailed:
        """The engine's weights are unknown from now: nothing is served until a
        restart (health NOT_SERVING). The error to answer with."""
        reason = f"{what}: the engine's weights are unknown; restart the engine server"
        self.broken = reason
        log.error("%s", reason)
        self._notify()
        return EngineFailed(reason)

    async def _checked_path(self, path: str) -> str:
        """The path the backend loads: resolved, allowed, every header readable
        (``_preflight``), within the check deadline; otherwise a refusal."""
        limit = self._config.check_timeout_s
        allowed = self._config.allowed_dirs
        try:
            async with asyncio.timeout(limit):
                return await _in_daemon_thread(lambda: _preflight(path, allowed))
        except TimeoutError:  # _preflight raises none of its own (it wraps them)
            raise RefitTimedOut(
                f"checking the checkpoint at {clip(path)} took longer than the check "
                f"deadline of {limit:g} s (--refit-check-timeout-s); nothing was loaded, "
                "the old weights still serve"
            ) from None
        except WeightUpdateError as e:
            raise InvalidRequest("path", f"{e}; the old weights still serve") from e

    async def _finish_update(
        self, options: pb.WeightUpdateOptions, load: WeightLoad, reset: bool, started: float
    ) -> pb.WeightUpdateResult:
        if reset:
            # KEEP-frozen requests hold blocks: they are recomputed on resume.
            await _to_the_end(self._backend.reset_prefix_cache(running=True))
        if options.HasField("weight_version"):
            await self._set_version(options.weight_version)
        return pb.WeightUpdateResult(
            weight_version=self._version,
            cache_cleared=reset,
            tensors=load.tensors,
            bytes=load.bytes,
            load_ms=round((time.monotonic() - started) * 1000),
            weight_changes=self.weight_changes,
        )

    async def update_from_path(
        self, request: pb.UpdateWeightsFromPathRequest
    ) -> pb.UpdateWeightsFromPathResponse:
        if not request.path:
            raise InvalidRequest("path", "must name a checkpoint directory")
        _bounded("path", request.path, MAX_PATH_LENGTH)
        if "\0" in request.path:
            raise InvalidRequest("path", "holds a NUL character")
        async with self._lock:
            reset = self._check_update(request.options)
            started = time.monotonic()
            path = request.path
            if self._backend.rl_capabilities().update_from_path:  # else: it says why not
                path = await self._checked_path(path)
            self._begin()
            load = await self._load(
                self._backend.load_weights_from_path(
                    path, allow_partial=request.options.allow_partial
                ),
                "path",
                f"loading the weights from {clip(path)}",
                self._config.timeout_s,
            )
            result = await self._finish_update(request.options, load, reset, started)
            log.info("weights loaded from %s: version %s", path, result.weight_version)
            return pb.UpdateWeightsFromPathResponse(result=result)

    async def update_from_tensors(
        self, requests: AsyncIterator[pb.UpdateWeightsFromTensorsRequest]
    ) -> pb.UpdateWeightsFromTensorsResponse:
        messages = _paced(requests, self._idle_timeout_s)
        try:
            return await self._update_from_tensors(messages)
        except (ServerError, WeightUpdateError):
            # Read the rest before answering: ending a client-streaming call while
            # the client still sends makes gRPC clients report INTERNAL ("Internal
            # error from Core") instead of this error.
            async for _ in messages:
                pass
            raise

    async def _update_from_tensors(
        self, requests: AsyncIterator[pb.UpdateWeightsFromTensorsRequest | Undecodable]
    ) -> pb.UpdateWeightsFromTensorsResponse:
        first = await anext(requests, None)
        if isinstance(first, Undecodable):
            raise InvalidRequest("UpdateWeightsFromTensorsRequest", str(first))
        if first is None or first.WhichOneof("part") != "manifest":
            raise InvalidRequest("manifest", "the first message must be the tensor manifest")
        manifest = first.manifest
        _no_longer_than_the_model(manifest, await self._backend.weight_names())
        specs = _specs(manifest)
        async with self._lock:
            reset = self._check_update(manifest.options)
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
                writer = await self._begin_tensor_update(specs, manifest.options, limit)
            except _Expired:
                raise late from None
            timer = asyncio.timeout_at(deadline)
            try:
                async with timer:
                    await _receive(requests, specs, writer.write)
            except BaseException as e:
                await writer.discard()
                if isinstance(e, TimeoutError) and timer.expired():
                    raise late from None
                raise
            left = deadline - loop.time()
            if left <= 0:  # every byte came, just too late: still nothing loaded
                await writer.discard()
                raise late
            self._begin()
            try:
                load = await self._load(
                    writer.commit(), "tensors", "committing the streamed weights", left
                )
            finally:
                await writer.discard()  # nothing once committed; else what was received
            result = await self._finish_update(manifest.options, load, reset, started)
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
        deadline is cancelled (``_Expired``): it had loaded nothing."""
        step = asyncio.ensure_future(
            self._backend.begin_tensor_update(specs, allow_partial=options.allow_partial)
        )
        try:
            return await _to_the_end(step, timeout_s)
        except _Expired:
            step.cancel()
            raise
        except WeightUpdateError as e:
            raise InvalidRequest("manifest", f"{e}; the old weights still serve") from e
        except RefitUnsupported as e:
            raise _unsupported(e) from e

    # -- weight-transfer engines (vLLM's NCCL and the like) ---------------------

    async def init_weight_transfer(
        self, init_info_json: bytes, timeout_s: float | None = None
    ) -> None:
        """``timeout_s``: the caller's deadline (the request's ``timeout_ms``; never
        past the refit deadline). Past it the transfer engine is shut down and the
        answer is DEADLINE_EXCEEDED naming that deadline; the old weights serve. A
        ``gloo`` init info without its own ``timeout_s`` gets this one, so that the
        rendezvous the engine is blocked in gives up too (and the teardown behind it
        can run)."""
        info = _json_object("init_info_json", init_info_json)
        limit, source = self._config.timeout_s, "the refit deadline of {:g} s (--refit-timeout-s)"
        if timeout_s is not None and 0 < timeout_s < limit:
            limit, source = timeout_s, "the caller's init deadline of {:g} s (timeout_ms)"
            if (
                self._backend.rl_capabilities().weight_transfer_backend == "gloo"
                and "timeout_s" not in info
            ):
                info["timeout_s"] = timeout_s
        async with self._lock:
            await self._transfer_step(
                self._backend.init_weight_transfer(info),
                "InitWeightTransferEngine",
                _SETUP,
                limit=limit,
                deadline=source.format(limit),
            )

    async def start_weight_update(self, options: pb.WeightUpdateOptions) -> None:
        async with self._lock:
            if self._transfer is not None:
                raise RefitRefused(refit_rules.PhaseRefusal.ALREADY_STARTED.value)
            reset = self._check_update(options)
            self._begin()
            await self._transfer_step(
                self._changing(self._backend.start_weight_update()), "StartWeightUpdate", _SETUP
            )
            self._transfer = (options, reset, time.monotonic())

    async def update_weights(self, update_info_json: bytes) -> None:
        info = _json_object("update_info_json", update_info_json, arrays=True)
        async with self._lock:
            self._transfer_started()
            try:
                await self._transfer_step(
                    self._changing(self._backend.update_weights(info)), "UpdateWeights", _LOADING
                )
            except WeightUpdateError as e:  # refused before the engine saw it
                raise InvalidRequest(
                    "update_info_json", f"{e}; nothing was loaded, the weights serving stay"
                ) from e

    async def finish_weight_update(
        self, request: pb.FinishWeightUpdateRequest
    ) -> pb.FinishWeightUpdateResponse:
        if request.HasField("weight_version"):
            _check_version("weight_version", request.weight_version)
        async with self._lock:
            options, reset, started = self._transfer_started()
            try:
                load = await self._load(
                    self._backend.finish_weight_update(),
                    "update",
                    "FinishWeightUpdate",
                    self._config.timeout_s,
                )
            finally:
                self._transfer = None
            if request.HasField("weight_version"):
                options = pb.WeightUpdateOptions(weight_version=request.weight_version)
            else:
                options = pb.WeightUpdateOptions()
            result = await self._finish_update(options, load, reset, started)
            return pb.FinishWeightUpdateResponse(result=result)

    def _transfer_started(self) -> tuple[pb.WeightUpdateOptions, bool, float]:
        if self._transfer is None:
            raise RefitRefused(refit_rules.PhaseRefusal.NOT_STARTED.value)
        return self._transfer

    async def shutdown_weight_transfer(self) -> None:
        async with self._lock:
            await self._transfer_step(
                self._backend.shutdown_weight_transfer(), "ShutdownWeightTransferEngine", ""
            )
            self._transfer = None

    async def _transfer_step(
        self,
        step: Awaitable[T],
        phase: str,
        kind: str,
        *,
        limit: float | None = None,
        deadline: str | None = None,
    ) -> T:
        """One weight-transfer phase, bounded by the refit deadline (or ``limit``,
        described by ``deadline``). Past it: a phase that sets the transfer engine
        up (``_SETUP``) has it torn down, one that loads (``_LOADING``) leaves the
        weights unknown; the lock is released."""
        if limit is None:
            limit = self._config.timeout_s
            deadline = f"the refit deadline of {limit:g} s (--refit-timeout-s)"
        try:
            return await _to_the_end(step, limit)
        except RefitUnsupported as e:
            raise _unsupported(e) from e
        except _Expired:
            late = f"{phase} did not end within {deadline}"
            if kind == _LOADING:
                self._transfer = None
                raise self._break(late) from None
            if kind == _SETUP:
                await self._tear_down_transfer()
                late += "; the weight-transfer engine was shut down (best effort)"
            else:  # the teardown itself: whatever it left, no update is in progress
                self._transfer = None
            raise RefitTimedOut(
                f"{late}; nothing was loaded, the old weights still serve"
            ) from None

    async def _tear_down_transfer(self) -> None:
        """Best effort, bounded by the check deadline: tearing down is not loading."""
        try:
            await _to_the_end(
                self._backend.shutdown_weight_transfer(), self._config.check_timeout_s
            )
        except Exception as e:  # the deadline too: the setup's error is the answer
            log.warning("shutting the weight-transfer engine down failed: %r", e)

    # -- versions --------------------------------------------------------------

    async def _set_version(self, version: str) -> None:
        _check_version("weight_version", version)
        try:
            await self._changing(self._backend.set_weight_version(version), version)
        except RefitUnsupported as e:
            raise _unsupported(e) from e
        self._version = version
        self.version_declared = True

    async def update_version(
        self, version: str, expect: int | None = None
    ) -> pb.UpdateWeightVersionResponse:
        _check_version("weight_version", version)
        async with self._lock:
            self._fence(expect)
            self._begin()
            await self._set_version(version)
            return pb.UpdateWeightVersionResponse(
                weight_version=self._version, weight_changes=self.weight_changes
            )

    # -- sleep -----------------------------------------------------------------

    async def sleep(self, request: pb.SleepRequest) -> None:
        level = request.level if request.HasField("level") else 1
        if level not in (1, 2):
            raise InvalidRequest("level", f"{level}: 1 (weights kept on the host) or 2 (dropped)")
        mode = PAUSE_MODES.get(request.mode)
        if mode is None:
            raise InvalidRequest("mode", f"unknown PauseMode value {request.mode}")
        try:
            self._backend.check_sleep()
        except RefitUnsupported as e:
            raise _unsupported(e) from e
        async with self._lock:
            if self.sleeping:
                return
            # Asleep from now: new requests wait at the gate.
            self.sleeping = True
            marked = self._registry.mark_all_for_pause() if mode is PauseMode.ABORT else []
            ABORT_PAUSE.inc(len(marked))
            try:
                await _to_the_end(self._backend.sleep(level, mode))
            except asyncio.CancelledError:
                self._notify()  # asleep all the same; the caller left
                raise
            except BaseException as e:
                self._registry.unmark_for_pause(marked)
                self.sleeping = False
                self._notify()
                if isinstance(e, RefitUnsupported):
                    raise _unsupported(e) from e
                raise
            self._notify()

    async def wake_up(self, tags: list[str]) -> bool:
        for i, tag in enumerate(tags):
            _bounded(f"tags[{i}]", tag, MAX_TAG_LENGTH)
        async with self._lock:
            if not self.sleeping:
                return True
            try:
                awake = await _to_the_end(self._backend.wake_up(tags))
            except RefitUnsupported as e:
                raise _unsupported(e) from e
            if awake:
                self.sleeping = False
                self._notify()
            return awake


def _no_longer_than_the_model(manifest: pb.TensorManifest, names: Collection[str] | None) -> None:
    """Refuse a manifest naming more tensors than the model has, before its specs
    are built (100,000 of them cost some 35 MB), naming the first that is not the
    model's (there is one, or a name repeats)."""
    if names is None or len(manifest.tensors) <= len(names):
        return
    unknown = next((t.name for t in manifest.tensors if t.name not in names), None)
    what = f"tensor {clip(unknown)} is not a weight of this model" if unknown else "names repeat"
    raise InvalidRequest(
        "manifest.tensors",
        f"{len(manifest.tensors)} tensors, more than the served model's {len(names)} "
        f"({what}); the old weights still serve",
    )


def _specs(manifest: pb.TensorManifest) -> list[TensorSpec]:
    if not manifest.tensors:
        raise InvalidRequest("manifest.tensors", "no tensors")
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    for i, tensor in enumerate(manifest.tensors):
        field = f"manifest.tensors[{i}]"
        if not tensor.name or tensor.name in seen:
            raise InvalidRequest(f"{field}.name", "empty or repeated")
        _bounded(f"{field}.name", tensor.name, MAX_TENSOR_NAME_LENGTH)
        seen.add(tensor.name)
        dtype = TENSOR_DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise InvalidRequest(f"{field}.dtype", f"unknown TensorDtype value {tensor.dtype}")
        if any(d < 0 for d in tensor.shape):
            raise InvalidRequest(f"{field}.shape", f"negative dimension in {list(tensor.shape)}")
        specs.append(TensorSpec(tensor.name, dtype, tuple(tensor.shape)))
    return specs


async def _paced(
    requests: AsyncIterator[pb.UpdateWeightsFromTensorsRequest], idle_timeout_s: float | None
) -> AsyncIterator[pb.UpdateWeightsFromTensorsRequest | Undecodable]:
    """The request stream, ended with ABORTED when the client goes silent."""
    iterator = aiter(requests)
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise UpdateStalled(
                f"the weight update's next message did not come within {idle_timeout_s:g} s; "
                "nothing was loaded, the old weights still serve"
            ) from None
        yield message


async def _receive(
    requests: AsyncIterator[pb.UpdateWeightsFromTensorsRequest | Undecodable],
    specs: list[TensorSpec],
    write: Callable[[memoryview], Any],
) -> None:
    """Check that chunks come whole and in order, and pass their bytes on."""
    index, received = 0, 0
    sizes = [spec.nbytes for spec in specs]
    while index < len(specs) and sizes[index] == 0:
        index += 1
    async for message in requests:
        if isinstance(message, Undecodable):
            raise InvalidRequest("UpdateWeightsFromTensorsRequest", str(message))
        if message.WhichOneof("part") != "chunk":
            raise InvalidRequest("manifest", "only the first message is a manifest")
        chunk = message.chunk
        if index >= len(specs):
            raise InvalidRequest("chunk", "more bytes than the manifest's tensors hold")
        if chunk.tensor != index or chunk.offset != received:
            raise InvalidRequest(
                "chunk",
                f"out of order: expected tensor {index} ({specs[index].name!r}) at byte "
                f"{received}, got tensor {chunk.tensor} at byte {chunk.offset}",
            )
        data = memoryview(chunk.data)
        if received + len(data) > sizes[index]:
            raise InvalidRequest(
                "chunk", f"tensor {specs[index].name!r} is {sizes[index]} bytes; more were sent"
            )
        await write(data)
        received += len(data)
        while index < len(specs) and received == sizes[index]:
            index, received = index + 1, 0
    if index < len(specs):
        raise InvalidRequest(
            "chunk",
            f"the stream ended short: tensor {specs[index].name!r} got {received} of "
            f"{sizes[index]} bytes ({len(specs) - index} tensors incomplete); nothing was loaded",
        )


def _json_object(field: str, raw: bytes, *, arrays: bool = False) -> Any:
    """A JSON object (or, with ``arrays``, an array of them: vLLM's update
    payload may batch several)."""
    try:
        value = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(field, f"must contain valid JSON: {e}") from e
    ok = isinstance(value, dict) or (
        arrays and isinstance(value, list) and all(isinstance(v, dict) for v in value)
    )
    if not ok:
        raise InvalidRequest(
            field, "must contain a JSON object" + (" or an array of them" if arrays else "")
        )
    return value
