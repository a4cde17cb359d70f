"""The catch-up gate's decisions (``bridge/catch_up.py``): what a bridge does with an
engine server given the fleet's committed record, and the loop that acts on them,
against a scripted engine and store (no gRPC, no Dynamo). The real processes are
tests/faults/test_faults_catch_up.py; the bridge's link, tests/bridge/test_bridge_catch_up.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest

from bridge import catch_up
from bridge.catch_up import Action, CatchUp, CatchUpOutcome, decide
from engine_contract.v1 import engine_pb2 as pb
from harness.engine import refit_state
from harness.waits import wait_until_async
from rl_client.committed import CheckpointSource, CommittedRecord, CommittedWeights, PushedSource

CKPT = "/ckpt/step-7"


def record(
    version: str = "7", source: CheckpointSource | PushedSource | None = None
) -> CommittedRecord:
    return CommittedRecord(CommittedWeights(version, source or CheckpointSource(CKPT)))


# -- decide ---------------------------------------------------------------------------


def test_no_record_registers_as_ever() -> None:
    decision = decide(None, refit_state())
    assert decision.action is Action.REGISTER and decision.committed is None


def test_an_engine_on_the_committed_version_registers() -> None:
    decision = decide(record(), refit_state("7", declared=True, paused=True))
    assert decision.action is Action.CURRENT
    assert decision.committed == CommittedWeights("7", CheckpointSource(CKPT))


@pytest.mark.parametrize(
    "engine",
    [
        refit_state(),  # restarted: its start checkpoint
        refit_state("6", declared=True),  # an older refit's
        refit_state("7", declared=False),  # the committed label, never set: its start weights
    ],
    ids=["initial", "older", "same label undeclared"],
)
def test_a_committed_checkpoint_the_engine_lacks_is_loaded(engine: pb.RefitState) -> None:
    decision = decide(record(), engine)
    assert decision.action is Action.LOAD
    assert CKPT in decision.why and "'7'" in decision.why


def test_pushed_weights_are_waited_for() -> None:
    decision = decide(record(source=PushedSource()), refit_state())
    assert decision.action is Action.WAIT and "keeper" in decision.why


def test_an_engine_asleep_is_not_loaded() -> None:
    decision = decide(record(), refit_state(sleeping=True))
    assert decision.action is Action.WAIT and "asleep" in decision.why


MIXED = "a weight-transfer update ended unfinished (...) after 2 UpdateWeights round(s)"
PART_WAY = "a weight-transfer update is part way, 1 UpdateWeights round(s) sent"


@pytest.mark.parametrize(
    ("source", "action", "said"),
    [(CheckpointSource(CKPT), Action.LOAD, CKPT), (PushedSource(), Action.WAIT, "keeper")],
    ids=["checkpoint", "pushed"],
)
def test_the_committed_label_on_weights_an_update_left_mixed_is_not_current(
    source: CheckpointSource | PushedSource, action: Action, said: str
) -> None:
    """Revision 12: the label alone looks current; the weights are not that version."""
    decision = decide(record(source=source), refit_state("7", declared=True, mixed=MIXED))
    assert decision.action is action and said in decision.why
    assert f"'7', not whole ({MIXED})" in decision.why, decision.why


@pytest.mark.parametrize(
    ("label", "mixed", "said"),
    [
        ("7", PART_WAY, PART_WAY),
        ("6", PART_WAY, PART_WAY),
        ("6", "", "no UpdateWeights round sent yet"),
    ],
    ids=["part way, committed label", "part way, older label", "no round yet, older label"],
)
def test_an_open_update_is_left_to_its_writer(label: str, mixed: str, said: str) -> None:
    """The engine refuses a load under it (it would land between the writer's
    rounds), and would not resume until the update ends."""
    state = refit_state(label, declared=True, mixed=mixed, update_open=True)
    decision = decide(record(), state)
    assert decision.action is Action.WAIT
    assert f"open on the engine ({said}): waiting for its writer" in decision.why
    assert "ShutdownWeightTransferEngine" in decision.why


def test_an_update_started_with_no_round_yet_leaves_the_committed_label_current() -> None:
    decision = decide(record(), refit_state("7", declared=True, update_open=True))
    assert decision.action is Action.CURRENT


# -- the loop -------------------------------------------------------------------------


@dataclass
class Store:
    """Records as the store would hand them, one per read (the last one repeats);
    an exception instance is raised instead."""

    answers: list[CommittedRecord | Exception | None]
    reads: int = 0

    def read(self) -> CommittedRecord | None:
        answer = self.answers[min(self.reads, len(self.answers) - 1)]
        self.reads += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    def publish(self, record: CommittedRecord) -> None:
        self.answers = [record]

    def delete(self) -> None:
        self.answers = [None]


def refused(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )


@dataclass
class Engine:
    """An engine server's refit state and the calls the gate makes, in order."""

    state: pb.RefitState = field(default_factory=refit_state)
    calls: list[str] = field(default_factory=list)
    # Loads to refuse before one succeeds; what to run during the next load.
    refuse_loads: int = 0
    during_load: Callable[[], None] | None = None
    # Called on each server_info: a trainer acting meanwhile.
    on_info: Callable[[Engine], None] | None = None

    async def server_info(
        self, request: pb.GetServerInfoRequest | None = None
    ) -> pb.GetServerInfoResponse:
        self.calls.append("info")
        if self.on_info is not None:
            self.on_info(self)
        return pb.GetServerInfoResponse(instance_id="i", refit_state=self.state)

    async def pause_generation(
        self, request: pb.PauseGenerationRequest
    ) -> pb.PauseGenerationResponse:
        self.calls.append(f"pause {pb.PauseMode.Name(request.mode)}")
        self.state.paused = True
        return pb.PauseGenerationResponse()

    async def update_weights_from_path(
        self, request: pb.UpdateWeightsFromPathRequest
    ) -> pb.UpdateWeightsFromPathResponse:
        self.calls.append(f"load {request.path} as {request.options.weight_version}")
        if not self.state.paused:
            raise refused("not paused")
        if self.refuse_loads:
            self.refuse_loads -= 1
            raise refused(f"{request.path}: no such folder")
        if self.during_load is not None:
            during, self.during_load = self.during_load, None
            during()
        self.state.weight_version = request.options.weight_version
        self.state.weight_version_declared = True
        if not request.options.allow_partial:
            self.state.weights_mixed = ""  # whole weights
        return pb.UpdateWeightsFromPathResponse()

    async def resume_generation(
        self, request: pb.ResumeGenerationRequest | None = None
    ) -> pb.ResumeGenerationResponse:
        self.calls.append("resume")
        self.state.paused = False
        return pb.ResumeGenerationResponse(resumed=True)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("POLL_FIRST_S", "POLL_MAX_S", "RETRY_FIRST_S", "RETRY_MAX_S"):
        monkeypatch.setattr(catch_up, name, 0.001)


