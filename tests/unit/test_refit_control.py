"""RefitControl's rules under failure and cancellation, on the sim engine in-process:
the pause state stays true to the engine, a refused pause aborts nothing, and
the sim's pause, keep and sleep freezes hold and release independently."""

from __future__ import annotations

import asyncio
import shutil
import struct
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import pytest_asyncio

from engine_contract.tensors import TENSOR_DTYPES, Tensor, update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends import checkpoint
from engine_server.backends.refit import (
    PauseMode,
    TensorSpec,
    WeightLoad,
    WeightUpdateError,
    WeightWriter,
)
from engine_server.backends.sim import SimBackend
from engine_server.config import RefitConfig, ServerConfig
from engine_server.core import ServerCore
from engine_server.errors import (
    EngineFailed,
    InvalidRequest,
    RefitRefused,
    RefitTimedOut,
    WeightsPathDenied,
)
from engine_server.refit_requests import update_from_tensors
from harness.checkpoints import tiny_weights_dir, unreadable_entry
from harness.engine import aiter_of, nothing

pytestmark = pytest.mark.serial


@pytest_asyncio.fixture
async def core() -> AsyncIterator[ServerCore]:
    backend = SimBackend(decode_step_ms=2.0, eos_rate=0.0)
    server = ServerCore(backend, ServerConfig(listen="127.0.0.1:0"), "inst")
    await server.start_engine()
    yield server
    await backend.shutdown()


def long_request(request_id: str) -> pb.RolloutRequest:
    return pb.RolloutRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], max_new_tokens=400)


async def running(core: ServerCore, n: int) -> None:
    for _ in range(500):
        if core.backend.load().running >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never ran")


async def test_a_cancelled_wait_pause_still_pauses_and_resume_releases(core: ServerCore) -> None:
    rollout = asyncio.ensure_future(core.rollout(long_request("a")))
    await running(core, 1)
    pause = asyncio.ensure_future(
        core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
    )
    await asyncio.sleep(0.05)
    pause.cancel()  # the trainer's deadline passed
    with pytest.raises(asyncio.CancelledError):
        await pause
    # The engine finished the drain and is paused; the state says so.
    assert core.refit.paused is PauseMode.WAIT
    assert (await rollout).finish_reason == pb.FINISH_REASON_LENGTH
    assert (await core.refit.resume()).resumed
    answer = await asyncio.wait_for(core.rollout(long_request("b")), 10)
    assert answer.finish_reason == pb.FINISH_REASON_LENGTH


async def test_wait_after_keep_lets_frozen_requests_finish(core: ServerCore) -> None:
    rollout = asyncio.ensure_future(core.rollout(long_request("k")))
    await running(core, 1)
    await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP))
    await asyncio.wait_for(core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT)), 10)
    assert (await rollout).finish_reason == pb.FINISH_REASON_LENGTH
    await core.refit.resume()


async def test_a_sleep_and_wake_keep_a_keep_pause_frozen(core: ServerCore) -> None:
    rollout = asyncio.ensure_future(core.rollout(long_request("s")))
    await running(core, 1)
    await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP))
    await core.refit.sleep(pb.SleepRequest(level=1, mode=pb.PAUSE_MODE_KEEP))
    assert await core.refit.wake_up([])
    await asyncio.sleep(0.2)
    assert not rollout.done() and all(e.frozen for e in core.backend.engines)
    await core.refit.resume()
    assert (await asyncio.wait_for(rollout, 10)).finish_reason == pb.FINISH_REASON_LENGTH


async def test_a_refused_abort_pause_aborts_nothing(core: ServerCore) -> None:
    async def refuse(mode: PauseMode, clear_cache: bool) -> None:
        raise RuntimeError("the engine refused")

    rollout = asyncio.ensure_future(core.rollout(long_request("r")))
    await running(core, 1)
    core.backend.pause = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))
    assert core.refit.paused is None
    assert (await rollout).finish_reason == pb.FINISH_REASON_LENGTH  # not aborted


