"""One writer per fleet, fenced at the engine, every pause undone (issue 37).

Four sim engine servers in this process (real gRPC), driven by
``EngineRefitClient``s sharing one file store: the engine's count of weight
changes refuses a stale writer (a second trainer, a catching-up bridge), the
fleet's lease refuses a second trainer at once, the record is a
compare-and-set, a cancelled refit resumes what it paused, and a worker that
serves the committed version is never taken out of the pool."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bridge.catch_up import CatchUp
from engine_contract.refit_rules import UPDATE_OPEN
from engine_contract.tensors import update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_server.backends.refit import PauseMode, WeightLoad
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import greedy_rollout, nothing, tokens_and_logprobs
from rl_client.committed import (
    CheckpointSource,
    CommittedRecord,
    CommittedWeights,
    FileCommittedStore,
    RecordChanged,
    WeightSource,
)
from rl_client.fleet_lease import FileFleetLease, Holder, LeaseHeld, LeaseLost
from rl_client.refit import EngineRefitClient
from rl_client.refit_report import Deadlines, Outcome, RefitError, Served
from rl_client.refit_rpc import RefitRpc
from tests.rl_client.fleet_fakes import Obedient
from tests.rl_client.test_fleet_refit import PROMPT, Faulty, Fleet, real, serving

pytestmark = pytest.mark.serial

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class Stoppable(Faulty):
    """A sim whose pause can hang, as a SIGSTOPped engine's does."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.stopped = False

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        while self.stopped:  # noqa: ASYNC110 - a flag the test thread flips, no event
            await asyncio.sleep(0.05)
        await super().pause(mode, clear_cache)


@pytest.fixture
def fleet(model_dir: Path) -> Iterator[Fleet]:
    backends = [Stoppable(model_dir) for _ in range(4)]
    with serving(backends) as served:
        try:
            yield served
        finally:  # first: a pause held by ``stopped`` would keep the servers from stopping
            for backend in backends:
                backend.stopped = False


@pytest.fixture
def store(tmp_path: Path) -> FileCommittedStore:
    store = FileCommittedStore(tmp_path / "kv", "ns")
    store.publish(
        CommittedRecord(CommittedWeights("0", CheckpointSource(str(tiny_weights_dir(0)))))
    )
    return store


def changes(fleet: Fleet, i: int) -> int:
    return fleet.stub(i).GetLoad(pb.GetLoadRequest(), timeout=10).refit_state.weight_changes


# -- the engine's fence ---------------------------------------------------------------


def test_the_engine_counts_weight_changes_and_refuses_a_stale_writer(fleet: Fleet) -> None:
    stub = fleet.stub(0)
    before = fleet.outputs()[0]
    assert changes(fleet, 0) == 0
    assert stub.GetWeightVersion(pb.GetWeightVersionRequest()).weight_changes == 0
    stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))
    path = str(tiny_weights_dir(1))
    loaded = stub.UpdateWeightsFromPath(
        pb.UpdateWeightsFromPathRequest(
            path=path, options=pb.WeightUpdateOptions(expect_weight_changes=0)
        )
    )
    assert loaded.result.weight_changes == 1
    # A writer that read 0 is now stale: its label, load and stream are refused.
    with pytest.raises(grpc.RpcError) as stale:
        stub.UpdateWeightVersion(
            pb.UpdateWeightVersionRequest(weight_version="x", expect_weight_changes=0)
        )
    assert stale.value.code() == FAILED_PRECONDITION
    assert "expected weight change 0, but the engine is at 1 (serving 'default')" in str(
        stale.value.details()
    )
    with pytest.raises(grpc.RpcError) as stale:
        stub.UpdateWeightsFromPath(
            pb.UpdateWeightsFromPathRequest(
                path=str(tiny_weights_dir(2)),
                options=pb.WeightUpdateOptions(expect_weight_changes=0),
            )
        )
    assert stale.value.code() == FAILED_PRECONDITION
    requests = update_requests(checkpoint_tensors(tiny_weights_dir(2)), expect_weight_changes=0)
    with pytest.raises(grpc.RpcError) as stale:
        stub.UpdateWeightsFromTensors(iter(list(requests)))
    assert stale.value.code() == FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as stale:
        stub.StartWeightUpdate(
            pb.StartWeightUpdateRequest(options=pb.WeightUpdateOptions(expect_weight_changes=0))
        )
    assert stale.value.code() == FAILED_PRECONDITION
    # Nothing changed: still checkpoint 1, unlabelled, at one change.
    assert changes(fleet, 0) == 1
    assert (
        stub.UpdateWeightVersion(
            pb.UpdateWeightVersionRequest(weight_version="1", expect_weight_changes=1)
        ).weight_changes
        == 2
    )
    stub.ResumeGeneration(pb.ResumeGenerationRequest())
    assert fleet.versions()[0] == ("1", True)
    assert fleet.outputs()[0] != before
    # No fence: as before revision 10.
    stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(weight_version="2"))
    assert changes(fleet, 0) == 3


