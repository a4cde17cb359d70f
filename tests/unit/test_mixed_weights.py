"""Weights whose label no longer names them, at the serving core: a weight-transfer
update part way (its rounds loaded, not finished), or one that ended unfinished on an
engine that cannot roll it back (vLLM's NCCL engine; here the sim's phases, each a
no-op, and the base backend's refusal to roll back).

- While an update is part way, no version-guarded request is served, the label's
  version included; unguarded ones are (an unpaused update is its trainer's choice).
- An update left unfinished after its rounds (its trainer gone, its finish failed or
  cancelled) keeps a paused server paused and guarded requests refused until whole
  weights land: a finished transfer update, or a path or tensor update that names
  every tensor (not ``allow_partial``). No path or tensor update is taken while an
  update is open: it would land between its trainer's rounds.
- An update left before any round reached the engine, or whose only round was
  refused before the engine saw it (its caller gone or not), leaves the weights whole.
- Where the engine refuses to release a group during an update (vLLM 0.32's own
  engines), the finish of an update whose group was released or replaced
  meanwhile sets no label.
- What a step did is recorded though its caller left (a rollback, a round), and a
  release that ends after its deadline leaves an update started since alone.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from engine_contract.tensors import update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.refit import WeightLoad, WeightUpdateError
from engine_server.config import RefitConfig
from engine_server.core import ServerCore
from engine_server.errors import (
    InvalidRequest,
    RefitRefused,
    RefitTimedOut,
    WeightVersionMismatch,
)
from engine_server.refit_requests import update_from_tensors
from harness.checkpoints import checkpoint_tensors
from harness.engine import nothing
from tests.unit.test_refit_control import (
    aiter_of,
    from_path,
    paused,
    sim_core,
    still_serving,
    update_started,
)
from tests.unit.test_weight_guard import collect, generate, rollout, spans, tokens_made

pytestmark = pytest.mark.timeout(60)

MIXED = r"ended unfinished \({how}\) after {rounds} UpdateWeights round\(s\) reached the engine"
RELEASED = (
    "a release or replacement of its trainer's group was asked while it was open "
    r"\(ShutdownWeightTransferEngine releases the trainer's group\)"
)


async def finished() -> WeightLoad:
    return WeightLoad(0, 0)


@pytest.fixture
async def core(model_dir: Path) -> AsyncIterator[ServerCore]:
    """The sim on the tiny model, labelled "v1", its transfer phases no-ops and no
    way to roll an update back; default deadlines (a path load is no race). 2 ms a
    step, so that a long request is still running when the test looks for it: with
    none, its 400 tokens were all made before the first look, 10 ms on, in 11 of 200
    repeats of the first test's opening (0 of 200 at 2 ms)."""
    async with sim_core(RefitConfig(), model=model_dir, decode_step_ms=2.0) as server:
        backend = server.backend
        backend.init_weight_transfer = nothing  # type: ignore[method-assign]
        backend.start_weight_update = nothing  # type: ignore[method-assign]
        backend.update_weights = nothing  # type: ignore[method-assign]
        backend.finish_weight_update = finished  # type: ignore[method-assign]
        backend.shutdown_weight_transfer = nothing  # type: ignore[method-assign]
        await server.refit.update_version("v1")
        yield server


def reported(core: ServerCore) -> tuple[str, bool]:
    """What the server reports (revision 12): why its weights are not whole, and
    whether an update is open."""
    state = core.refit.state()
    return state.weights_mixed, state.weight_update_open


async def refused_guarded(core: ServerCore, why: str) -> None:
    """A guarded rollout and Generate for the label serving are refused, retryably."""
    for call in (
        core.rollout(rollout("r", "v1", max_new_tokens=4)),
        collect(core.generate(generate("g", "v1"))),
    ):
        with pytest.raises(WeightVersionMismatch, match=why) as refused:
            await call
        assert refused.value.code == grpc.StatusCode.ABORTED
        assert str(refused.value).startswith("required_weight_version:")