async def test_transfer_phases_in_order_only(core: ServerCore) -> None:
    with pytest.raises(RefitRefused, match="StartWeightUpdate first"):
        await core.updates.update_weights({})
    with pytest.raises(RefitRefused, match="StartWeightUpdate first"):
        await core.updates.finish_weight_update(pb.FinishWeightUpdateRequest())


# -- issue 28: checks before anything loads, deadlines, the allow-list -----------

FAST = RefitConfig(check_timeout_s=0.3, timeout_s=0.3)


@asynccontextmanager
async def sim_core(
    refit: RefitConfig = FAST, model: Path | None = None, decode_step_ms: float = 0.0
) -> AsyncIterator[ServerCore]:
    backend = SimBackend(
        decode_step_ms=decode_step_ms,
        eos_rate=0.0,
        model=str(model) if model is not None else None,
    )
    server = ServerCore(backend, ServerConfig(listen="127.0.0.1:0", refit=refit), "inst")
    await server.start_engine()
    try:
        yield server
    finally:
        await backend.shutdown()


async def paused(core: ServerCore) -> None:
    await core.refit.pause(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))


async def update_started(core: ServerCore) -> None:
    """Generation paused and a weight update started, the backend's start a no-op:
    where a test of the update's later phases, or of a trainer leaving, begins."""
    core.backend.start_weight_update = nothing  # type: ignore[method-assign]
    await paused(core)
    await core.updates.start_weight_update(pb.WeightUpdateOptions())


def from_path(path: Path | str) -> pb.UpdateWeightsFromPathRequest:
    return pb.UpdateWeightsFromPathRequest(path=str(path))


async def still_serving(core: ServerCore) -> None:
    """Not broken, and the lock free: a resume goes through at once."""
    assert core.refit.broken is None
    assert (await asyncio.wait_for(core.refit.resume(), 2)).resumed


async def never() -> WeightLoad:
    await asyncio.Event().wait()
    raise AssertionError


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["directory", "dangling symlink", "FIFO", "nested header"])
async def test_an_unreadable_entry_is_a_refusal_not_weights_unknown(
    tmp_path: Path, kind: str
) -> None:
    if kind == "nested header":
        (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 200_000) + b"[" * 200_000)
    else:
        unreadable_entry(tmp_path, kind)
    # A deadline the check never meets: parsing 200 KB of nesting took over FAST's
    # 0.3 s on a loaded machine (the deadlines have tests of their own, below).
    async with sim_core(RefitConfig(check_timeout_s=10, timeout_s=10)) as core:
        await paused(core)
        with pytest.raises(InvalidRequest, match=r"x.safetensors.*the old weights still serve"):
            await core.updates.update_from_path(from_path(tmp_path))
        await still_serving(core)


async def test_a_check_past_its_deadline_is_refused_and_the_lock_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def hung_mount(path: object) -> None:
        release.wait(30)

    monkeypatch.setattr(checkpoint, "checkpoint_schema", hung_mount)
    try:
        async with sim_core() as core:
            await paused(core)
            started = time.monotonic()
            with pytest.raises(RefitTimedOut, match=r"0\.3 s \(--refit-check-timeout-s\)"):
                await core.updates.update_from_path(from_path(tmp_path))
            assert time.monotonic() - started < 2
            await still_serving(core)
    finally:
        release.set()


async def test_a_load_past_its_deadline_leaves_the_weights_unknown_and_frees_the_lock(
    model_dir: Path,
) -> None:
    async with sim_core() as core:
        core.backend.load_weights_from_path = lambda path, allow_partial: never()  # type: ignore[method-assign]
        await paused(core)
        update = asyncio.ensure_future(core.updates.update_from_path(from_path(model_dir)))
        await asyncio.sleep(0.05)
        update.cancel()  # the client leaves: the load is still waited for, to its deadline
        with pytest.raises(EngineFailed, match=r"0\.3 s \(--refit-timeout-s\).*unknown"):
            await asyncio.wait_for(update, 3)
        assert core.refit.broken is not None and "--refit-timeout-s" in core.refit.broken
        assert (await asyncio.wait_for(core.refit.resume(), 2)).resumed  # the lock is free


