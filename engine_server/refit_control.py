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
  forbids the cache reset, as dynamo.vllm rules); the version is set only when
  the whole update succeeded; the prefix cache is reset after loading, and the
  reset reaches the KV-event stream at once.
- **Versions**: the label serving now, and whether anyone declared one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from engine_contract.tensors import TENSOR_DTYPE_NAMES
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.base import EngineBackend
from engine_server.backends.refit import (
    PauseMode,
    RefitUnsupported,
    TensorSpec,
    WeightLoad,
    WeightUpdateError,
)
from engine_server.errors import (
    EngineFailed,
    InvalidRequest,
    RefitRefused,
    ServerError,
    UpdateStalled,
    clip,
)
from engine_server.handlers import Undecodable
from engine_server.metrics import ABORT_PAUSE
from engine_server.registry import ActiveRequest, RequestRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")

PAUSE_MODES = {
    pb.PAUSE_MODE_UNSPECIFIED: PauseMode.ABORT,  # as vLLM
    pb.PAUSE_MODE_ABORT: PauseMode.ABORT,
    pb.PAUSE_MODE_WAIT: PauseMode.WAIT,
    pb.PAUSE_MODE_KEEP: PauseMode.KEEP,
}
PAUSE_MODE_PB = {
    PauseMode.ABORT: pb.PAUSE_MODE_ABORT,
    PauseMode.WAIT: pb.PAUSE_MODE_WAIT,
    PauseMode.KEEP: pb.PAUSE_MODE_KEEP,
}
# Lengths of the refit cycle's strings: a path (PATH_MAX), a checkpoint's tensor
# name, a version label (it travels with every result), a wake-up tag.
MAX_PATH_LENGTH = 4096
MAX_TENSOR_NAME_LENGTH = 1024
MAX_VERSION_LENGTH = 256
MAX_TAG_LENGTH = 64


def _bounded(field: str, value: str, most: int) -> str:
    if len(value) > most:
        raise InvalidRequest(field, f"{len(value)} characters, more than the limit of {most}")
    return value


async def _to_the_end(step: Awaitable[T]) -> T:
    """Run an engine step to its end even when the caller is cancelled (a client's
    deadline or disconnect): the lock stays held and the state stays true to what
    the engine did; the cancellation is raised afterwards."""
    task = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await task
        raise