async def test_no_guarded_request_is_served_while_an_unpaused_update_is_part_way(
    core: ServerCore,
) -> None:
    await core.updates.start_weight_update(pb.WeightUpdateOptions(allow_unpaused=True))
    # Started, nothing sent yet: the weights are still v1's.
    assert reported(core) == ("", True)
    assert spans(await core.rollout(rollout("before", "v1", max_new_tokens=4))) == [("v1", 0, 4)]
    running = asyncio.ensure_future(core.rollout(rollout("running", "v1")))
    await tokens_made(core, 1, at_least=2)
    await core.updates.update_weights({})
    # The one running ended at the round, with its tokens of v1 only.
    answer = await asyncio.wait_for(running, 5)
    assert answer.finish_reason == pb.FINISH_REASON_WEIGHT_VERSION_CHANGED
    assert spans(answer) == [("v1", 0, len(answer.token_ids))]
    await refused_guarded(core, r"labelled 'v1', are not one version whole: .*part way, 1 ")
    mixed, update_open = reported(core)
    assert update_open and mixed.startswith("a weight-transfer update is part way, 1 "), mixed
    assert (await core.rollout(rollout("free", max_new_tokens=4))).token_ids
    await core.updates.finish_weight_update(pb.FinishWeightUpdateRequest(weight_version="v2"))
    assert reported(core) == ("", False)
    assert spans(await core.rollout(rollout("after", "v2", max_new_tokens=4))) == [("v2", 0, 4)]


@pytest.mark.parametrize("whole", ["transfer", "path", "tensors"])
async def test_an_update_left_after_its_rounds_keeps_the_server_paused_until_whole_weights_land(
    core: ServerCore, model_dir: Path, whole: str
) -> None:
    await update_started(core)
    await core.updates.update_weights({})
    await core.updates.update_weights({})
    await core.updates.shutdown_weight_transfer()  # its trainer is gone
    mixed = MIXED.format(how=RELEASED, rounds=2)
    with pytest.raises(RefitRefused, match=mixed + r".*load whole weights before resuming"):
        await core.refit.resume()
    said, update_open = reported(core)
    assert re.search(mixed, said) and not update_open, said
    await refused_guarded(core, mixed)
    # Some tensors only: still not whole.
    some = pb.UpdateWeightsFromPathRequest(
        path=str(model_dir), options=pb.WeightUpdateOptions(allow_partial=True)
    )
    await core.updates.update_from_path(some)
    with pytest.raises(RefitRefused, match=mixed):
        await core.refit.resume()
    if whole == "transfer":
        await core.updates.start_weight_update(pb.WeightUpdateOptions())
        await core.updates.update_weights({})
        await core.updates.finish_weight_update(pb.FinishWeightUpdateRequest())
    elif whole == "path":
        await core.updates.update_from_path(from_path(model_dir))
    else:  # every tensor of the tiny model
        await update_from_tensors(core, aiter_of(update_requests(checkpoint_tensors(model_dir))))
    await still_serving(core)
    assert reported(core) == ("", False)
    assert spans(await core.rollout(rollout("r", "v1", max_new_tokens=4))) == [("v1", 0, 4)]


@pytest.mark.parametrize("rounds", [0, 1])
async def test_no_checkpoint_or_tensor_load_lands_beside_an_open_update(
    core: ServerCore, model_dir: Path, rounds: int
) -> None:
    """It would land between the trainer's rounds, and the finish would label both."""
    await update_started(core)
    for _ in range(rounds):
        await core.updates.update_weights({})
    changes = core.refit.weight_changes
    refused = (
        rf"a weight-transfer update is open \({rounds} UpdateWeights round\(s\) sent since "
        r"StartWeightUpdate\): a load now would land between its writer's rounds; its writer "
        r"ends it \(FinishWeightUpdate; a writer that is gone: ShutdownWeightTransferEngine "
        r"ends it, or FinishWeightUpdate where the engine refuses that\)"
    )
    with pytest.raises(RefitRefused, match=refused) as path:
        await core.updates.update_from_path(from_path(model_dir))
    assert path.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RefitRefused, match=refused):
        await update_from_tensors(core, aiter_of(update_requests(checkpoint_tensors(model_dir))))
    assert core.refit.weight_changes == changes and core.refit.transfer.update is not None
    await core.updates.finish_weight_update(pb.FinishWeightUpdateRequest(weight_version="v2"))
    assert reported(core) == ("", False) and core.refit.version == "v2"
    # Once it ended, a checkpoint loads as before.
    await core.updates.update_from_path(from_path(model_dir))
    assert core.refit.weight_changes == changes + 1