def stream(
    specs: list[TensorSpec], pace_s: float, messages: int = 1000
) -> AsyncIterator[pb.UpdateWeightsFromTensorsRequest]:
    """A manifest, then one small chunk every ``pace_s`` (under the idle watchdog)."""

    async def gen() -> AsyncIterator[pb.UpdateWeightsFromTensorsRequest]:
        manifest = pb.TensorManifest(
            tensors=[
                pb.TensorSpec(name=s.name, dtype=TENSOR_DTYPES[s.dtype], shape=s.shape)
                for s in specs
            ]
        )
        yield pb.UpdateWeightsFromTensorsRequest(manifest=manifest)
        for i in range(messages):
            await asyncio.sleep(pace_s)
            chunk = pb.TensorChunk(tensor=0, offset=i, data=b"\0")
            yield pb.UpdateWeightsFromTensorsRequest(chunk=chunk)

    return gen()


async def test_a_trickled_stream_is_refused_at_the_refit_deadline(model_dir: Path) -> None:
    async with sim_core(model=model_dir) as core:
        specs = list(core.backend.weights.specs.values())
        await paused(core)
        started = time.monotonic()
        with pytest.raises(RefitTimedOut, match=r"--refit-timeout-s.*old weights still serve"):
            await update_from_tensors(core, stream(specs, pace_s=0.05))
        assert time.monotonic() - started < 2
        await still_serving(core)


async def test_a_slow_manifest_check_is_refused_and_a_slow_commit_breaks(model_dir: Path) -> None:
    async with sim_core(model=model_dir) as core:
        specs = list(core.backend.weights.specs.values())
        original = core.backend.begin_tensor_update

        async def slow_check(*args: object, **kwargs: object) -> WeightWriter:
            await asyncio.sleep(30)
            raise AssertionError

        core.backend.begin_tensor_update = slow_check  # type: ignore[method-assign]
        await paused(core)
        with pytest.raises(RefitTimedOut, match="nothing was loaded"):
            await update_from_tensors(core, stream(specs, 0, messages=0))
        assert core.refit.broken is None

        async def slow_commit(tensors: list[TensorSpec], *, allow_partial: bool) -> WeightWriter:
            writer = await original(tensors, allow_partial=allow_partial)
            writer.commit = never  # type: ignore[method-assign]
            return writer

        core.backend.begin_tensor_update = slow_commit  # type: ignore[method-assign]
        one = [TensorSpec(specs[0].name, specs[0].dtype, specs[0].shape)]
        requests = update_requests(
            [Tensor(one[0].name, one[0].dtype, one[0].shape, bytes(one[0].nbytes))],
            allow_partial=True,
        )
        with pytest.raises(EngineFailed, match=r"committing the streamed weights.*unknown"):
            await update_from_tensors(core, aiter_of(requests))
        assert core.refit.broken is not None


async def test_transfer_phases_past_the_deadline(tmp_path: Path) -> None:
    async with sim_core() as core:
        backend = core.backend
        shut_down: list[bool] = []

        async def hang(*args: object) -> None:
            await asyncio.sleep(30)

        async def shutdown() -> None:
            shut_down.append(True)

        backend.init_weight_transfer = hang  # type: ignore[method-assign]
        backend.shutdown_weight_transfer = shutdown  # type: ignore[method-assign]
        with pytest.raises(RefitTimedOut, match=r"InitWeightTransferEngine.*shut down"):
            await core.updates.init_weight_transfer({})
        assert shut_down and core.refit.broken is None

        backend.update_weights = hang  # type: ignore[method-assign]
        await update_started(core)
        with pytest.raises(EngineFailed, match=r"UpdateWeights did not end.*unknown"):
            await core.updates.update_weights({})
        assert core.refit.broken is not None
        await asyncio.wait_for(core.refit.resume(), 2)  # nothing left in progress