async def run(store: Store, engine: Engine) -> tuple[catch_up.Result, list[str]]:
    holds: list[str] = []

    async def hold(why: str) -> None:
        holds.append(why)

    result = await asyncio.wait_for(CatchUp(store, engine).run(on_hold=hold), 10)
    return result, holds


async def test_without_a_record_nothing_is_called_and_nothing_held() -> None:
    engine = Engine(refit_state(paused=True))
    result, holds = await run(Store([None]), engine)
    assert (result.outcome, result.version, result.source) == (CatchUpOutcome.NO_RECORD, None, None)
    assert engine.calls == ["info"] and holds == []
    assert engine.state.paused  # a trainer's first refit resumes it, as before


async def test_a_paused_restart_loads_the_checkpoint_then_resumes() -> None:
    engine = Engine(refit_state(paused=True))  # --start-paused
    result, holds = await run(Store([record()]), engine)
    assert (result.outcome, result.version, result.source) == (
        CatchUpOutcome.LOADED,
        "7",
        "checkpoint",
    )
    assert engine.calls == ["info", f"load {CKPT} as 7", "info", "resume"]
    assert len(holds) == 1 and CKPT in holds[0]
    assert (engine.state.weight_version, engine.state.paused) == ("7", False)


async def test_an_engine_that_runs_is_paused_with_abort_first() -> None:
    engine = Engine(refit_state("6", declared=True))
    result, _ = await run(Store([record()]), engine)
    assert result.outcome is CatchUpOutcome.LOADED
    assert engine.calls[:3] == ["info", "pause PAUSE_MODE_ABORT", f"load {CKPT} as 7"]
    assert engine.calls[-1] == "resume"


async def test_an_engine_on_the_committed_version_is_left_as_it_is() -> None:
    # Paused by a trainer's refit, say: not the gate's to resume.
    engine = Engine(refit_state("7", declared=True, paused=True))
    result, holds = await run(Store([record()]), engine)
    assert result.outcome is CatchUpOutcome.CURRENT
    assert engine.calls == ["info"] and holds == [] and engine.state.paused


async def test_weights_an_update_left_mixed_under_the_committed_label_are_loaded() -> None:
    """A server that refuses to resume until whole weights land (paused, mixed)."""
    engine = Engine(refit_state("7", declared=True, paused=True, mixed=MIXED))
    result, holds = await run(Store([record()]), engine)
    assert (result.outcome, result.version) == (CatchUpOutcome.LOADED, "7")
    assert engine.calls == ["info", f"load {CKPT} as 7", "info", "resume"]
    assert len(holds) == 1 and MIXED in holds[0]
    assert (engine.state.weights_mixed, engine.state.paused) == ("", False)