async def test_a_finish_whose_caller_left_leaves_the_label_unset_and_the_server_paused(
    core: ServerCore,
) -> None:
    release = asyncio.Event()

    async def slow_finish() -> WeightLoad:
        await release.wait()
        return WeightLoad(0, 0)

    core.backend.finish_weight_update = slow_finish  # type: ignore[method-assign]
    await update_started(core)
    await core.updates.update_weights({})
    call = asyncio.ensure_future(
        core.updates.finish_weight_update(pb.FinishWeightUpdateRequest(weight_version="v2"))
    )
    await asyncio.sleep(0.05)
    call.cancel()  # the trainer's process is gone
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert core.refit.version == "v1" and core.refit.transfer.update is None
    how = "its FinishWeightUpdate failed or its caller left"
    with pytest.raises(RefitRefused, match=MIXED.format(how=how, rounds=1)):
        await core.refit.resume()


@pytest.mark.parametrize("round_", ["none", "refused before the engine saw it"])
async def test_an_update_left_before_any_round_loaded_leaves_the_weights_whole(
    core: ServerCore, round_: str
) -> None:
    async def refuse(info: object) -> None:
        raise WeightUpdateError("names a tensor the model lacks")

    core.backend.update_weights = refuse  # type: ignore[method-assign]
    await update_started(core)
    if round_ != "none":
        with pytest.raises(InvalidRequest, match="nothing was loaded"):
            await core.updates.update_weights({})
    await core.updates.shutdown_weight_transfer()
    await still_serving(core)
    assert spans(await core.rollout(rollout("r", "v1", max_new_tokens=4))) == [("v1", 0, 4)]


@pytest.mark.parametrize("refused", [False, True], ids=["loaded", "refused"])
async def test_a_round_whose_caller_left_counts_unless_refused(
    core: ServerCore, refused: bool
) -> None:
    """The engine ends a round whose caller went away meanwhile: one it loaded
    counts; one refused before the engine saw it does not."""
    release = asyncio.Event()

    async def slow_round(info: object) -> None:
        await release.wait()
        if refused:
            raise WeightUpdateError("names a tensor the model lacks")

    core.backend.update_weights = slow_round  # type: ignore[method-assign]
    await update_started(core)
    call = asyncio.ensure_future(core.updates.update_weights({}))
    await asyncio.sleep(0.05)
    call.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    await core.updates.shutdown_weight_transfer()
    if refused:
        await still_serving(core)
    else:
        with pytest.raises(RefitRefused, match=MIXED.format(how=RELEASED, rounds=1)):
            await core.refit.resume()


async def test_a_server_not_paused_resumes_as_before(core: ServerCore) -> None:
    """Resume of an unpaused server is a no-op, mixed weights or not: it already serves."""
    await core.updates.start_weight_update(pb.WeightUpdateOptions(allow_unpaused=True))
    await core.updates.update_weights({})
    await core.updates.shutdown_weight_transfer()
    assert not (await core.refit.resume()).resumed
    await paused(core)
    with pytest.raises(RefitRefused, match="part old, part new"):
        await core.refit.resume()