def _check_version(field: str, version: str) -> None:
    if not version.strip():
        raise InvalidRequest(field, "must not be empty")
    _bounded(field, version, MAX_VERSION_LENGTH)


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
    ) -> None:
        self._backend = backend
        # The longest a streamed update may go without its next message: a
        # trainer that stalls must not hold the refit lock for good.
        self._idle_timeout_s = idle_timeout_s
        self._registry = registry
        self._lock = asyncio.Lock()
        self.paused: PauseMode | None = None
        self.sleeping = False
        self.version_declared = False
        self._version = "default"
        self._changed = asyncio.Event()
        # Told when paused or asleep changes (the server's health follows sleep).
        self.on_state_change = on_state_change
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
        )

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
        """Whether to reset the prefix cache afterwards; refuses an unpaused update,
        and a version it could not set (before anything is loaded)."""
        if options.HasField("weight_version"):
            _check_version("options.weight_version", options.weight_version)
        reset = options.reset_prefix_cache if options.HasField("reset_prefix_cache") else True
        if options.allow_unpaused:
            if options.HasField("reset_prefix_cache") and reset:
                raise InvalidRequest(
                    "options.reset_prefix_cache",
                    "an unpaused update cannot reset the prefix cache (running requests "
                    "hold it); set it false, or pause generation first",
                )
            return False
        if self.paused is None:
            raise RefitRefused(
                "generation must be paused before updating weights: call PauseGeneration "
                "first, then update, then ResumeGeneration (or set allow_unpaused)"
            )
        return reset

    async def _load(self, step: Awaitable[WeightLoad], field: str) -> WeightLoad:
        """Run a load to its end (a cancelled caller does not stop the engine's load
        half way); a refusal from its checks keeps the old weights, anything else
        leaves them unknown: the server stops serving until restarted."""
        try:
            return await _to_the_end(step)
        except WeightUpdateError as e:
            raise InvalidRequest(field, f"{e}; the old weights still serve") from e
        except RefitUnsupported as e:
            raise _unsupported(e) from e
        except Exception as e:
            reason = (
                f"a weight update failed part way ({clip(e, 300)}): the engine's weights "
                "are unknown; restart the engine server"
            )
            self.broken = reason
            log.error("%s", reason)
            self._notify()
            raise EngineFailed(reason) from e

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
        )

    async def update_from_path(
        self, request: pb.UpdateWeightsFromPathRequest
    ) -> pb.UpdateWeightsFromPathResponse:
        if not request.path:
            raise InvalidRequest("path", "must name a checkpoint directory")
        _bounded("path", request.path, MAX_PATH_LENGTH)
        async with self._lock:
            reset = self._check_update(request.options)
            started = time.monotonic()
            load = await self._load(
                self._backend.load_weights_from_path(
                    request.path, allow_partial=request.options.allow_partial
                ),
                "path",
            )
            result = await self._finish_update(request.options, load, reset, started)
            log.info("weights loaded from %s: version %s", request.path, result.weight_version)
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
        specs = _specs(manifest)
        async with self._lock:
            reset = self._check_update(manifest.options)
            started = time.monotonic()
            try:
                writer = await self._backend.begin_tensor_update(
                    specs, allow_partial=manifest.options.allow_partial
                )
            except WeightUpdateError as e:
                raise InvalidRequest("manifest", f"{e}; the old weights still serve") from e
            except RefitUnsupported as e:
                raise _unsupported(e) from e
            try:
                await _receive(requests, specs, writer.write)
            except BaseException:
                await writer.discard()
                raise
            try:
                load = await self._load(writer.commit(), "tensors")
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

    # -- weight-transfer engines (vLLM's NCCL and the like) ---------------------

    async def init_weight_transfer(self, init_info_json: bytes) -> None:
        info = _json_object("init_info_json", init_info_json)
        async with self._lock:
            await self._transfer_step(self._backend.init_weight_transfer(info))

    async def start_weight_update(self, options: pb.WeightUpdateOptions) -> None:
        async with self._lock:
            if self._transfer is not None:
                raise RefitRefused("a weight update is already in progress: finish it first")
            reset = self._check_update(options)
            await self._transfer_step(self._backend.start_weight_update())
            self._transfer = (options, reset, time.monotonic())

    async def update_weights(self, update_info_json: bytes) -> None:
        info = _json_object("update_info_json", update_info_json, arrays=True)
        async with self._lock:
            self._transfer_started()
            await self._transfer_step(self._backend.update_weights(info))

    async def finish_weight_update(
        self, request: pb.FinishWeightUpdateRequest
    ) -> pb.FinishWeightUpdateResponse:
        if request.HasField("weight_version"):
            _check_version("weight_version", request.weight_version)
        async with self._lock:
            options, reset, started = self._transfer_started()
            try:
                load = await self._load(self._backend.finish_weight_update(), "update")
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
            raise RefitRefused("no weight update in progress: call StartWeightUpdate first")
        return self._transfer

    async def shutdown_weight_transfer(self) -> None:
        async with self._lock:
            await self._transfer_step(self._backend.shutdown_weight_transfer())
            self._transfer = None

    async def _transfer_step(self, step: Awaitable[T]) -> T:
        try:
            return await _to_the_end(step)
        except RefitUnsupported as e:
            raise _unsupported(e) from e

    # -- versions --------------------------------------------------------------

    async def _set_version(self, version: str) -> None:
        _check_version("weight_version", version)
        try:
            await self._backend.set_weight_version(version)
        except RefitUnsupported as e:
            raise _unsupported(e) from e
        self._version = version
        self.version_declared = True

    async def update_version(self, version: str) -> pb.UpdateWeightVersionResponse:
        async with self._lock:
            await self._set_version(version)
            return pb.UpdateWeightVersionResponse(weight_version=self._version)

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
