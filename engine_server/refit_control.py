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
- **Deadlines** (``RefitConfig``): no refit call holds the lock for good. Past
  the refit deadline, a step that had loaded nothing (a stream still arriving, a
  transfer engine starting) is refused; one that was loading leaves the weights
  unknown (``broken``), and the answer says so. Either way the lock is released.
- **State**: all of the cycle's, the weight-transfer phases' included
  (``transfer``, a ``transfer_phases.TransferPhases``).

Elsewhere, each for its own job: the ways new weights arrive, each passing the
rules here (``weight_updates``: a checkpoint folder, checked first; a tensor
stream; a transfer engine's phases); requests decoded before they come here
(``refit_requests``: a tensor stream, a JSON body); waiting for a step to its end
or deadline (``deadlines``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from engine_contract import refit_rules
from engine_contract.labels import label_problem
from engine_contract.text import clip
from engine_contract.v1 import engine_pb2 as pb
from engine_server.admission import check_length
from engine_server.backends.base import EngineBackend
from engine_server.backends.refit import PauseMode, RefitUnsupported, WeightLoad, WeightUpdateError
from engine_server.config import RefitConfig
from engine_server.deadlines import Expired, to_the_end
from engine_server.errors import (
    UPDATE_REFUSALS,
    EngineFailed,
    EngineUnavailable,
    InvalidRequest,
    RefitRefused,
    StaleWriter,
)
from engine_server.metrics import ABORT_PAUSE
from engine_server.registry import ActiveRequest, RequestRegistry
from engine_server.transfer_phases import TransferPhases

log = logging.getLogger(__name__)
T = TypeVar("T")

# The contract's pause modes (engine_contract.refit_rules: UNSPECIFIED is ABORT,
# as in vLLM) as the backends' PauseMode, which carries the same names.
PAUSE_MODES = {value: PauseMode(name) for value, name in refit_rules.PAUSE_MODE_NAMES.items()}
PAUSE_MODE_PB = {PauseMode(name): value for name, value in refit_rules.PAUSE_MODES.items()}
# The longest wake-up tag (version labels: engine_contract.labels).
MAX_TAG_LENGTH = 64


def check_version(field: str, version: str) -> None:
    problem = label_problem(version)
    if problem is not None:
        raise InvalidRequest(field, problem)


# How strongly a mode stops generation: pausing again may only strengthen it.
_STRENGTH = {PauseMode.KEEP: 0, PauseMode.WAIT: 1, PauseMode.ABORT: 2}


def _unsupported(e: RefitUnsupported) -> RefitRefused:
    return RefitRefused(str(e))


class RefitControl:
    """The cycle's state and rules (above); its methods run on the server's loop."""

    def __init__(
        self,
        backend: EngineBackend,
        registry: RequestRegistry,
        *,
        on_state_change: Callable[[], object] | None = None,
        config: RefitConfig | None = None,
        on_weights_change: Callable[[str | None], Awaitable[None]] | None = None,
    ) -> None:
        self._backend = backend
        self._config = config or RefitConfig()
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
        # Why the engine's weights can no longer be trusted (an update that failed
        # part way, after its checks): nothing is served until a restart.
        self.broken: str | None = None
        # The weight-transfer phases' state: an update between StartWeightUpdate
        # and FinishWeightUpdate, a step still stuck in the engine.
        self.transfer = TransferPhases(backend, self._config, self.weights_unknown)

    async def start(self) -> None:
        """Read the engine's own initial label (vLLM: "default")."""
        self._version = await self._backend.weight_version()

    @property
    def version(self) -> str:
        return self._version

    @property
    def lock(self) -> asyncio.Lock:
        """Held by every step of the cycle (``weight_updates`` takes it too)."""
        return self._lock

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
            weights_mixed=self.transfer.mixed_weights() or "",
            weight_update_open=self.transfer.update is not None,
        )

    def _fence(self, expect: int | None) -> None:
        """Refuse a writer that expects another count of changes: someone changed
        the weights or their label since it looked. Under the lock, before
        anything is touched (the change counts once it begins: ``begin``)."""
        if expect is not None and expect != self.weight_changes:
            raise StaleWriter(
                f"{refit_rules.STALE_WRITER}: it expected weight change {expect}, but the "
                f"engine is at {self.weight_changes} (serving {self._version!r}): another writer "
                "changed the weights or their label since; nothing was changed"
            )

    def begin(self) -> None:
        """A weight or label change begins: counted, whether or not it ends well
        (a load its engine refused before anything loaded is uncounted: ``load``;
        any other end counts, which can only make a fenced writer re-read)."""
        self.weight_changes += 1

    async def changing(self, step: Awaitable[T], version: str | None = None) -> T:
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

    async def _stop_engine(
        self,
        mode: PauseMode,
        step: Callable[[], Awaitable[None]],
        undo: Callable[[], Awaitable[None]],
    ) -> list[ActiveRequest]:
        """Pause's and sleep's one way to stop the engine, under the lock, the state
        already set: ABORT marks every request first; a step that fails unmarks
        them and ``undo``es the state (a cancelled caller leaves the engine
        stopped all the same). Returns the requests marked."""
        marked = self._registry.mark_all_for_pause() if mode is PauseMode.ABORT else []
        ABORT_PAUSE.inc(len(marked))
        try:
            await to_the_end(step())
        except asyncio.CancelledError:
            self._notify()  # stopped all the same; the caller left
            raise
        except BaseException as e:
            self._registry.unmark_for_pause(marked)
            await undo()
            self._notify()
            if isinstance(e, RefitUnsupported):
                raise _unsupported(e) from e
            raise
        self._notify()
        return marked

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

            async def undo() -> None:
                # The engine may have stopped part way: back to where it was.
                if previous is None:
                    with contextlib.suppress(Exception):
                        await to_the_end(self._backend.resume())
                self.paused = previous

            marked = await self._stop_engine(mode, lambda: self._backend.pause(mode, clear), undo)
            log.info(
                "generation paused (%s, clear_cache=%s): %d aborted",
                mode.value,
                clear,
                len(marked),
            )
            return pb.PauseGenerationResponse(aborted_count=len(marked), cache_cleared=clear)

    async def resume(self) -> pb.ResumeGenerationResponse:
        async with self._lock:
            if self.transfer.update is not None:
                # A trainer that died between its calls cannot finish it: say the
                # other way out (TransferPhases.shut_down), and what it leaves.
                raise RefitRefused(
                    "a weight update is in progress (StartWeightUpdate without "
                    "FinishWeightUpdate): finish it before resuming, or, if its trainer "
                    "is gone, end it with ShutdownWeightTransferEngine (the gloo engine "
                    "rolls it back) or, where the engine refuses that during an update "
                    "(vLLM 0.32's own engines), with FinishWeightUpdate; after rounds "
                    "not rolled back, load whole weights before resuming"
                )
            was_paused = self.paused is not None
            if was_paused and self.transfer.mixed is not None:
                raise RefitRefused(
                    f"{self.transfer.mixed}: load whole weights before resuming (a "
                    "weight-transfer update to its FinishWeightUpdate, or "
                    "UpdateWeightsFromPath or UpdateWeightsFromTensors without "
                    "allow_partial)"
                )
            try:
                # Always, also when not paused: an engine paused by a pause whose
                # caller went away is released this way.
                await to_the_end(self._backend.resume())
            except RefitUnsupported as e:
                if was_paused:
                    raise _unsupported(e) from e
            self.paused = None
            self._notify()
            if was_paused:
                log.info("generation resumed (weight version %s)", self._version)
            return pb.ResumeGenerationResponse(resumed=was_paused)

    # -- the rules every weight change passes (its ways in: weight_updates) -------

    def check_update(self, options: pb.WeightUpdateOptions) -> bool:
        """Whether to reset the prefix cache afterwards; refuses what the refit rules
        refuse (``engine_contract.refit_rules``: not paused, or unpaused with a cache
        reset; in the RL routes' words), a version it could not set (before
        anything is loaded), any update once the weights are unknown (a load
        given up on at its deadline may still be running: nothing may load beside
        it), and any beside an open weight-transfer update (a StartWeightUpdate,
        which calls this too, is refused first as out of order)."""
        if self.broken is not None:
            raise EngineUnavailable(f"engine is not serving: {self.broken}")
        if options.HasField("weight_version"):
            check_version("options.weight_version", options.weight_version)
        refusal = refit_rules.update_refusal(options, paused=self.paused is not None)
        if refusal is not None:
            raise UPDATE_REFUSALS[refusal]()
        self._fence(
            options.expect_weight_changes if options.HasField("expect_weight_changes") else None
        )
        self.transfer.refuse_a_load_beside()
        # An unpaused update resets nothing (running requests hold the cache).
        reset = options.reset_prefix_cache if options.HasField("reset_prefix_cache") else True
        return reset and refit_rules.needs_pause(options)

    async def load(
        self,
        step: Awaitable[WeightLoad],
        field: str,
        what: str,
        timeout_s: float,
        *,
        begun_here: bool = True,
    ) -> WeightLoad:
        """Run a load to its end (a cancelled caller does not stop the engine's load
        half way) or its deadline; a refusal from its checks keeps the old weights,
        anything else, the deadline included, leaves them unknown: the server stops
        serving until restarted. ``begun_here``: the change was counted for this
        load alone (``begin``), so a refusal that changed nothing uncounts it."""
        try:
            return await to_the_end(self.changing(step), timeout_s)
        except WeightUpdateError as e:
            if begun_here:
                self.weight_changes -= 1  # refused before anything loaded: no change
            raise InvalidRequest(field, f"{e}; the old weights still serve") from e
        except RefitUnsupported as e:
            if begun_here:
                self.weight_changes -= 1
            raise _unsupported(e) from e
        except Expired:
            raise self.weights_unknown(
                f"{what} did not end within the refit deadline of "
                f"{self._config.timeout_s:g} s (--refit-timeout-s)"
            ) from None
        except Exception as e:
            raise self.weights_unknown(f"a weight update failed part way ({clip(e, 300)})") from e

    def weights_unknown(self, what: str) -> EngineFailed:
        """The engine's weights are unknown from now: nothing is served until a
        restart (health NOT_SERVING). The error to answer with."""
        reason = f"{what}: the engine's weights are unknown; restart the engine server"
        self.broken = reason
        log.error("%s", reason)
        self._notify()
        return EngineFailed(reason)

    async def finish_update(
        self, options: pb.WeightUpdateOptions, load: WeightLoad, reset: bool, started: float
    ) -> pb.WeightUpdateResult:
        """Once the whole update loaded: the prefix cache reset, then the label set
        (never before: a failed update keeps the old one); the result to answer.
        Weights left part old, part new (``transfer.mixed``) are whole again unless
        the update may have named only some tensors (``allow_partial``)."""
        if reset:
            # KEEP-frozen requests hold blocks: they are recomputed on resume.
            await to_the_end(self._backend.reset_prefix_cache(running=True))
        if options.HasField("weight_version"):
            await self._set_version(options.weight_version)
        if not options.allow_partial:
            self.transfer.whole()
        return pb.WeightUpdateResult(
            weight_version=self._version,
            cache_cleared=reset,
            tensors=load.tensors,
            bytes=load.bytes,
            load_ms=round((time.monotonic() - started) * 1000),
            weight_changes=self.weight_changes,
        )

    # -- versions --------------------------------------------------------------

    async def _set_version(self, version: str) -> None:
        check_version("weight_version", version)
        try:
            await self.changing(self._backend.set_weight_version(version), version)
        except RefitUnsupported as e:
            raise _unsupported(e) from e
        self._version = version
        self.version_declared = True

    async def update_version(
        self, version: str, expect: int | None = None
    ) -> pb.UpdateWeightVersionResponse:
        check_version("weight_version", version)
        async with self._lock:
            self._fence(expect)
            self.begin()
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

            async def undo() -> None:
                self.sleeping = False

            await self._stop_engine(mode, lambda: self._backend.sleep(level, mode), undo)

    async def wake_up(self, tags: list[str]) -> bool:
        for i, tag in enumerate(tags):
            check_length(f"tags[{i}]", tag, MAX_TAG_LENGTH)
        async with self._lock:
            if not self.sleeping:
                return True
            try:
                awake = await to_the_end(self._backend.wake_up(tags))
            except RefitUnsupported as e:
                raise _unsupported(e) from e
            if awake:
                self.sleeping = False
                self._notify()
            return awake