async def test_a_finish_after_the_group_was_replaced_or_refused_release_sets_no_label(
    core: ServerCore,
) -> None:
    """vLLM 0.32's own engines refuse to release a group during an update, so a
    trainer gone mid-update leaves a FinishWeightUpdate the only way out: after a
    shutdown or a new init found the update open (orphaned), that finish ends the
    engine's update but sets no label, and the weights are mixed."""

    async def refuse_release() -> None:
        raise RuntimeError("Cannot release a trainer connection during a weight update")

    core.backend.shutdown_weight_transfer = refuse_release  # type: ignore[method-assign]
    await update_started(core)
    await core.updates.update_weights({})
    with pytest.raises(RuntimeError, match="during a weight update"):
        await core.updates.shutdown_weight_transfer()
    await core.updates.init_weight_transfer({})  # a new trainer's group: still open
    with pytest.raises(RefitRefused, match=r"in progress.*FinishWeightUpdate"):
        await core.refit.resume()
    with pytest.raises(
        RefitRefused, match=f"but {RELEASED}, on an engine.*label is not set; load whole"
    ):
        await core.updates.finish_weight_update(pb.FinishWeightUpdateRequest(weight_version="v2"))
    assert core.refit.version == "v1" and core.refit.transfer.update is None
    how = f"{RELEASED}, then its FinishWeightUpdate, which set no label"
    with pytest.raises(RefitRefused, match=MIXED.format(how=how, rounds=1)):
        await core.refit.resume()
    # The new trainer's whole update.
    await core.updates.start_weight_update(pb.WeightUpdateOptions())
    await core.updates.update_weights({})
    await core.updates.finish_weight_update(pb.FinishWeightUpdateRequest(weight_version="v2"))
    await still_serving(core)
    assert spans(await core.rollout(rollout("r", "v2", max_new_tokens=4))) == [("v2", 0, 4)]


async def test_a_rollback_whose_caller_left_still_ends_the_update(core: ServerCore) -> None:
    """The gloo engine's way: the shutdown's caller leaves while the engine rolls
    back; the update is over all the same, and the old weights serve."""
    release = asyncio.Event()

    async def roll_back(why: str) -> None:
        await release.wait()

    core.backend.abort_weight_update = roll_back  # type: ignore[method-assign]
    await update_started(core)
    await core.updates.update_weights({})
    call = asyncio.ensure_future(core.updates.shutdown_weight_transfer())
    await asyncio.sleep(0.05)
    call.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert core.refit.transfer.update is None
    await still_serving(core)
    assert spans(await core.rollout(rollout("r", "v1", max_new_tokens=4))) == [("v1", 0, 4)]


async def test_a_release_past_its_deadline_says_the_weights_are_mixed(model_dir: Path) -> None:
    async with sim_core(RefitConfig(check_timeout_s=1, timeout_s=1), model=model_dir) as core:
        core.backend.start_weight_update = nothing  # type: ignore[method-assign]
        core.backend.update_weights = nothing  # type: ignore[method-assign]

        async def hang() -> None:
            await asyncio.Event().wait()

        core.backend.shutdown_weight_transfer = hang  # type: ignore[method-assign]
        await update_started(core)
        await core.updates.update_weights({})
        with pytest.raises(RefitTimedOut, match=r"it loaded nothing, but .*part old, part new"):
            await core.updates.shutdown_weight_transfer()


async def test_a_release_that_ends_late_leaves_an_update_started_since(model_dir: Path) -> None:
    async with sim_core(RefitConfig(check_timeout_s=1, timeout_s=1), model=model_dir) as core:
        core.backend.start_weight_update = nothing  # type: ignore[method-assign]
        release = asyncio.Event()

        async def slow_release() -> None:
            await release.wait()

        core.backend.shutdown_weight_transfer = slow_release  # type: ignore[method-assign]
        await paused(core)
        with pytest.raises(RefitTimedOut):
            await core.updates.shutdown_weight_transfer()
        await core.updates.start_weight_update(pb.WeightUpdateOptions())
        release.set()
        stuck = core.refit.transfer.stuck
        assert stuck is not None
        await asyncio.wait_for(stuck.ended, 5)  # the late release has ended
        assert core.refit.transfer.update is not None  # still the new one's