async def test_an_update_part_way_is_waited_out_then_followed() -> None:
    def writer(engine: Engine) -> None:
        if engine.calls.count("info") == 3:  # its finish: whole, labelled 7
            engine.state.CopyFrom(refit_state("7", declared=True))

    engine = Engine(refit_state("6", declared=True, mixed=PART_WAY, update_open=True))
    engine.on_info = writer
    result, holds = await run(Store([record()]), engine)
    assert (result.outcome, result.version) == (CatchUpOutcome.PUSHED, "7")
    assert engine.calls == ["info"] * 3 and len(holds) == 1 and PART_WAY in holds[0]


async def test_a_refit_that_commits_during_the_load_is_followed() -> None:
    store = Store([record()])
    engine = Engine(refit_state(paused=True))
    engine.during_load = lambda: store.publish(record("8", CheckpointSource("/ckpt/step-8")))
    result, holds = await run(store, engine)
    assert (result.outcome, result.version) == (CatchUpOutcome.LOADED, "8")
    loads = [c for c in engine.calls if c.startswith("load")]
    assert loads == [f"load {CKPT} as 7", "load /ckpt/step-8 as 8"]
    assert engine.calls[-1] == "resume" and len(holds) == 1


async def test_a_refused_load_is_retried_out_of_the_pool() -> None:
    engine = Engine(refit_state(paused=True), refuse_loads=2)
    result, holds = await run(Store([record()]), engine)
    assert result.outcome is CatchUpOutcome.LOADED
    assert [c for c in engine.calls if c.startswith("load")] == [f"load {CKPT} as 7"] * 3
    assert engine.calls[-1] == "resume" and len(holds) == 1


async def test_a_retried_load_logs_its_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    """Each retry tries the load and fails again: the reason and the failure are
    logged once, not a pair of lines per retry."""
    caplog.set_level(logging.INFO, logger="bridge.catch_up")
    engine = Engine(refit_state(paused=True), refuse_loads=4)
    result, _ = await run(Store([record()]), engine)
    assert result.outcome is CatchUpOutcome.LOADED
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "loading it before serving" in line]) == 1, lines
    assert len([line for line in lines if "failed: FAILED_PRECONDITION" in line]) == 1, lines
    assert len(lines) == 2, lines


async def test_an_unreadable_record_holds_the_worker_until_it_reads() -> None:
    store = Store(
        [ValueError("the committed-weights record is not JSON"), ConnectionError(), record()]
    )
    engine = Engine(refit_state(paused=True))
    result, _ = await run(store, engine)
    assert result.outcome is CatchUpOutcome.LOADED and store.reads >= 3
    # The failed reads asked the engine nothing, and loaded nothing.
    assert engine.calls == ["info", f"load {CKPT} as 7", "info", "resume"]


async def test_pushed_weights_are_awaited_without_a_call_but_info() -> None:
    polls = 0

    def trainer(engine: Engine) -> None:
        nonlocal polls
        polls += 1
        if polls == 5:  # the keeper's push: loaded, labelled, resumed
            engine.state.weight_version, engine.state.weight_version_declared = "7", True
            engine.state.paused = False

    engine = Engine(refit_state(paused=True), on_info=trainer)
    result, holds = await run(Store([record(source=PushedSource())]), engine)
    assert (result.outcome, result.version, result.source) == (CatchUpOutcome.PUSHED, "7", "pushed")
    assert engine.calls == ["info"] * 5
    assert len(holds) == 1 and "keeper" in holds[0]


async def test_an_engine_that_does_not_answer_is_asked_again() -> None:
    answers = iter([refused("starting"), None])

    def flaky(engine: Engine) -> None:
        failure = next(answers, None)
        if failure is not None:
            raise failure

    engine = Engine(refit_state("7", declared=True), on_info=flaky)
    result, _ = await run(Store([record()]), engine)
    assert result.outcome is CatchUpOutcome.CURRENT and engine.calls == ["info", "info"]


async def test_cancelled_while_waiting_ends_at_once() -> None:
    engine = Engine(refit_state(paused=True))
    task = asyncio.ensure_future(CatchUp(Store([record(source=PushedSource())]), engine).run())
    await wait_until_async(lambda: len(engine.calls) >= 3, 10, "the gate polling")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_backend_with_no_record_store_turns_catch_up_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert catch_up.committed_store_for("ns", "backend", "kubernetes") is None
    assert "catch-up before serving is off" in caplog.text
    assert catch_up.committed_store_for("ns", "backend", "file") is not None