@pytest.mark.parametrize("first", ["trainer", "catch-up"])
async def test_a_catch_up_load_and_a_trainers_refit_never_interleave(
    fleet: Fleet, store: FileCommittedStore, first: str
) -> None:
    """The race docs/refit.md once called "A limit": a bridge catching up and a
    trainer refitting reach one engine at once. Whichever loads first, the other
    is refused, so the engine never serves one writer's weights under the
    other's label."""
    rpc = RefitRpc.connect(fleet.addresses[0])
    try:
        state = (await rpc.server_info()).refit_state  # what the catch-up decided on
        old = str(tiny_weights_dir(0))
        new = str(tiny_weights_dir(1))
        await rpc.pause_generation(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))
        trainer_read = (await rpc.get_weight_version()).weight_changes
        catch_up = CatchUp(store, rpc)
        if first == "trainer":
            loaded = await rpc.update_weights_from_path(
                pb.UpdateWeightsFromPathRequest(
                    path=new, options=pb.WeightUpdateOptions(expect_weight_changes=trainer_read)
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await catch_up._load(state, old, "0")
            await rpc.update_weight_version(
                pb.UpdateWeightVersionRequest(
                    weight_version="1", expect_weight_changes=loaded.result.weight_changes
                )
            )
            expected = ("1", True)
        else:
            await catch_up._load(state, old, "0")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await rpc.update_weights_from_path(
                    pb.UpdateWeightsFromPathRequest(
                        path=new,
                        options=pb.WeightUpdateOptions(expect_weight_changes=trainer_read),
                    )
                )
            expected = ("0", True)
        assert refused.value.code() == FAILED_PRECONDITION
        assert "stale writer" in str(refused.value.details())
        await rpc.resume_generation()
    finally:
        await rpc.close()
    assert fleet.versions()[0] == expected


# -- the fleet's lease ----------------------------------------------------------------


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path: Path) -> None:
    lease = FileFleetLease(tmp_path / "rec.lease")
    token = lease.acquire("trainer A", 30)
    started = time.monotonic()
    with pytest.raises(
        LeaseHeld, match=r"held by trainer A \(its lease runs out in (29\.\d|30\.0) s"
    ):
        lease.acquire("trainer B", 30)
    assert time.monotonic() - started < 0.5
    with pytest.raises(LeaseLost):
        lease.renew("not-a-token", 30)
    lease.renew(token, 30)
    lease.release("not-a-token")  # not its lease: nothing
    with pytest.raises(LeaseHeld):
        lease.acquire("trainer B", 30)
    lease.release(token)
    lease.release(lease.acquire("trainer B", 30))
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("left", ["expired", "unreadable"])
def test_a_lease_whose_holder_died_is_taken_over(tmp_path: Path, left: str) -> None:
    path = tmp_path / "rec.lease"
    if left == "expired":
        path.write_bytes(Holder("dead trainer", "t", time.time() - 1).to_json())
    else:
        path.write_bytes(b"\x00garbage")
    lease = FileFleetLease(path)
    token = lease.acquire("trainer B", 30)
    holder = Holder.from_json(path.read_bytes())
    assert holder is not None and holder.owner == "trainer B" and holder.token == token
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.lease"]


def test_of_many_writers_at_once_exactly_one_holds_the_lease(tmp_path: Path) -> None:
    path = tmp_path / "rec.lease"
    for expired in (False, True):
        if expired:
            path.write_bytes(Holder("dead trainer", "t", time.time() - 1).to_json())
        winners: list[str] = []
        start = threading.Barrier(8)

        def take(i: int, start: threading.Barrier = start, winners: list[str] = winners) -> None:
            start.wait()
            try:
                FileFleetLease(path).acquire(f"w{i}", 30)
                winners.append(f"w{i}")
            except LeaseHeld:
                pass

        threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(winners) == 1
        holder = Holder.from_json(path.read_bytes())
        assert holder is not None and holder.owner == winners[0]
        path.unlink()


# -- the record is a compare-and-set ----------------------------------------------------


def test_a_record_changed_since_it_was_read_is_not_overwritten(
    store: FileCommittedStore,
) -> None:
    read = store.read_raw()
    other = CommittedRecord(CommittedWeights("other", CheckpointSource("/other")))
    store.publish(other)
    with pytest.raises(RecordChanged, match="another writer published meanwhile"):
        store.swap(
            read, CommittedRecord(CommittedWeights("mine", CheckpointSource("/m"))).to_json()
        )
    assert store.read() == other
    with pytest.raises(RecordChanged):
        store.swap(None, b"{}")  # expected none, there is one
    store.swap(other.to_json(), None)
    assert store.read() is None


class Overtaken(FileCommittedStore):
    """A store another writer (one that took no lease) publishes to just before
    this refit's write."""

    def swap(self, expected: object, new: bytes | None) -> None:
        if new is not None and b'"1"' in new:
            self.publish(CommittedRecord(CommittedWeights("other", CheckpointSource("/o"))))
        super().swap(expected, new)  # type: ignore[arg-type]


async def test_a_refit_never_writes_over_a_record_another_writer_published(
    fleet: Fleet, tmp_path: Path
) -> None:
    store = Overtaken(tmp_path / "kv", "ns")
    store.publish(
        CommittedRecord(CommittedWeights("0", CheckpointSource(str(tiny_weights_dir(0)))))
    )
    async with EngineRefitClient(fleet.addresses, store=store) as trainer:
        with pytest.raises(RefitError) as failed:
            await trainer.refit("1", path=str(tiny_weights_dir(1)))
    assert "another writer published meanwhile" in str(failed.value.report.publish_error)
    record = store.read()
    assert record is not None and record.weights.version == "other"


# -- two trainers, one fleet -----------------------------------------------------------


async def test_two_trainers_refitting_one_fleet_at_once_never_break_it(
    fleet: Fleet, store: FileCommittedStore
) -> None:
    """Issue 37's defect 1: two clients with one store, 0-10 ms apart, 30 times.
    After each: one committed (the other refused at once, naming the holder, or
    it ran after), the store holds the version a client last reported
    committed, every worker serves it, resumed and in the pool."""
    rng = random.Random(37)
    outputs = {}
    for i in range(30):
        ckpt = {"A": tiny_weights_dir(1 + i % 2), "B": tiny_weights_dir(3)}
        committed: list[tuple[float, str]] = []
        refused: list[str] = []

        async def refit(
            who: str,
            delay: float,
            i: int = i,
            ckpt: dict[str, Path] = ckpt,
            committed: list[tuple[float, str]] = committed,
            refused: list[str] = refused,
        ) -> None:
            await asyncio.sleep(delay)
            async with EngineRefitClient(fleet.addresses, store=store) as trainer:
                try:
                    await trainer.refit(f"{who}{i}", path=str(ckpt[who]))
                    committed.append((time.monotonic(), f"{who}{i}"))
                except LeaseHeld as e:
                    refused.append(str(e))

        await asyncio.gather(refit("A", rng.uniform(0, 0.01)), refit("B", rng.uniform(0, 0.01)))
        assert committed, refused
        assert all("another trainer is refitting this fleet" in r for r in refused)
        last = max(committed)[1]
        record = store.read()
        assert record is not None and record.weights.version == last, (i, committed, refused)
        states = fleet.states()
        assert [(s.weight_version, s.paused, s.sleeping) for s in states] == [
            (last, False, False)
        ] * 4, i
        assert {str(o) for o in fleet.outputs()} == {
            outputs.setdefault(str(ckpt[last[0]]), str(fleet.outputs()[0]))
        }


# -- every pause undone ---------------------------------------------------------------


async def test_a_cancelled_refit_resumes_every_worker_it_paused(
    fleet: Fleet, store: FileCommittedStore
) -> None:
    """Issue 37's defect 2: one engine hangs in its pause (as a SIGSTOPped one
    does), and the trainer gives up on the refit: the others resume at once
    rather than stay paused, the lease is free, and the report says why."""
    before = fleet.outputs()
    assert isinstance(fleet.backends[3], Stoppable)
    fleet.backends[3].stopped = True
    deadlines = Deadlines(control_s=1.0)
    async with EngineRefitClient(fleet.addresses, store=store, deadlines=deadlines) as trainer:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(trainer.refit("1", path=str(tiny_weights_dir(1))), 1.0)
        report = trainer.last_report
        assert report is not None and report.interrupted == "cancelled"
        assert [w.resumed for w in report.workers] == [True, True, True, False]
    # The fourth stays hung in its pause, as a stopped process would.
    states = [fleet.stub(i).GetLoad(pb.GetLoadRequest(), timeout=10).refit_state for i in range(3)]
    assert [(s.paused, s.weight_version) for s in states] == [(False, "default")] * 3
    again = [
        tokens_and_logprobs(greedy_rollout(fleet.stub(i), PROMPT, 12, timeout=30)) for i in range(3)
    ]
    assert again == before[:3]
    FileFleetLease(store.path.with_name(f"{store.path.name}.lease")).acquire("next", 1)


async def test_a_refit_cancelled_twice_undoes_before_it_lets_the_lease_go(
    fleet: Fleet, store: FileCommittedStore
) -> None:
    """Cancelled again while it undoes (a caller's second timeout): the refit still
    waits for its undo before it gives up the fleet's lease, so no other writer
    can start while its workers are being resumed."""
    assert isinstance(fleet.backends[3], Stoppable)
    fleet.backends[3].stopped = True
    lease = FileFleetLease(store.path.with_name(f"{store.path.name}.lease"))
    deadlines = Deadlines(control_s=1.5)
    async with EngineRefitClient(fleet.addresses, store=store, deadlines=deadlines) as trainer:
        task = asyncio.ensure_future(trainer.refit("1", path=str(tiny_weights_dir(1))))
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.sleep(0.2)
        assert not task.done()
        task.cancel()  # again, while it resumes the others and waits on the hung one
        await asyncio.sleep(0.2)
        assert not task.done()
        with pytest.raises(LeaseHeld):  # still its own
            lease.acquire("another trainer", 1)
        with pytest.raises(asyncio.CancelledError):
            await task
        report = trainer.last_report
        assert report is not None and [w.resumed for w in report.workers] == [
            True,
            True,
            True,
            False,
        ]
    lease.acquire("another trainer", 1)


class SlowWrite(FileCommittedStore):
    """A store whose write takes its time (a slow etcd)."""

    def swap(self, expected: object, new: bytes | None) -> None:
        time.sleep(1.0)
        super().swap(expected, new)  # type: ignore[arg-type]


async def test_a_refit_cancelled_while_its_record_is_written_is_committed(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The commit point runs to its end: cancelled during the write, the refit
    counts as committed (its report says so) and every worker serves it, never
    the record saying one version while the workers went back to another."""
    store = SlowWrite(tmp_path / "kv", "ns")
    store.publish(
        CommittedRecord(CommittedWeights("0", CheckpointSource(str(tiny_weights_dir(0)))))
    )
    async with EngineRefitClient(fleet.addresses, store=store) as trainer:
        task = asyncio.ensure_future(trainer.refit("1", path=str(tiny_weights_dir(1))))
        await asyncio.sleep(0.6)  # paused, loaded, labelled (sim: milliseconds); writing now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        report = trainer.last_report
        assert report is not None and report.committed and report.interrupted == "cancelled"
    record = store.read()
    assert record is not None and record.weights.version == "1"
    assert [(s.weight_version, s.paused) for s in fleet.states()] == [("1", False)] * 4


async def test_a_refit_cancelled_while_loading_rolls_the_loaded_workers_back(
    fleet: Fleet, store: FileCommittedStore
) -> None:
    before = fleet.outputs()
    new = tiny_weights_dir(1)
    fleet.backends[3].slow[real(new)] = 1.5
    async with EngineRefitClient(fleet.addresses, store=store) as trainer:
        task = asyncio.ensure_future(trainer.refit("1", path=str(new)))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        report = trainer.last_report
        assert report is not None and report.interrupted == "cancelled"
        assert report.outcomes() == {a: Outcome.ROLLED_BACK for a in fleet.addresses}
    assert [(s.paused, s.weight_version) for s in fleet.states()] == [(False, "0")] * 4
    assert fleet.outputs() == before
    record = store.read()
    assert record is not None and record.weights.version == "0"


def test_pauses_get_a_default_deadline() -> None:
    assert Deadlines().pause_s == 120.0 and Deadlines().rollback_s == 1800.0


# -- never out of the pool on the committed version ------------------------------------


class OnCommitted(Obedient):
    """Two workers whose rollback fails; w0 serves the store's committed version
    (another writer put it there)."""

    def __init__(self, store: FileCommittedStore, w0: Served, refusal: str = "refused") -> None:
        super().__init__(
            CommittedWeights("0", CheckpointSource("/old")), store, Deadlines(control_s=1)
        )
        self.w0, self.refusal = w0, refusal
        self.slept: list[str] = []
        self.loaded = False  # w0's state is reported once its load was refused

    async def _load(self, worker: str, source: WeightSource, expect: int | None) -> int | None:
        assert isinstance(source, CheckpointSource)
        if worker == "w0" and source.path == "/new":
            self.loaded = True
            raise RuntimeError(self.refusal)
        if source.path == "/old":
            raise RuntimeError("a stale writer")
        return None

    async def _serving(self, worker: str) -> Served:
        if worker == "w0":
            return self.w0 if self.loaded else Served("theirs")
        return Served("new")

    async def _sleep(self, worker: str) -> None:
        self.slept.append(worker)


@pytest.mark.parametrize(
    ("w0", "refusal", "left"),
    [
        (Served("theirs"), "refused", "it serves the committed version 'theirs'"),
        (
            # Opened after the refit looked, before its load: the engine's refusal.
            Served("theirs", "2 UpdateWeights rounds of an update", update_open=True),
            f"FAILED_PRECONDITION: {UPDATE_OPEN} (2 UpdateWeights round(s) sent ...",
            "it serves the committed version 'theirs', under an update its writer has open",
        ),
    ],
    ids=["whole", "update-open"],
)
async def test_a_worker_serving_the_committed_version_is_never_taken_out(
    store: FileCommittedStore, w0: Served, refusal: str, left: str
) -> None:
    store.publish(CommittedRecord(CommittedWeights("theirs", CheckpointSource("/theirs"))))
    cycle = OnCommitted(store, w0, refusal)
    with pytest.raises(RefitError) as failed:
        await cycle._run("new", CheckpointSource("/new"), "wait", True)
    assert failed.value.report.outcomes() == {"w0": Outcome.ON_COMMITTED, "w1": Outcome.REMOVED}
    assert cycle.slept == ["w1"]
    assert f"left in the pool: {left}" in str(failed.value.report.workers[0].rollback_error)


async def test_a_worker_an_unfinished_update_left_mixed_under_the_committed_label_goes_out(
    store: FileCommittedStore,
) -> None:
    """Its label alone looks committed (contract revision 12 says the weights are not)."""
    store.publish(CommittedRecord(CommittedWeights("theirs", CheckpointSource("/theirs"))))
    cycle = OnCommitted(store, Served("theirs", "an update that ended after 2 rounds"))
    with pytest.raises(RefitError) as failed:
        await cycle._run("new", CheckpointSource("/new"), "wait", True)
    assert failed.value.report.outcomes() == {"w0": Outcome.REMOVED, "w1": Outcome.REMOVED}
    assert sorted(cycle.slept) == ["w0", "w1"]


async def test_a_worker_whose_transfer_update_another_writer_has_open_is_left_to_it(
    fleet: Fleet, store: FileCommittedStore
) -> None:
    """Real engine servers: worker 3 has a weight-transfer update open (a trainer
    outside the lease, unpaused as NeMo RL's). Its engine would refuse the refit's
    load and any resume until that update ends, so the refit does not touch it: it
    stops at the pause, nothing sent, the others resumed, worker 3 never paused.
    Opened between the refit's look and its load instead, the engine's refusal says
    it is another writer's: ``test_a_worker_serving_the_committed_version_...``."""
    before = fleet.outputs()
    fleet.backends[3].start_weight_update = nothing  # type: ignore[method-assign]
    theirs = fleet.stub(3)
    theirs.StartWeightUpdate(
        pb.StartWeightUpdateRequest(options=pb.WeightUpdateOptions(allow_unpaused=True)),
        timeout=10,
    )
    async with EngineRefitClient(fleet.addresses, store=store) as trainer:
        with pytest.raises(RefitError) as failed:
            await trainer.refit("1", path=str(tiny_weights_dir(1)))
    report = failed.value.report
    assert report.outcomes() == {a: Outcome.UNCHANGED for a in fleet.addresses}
    *others, worker = report.workers
    assert (worker.stage, worker.paused, worker.resumed) == ("pause", False, False)
    assert worker.error == (
        f"{UPDATE_OPEN} (no UpdateWeights round sent yet), another writer's: left to it, not paused"
    )
    assert all(w.paused and w.resumed and w.error is None for w in others)
    states = fleet.states()
    assert [s.paused for s in states] == [False] * 4 and states[3].weight_update_open
    assert [s.weight_changes for s in states] == [0, 0, 0, 1]  # theirs only
    assert fleet.outputs() == before

    async def finished() -> WeightLoad:
        return WeightLoad(0, 0)

    fleet.backends[3].finish_weight_update = finished  # type: ignore[method-assign]
    theirs.FinishWeightUpdate(pb.FinishWeightUpdateRequest(), timeout=10)
    assert not fleet.states()[3].weight_update_open