async def test_an_update_the_backend_refuses_is_invalid_and_leaves_the_update_open() -> None:
    """A WeightUpdateError from the backend's update (vLLM: ``packed`` against the
    group's init, backends/vllm/transfer_packing.py) answers INVALID_ARGUMENT; the
    server is not broken, and the update can go on and finish."""
    async with sim_core() as core:
        backend = core.backend
        updates: list[object] = []

        async def finish() -> WeightLoad:
            return WeightLoad(0, 0)

        async def refuse(info: object) -> None:
            if info == {"packed": True}:
                raise WeightUpdateError("update_info 'packed' is true but the init set false")
            updates.append(info)

        backend.update_weights = refuse  # type: ignore[method-assign]
        backend.finish_weight_update = finish  # type: ignore[method-assign]
        await update_started(core)
        with pytest.raises(InvalidRequest, match=r"update_info_json: .*'packed' is true.*stay"):
            await core.updates.update_weights({"packed": True})
        assert core.refit.broken is None
        await core.updates.update_weights({"names": []})
        assert updates == [{"names": []}]
        await core.updates.finish_weight_update(pb.FinishWeightUpdateRequest())
        await still_serving(core)


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """(allowed, outside): each holding a copy of the seed-1 weights as ``w``."""
    weights = tiny_weights_dir(1)
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    for folder in (allowed, outside):
        (folder / "w").mkdir(parents=True)
        shutil.copy(weights / "model.safetensors", folder / "w" / "model.safetensors")
    return allowed, outside


def test_a_refusal_names_long_folders_whole(tmp_path: Path) -> None:
    # Checkpoint folders are often longer than a clipped value (80 characters).
    allowed = tmp_path / ("checkpoints-" + "a" * 120)
    asked = tmp_path / ("outside-" + "b" * 120) / "step_000120"
    for folder in (allowed, asked):
        folder.mkdir(parents=True)
    with pytest.raises(checkpoint.FolderNotAllowed) as denied:
        checkpoint.preflight(str(asked), (allowed,))
    assert repr(str(allowed)) in str(denied.value)
    assert repr(str(asked)) in str(denied.value)


async def test_the_allow_list_holds_the_resolved_path(
    model_dir: Path, folders: tuple[Path, Path], tmp_path: Path
) -> None:
    allowed, outside = folders
    (allowed / "out").symlink_to(outside / "w")  # a symlink inside, pointing outside
    (tmp_path / "in").symlink_to(allowed / "w")  # one outside, pointing inside
    (tmp_path / "allowed-twin").mkdir()  # a prefix of the name is not containment
    refit = RefitConfig(allowed_dirs=(allowed,))
    async with sim_core(refit, model=model_dir) as core:
        loaded: list[str] = []
        load = core.backend.load_weights_from_path

        async def record(path: str, *, allow_partial: bool) -> WeightLoad:
            loaded.append(path)
            return await load(path, allow_partial=allow_partial)

        core.backend.load_weights_from_path = record  # type: ignore[method-assign]
        await paused(core)
        for escape in (allowed / "out", allowed / ".." / "outside" / "w", outside / "w"):
            with pytest.raises(WeightsPathDenied, match="--weights-allowed-dir") as denied:
                await core.updates.update_from_path(from_path(escape))
            assert str(allowed) in str(denied.value)
            assert "old weights still serve" in str(denied.value)
        with pytest.raises(WeightsPathDenied):
            await core.updates.update_from_path(from_path(tmp_path / "allowed-twin"))
        assert loaded == []
        await core.updates.update_from_path(from_path(tmp_path / "in"))
        await core.updates.update_from_path(from_path(allowed / "w" / ".." / "w"))
        assert loaded == [str(allowed / "w")] * 2  # the path checked is the path loaded
        await still_serving(core)


async def test_a_manifest_longer_than_the_model_is_refused_before_it_is_read(
    model_dir: Path,
) -> None:
    async with sim_core(model=model_dir) as core:
        count = len(core.backend.weights.specs)
        junk = [Tensor(f"junk.{i}", "float32", (0,), b"") for i in range(count + 1)]
        await paused(core)
        with pytest.raises(InvalidRequest, match=f"{count + 1} tensors, more than the served"):
            await update_from_tensors(core, aiter_of(update_requests(junk)))
        await still_serving(core)
