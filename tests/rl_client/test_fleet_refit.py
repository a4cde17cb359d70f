"""A fleet refit is all or nothing: four sim engine servers in this process (real
gRPC), each able to refuse a load, fail one part way or take its time, driven by
``EngineRefitClient``. A failed refit leaves every worker on the committed weights
and version, serving outputs bit-exact to before; a worker that cannot be brought
back leaves the router's pool (health NOT_SERVING); the committed record in the
store moves only with a committed refit. The choreography's rarer branches (a
worker that can be neither brought back nor put to sleep, what is known before
any call) run on a scripted fleet."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2

from engine_contract.tensors import Tensor
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.refit import TensorSpec, WeightLoad, WeightUpdateError, WeightWriter
from engine_server.backends.sim import SimBackend
from engine_server.config import ServerConfig
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import InProcessServer, greedy_rollout, health_status, tokens_and_logprobs
from rl_client.committed import (
    CheckpointSource,
    CommittedRecord,
    CommittedWeights,
    FileCommittedStore,
    PushedSource,
    Unread,
    WeightSource,
)
from rl_client.fleet_cycle import FleetCycle, RollbackTarget
from rl_client.refit import EngineRefitClient, RefitClient
from rl_client.refit_report import Deadlines, Outcome, RefitError, Served, WorkerHealth

PROMPT = [(i * 37) % 800 + 5 for i in range(24)]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Faulty(SimBackend):
    """The sim with the faults a fleet refit must survive, keyed by the checkpoint
    folder (as the engine server hands it over: resolved)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model=str(model_dir), zero_delay=True, eos_rate=0.0)
        self.refused: set[str] = set()  # refused: nothing loaded
        self.breaks: set[str] = set()  # fails part way: the weights unknown
        self.slow: dict[str, float] = {}  # takes this long before loading
        self.refuse_streams = 0  # how many streamed updates to refuse

    async def load_weights_from_path(self, path: str, *, allow_partial: bool) -> WeightLoad:
        await asyncio.sleep(self.slow.get(path, 0.0))
        if path in self.refused:
            raise WeightUpdateError(f"{path}: refused by the test")
        if path in self.breaks:
            raise OSError(5, "Input/output error (the test's)")
        return await super().load_weights_from_path(path, allow_partial=allow_partial)

    async def begin_tensor_update(
        self, tensors: Sequence[TensorSpec], *, allow_partial: bool
    ) -> WeightWriter:
        if self.refuse_streams:
            self.refuse_streams -= 1
            raise WeightUpdateError("streamed tensors refused by the test")
        return await super().begin_tensor_update(tensors, allow_partial=allow_partial)


@dataclass
class Fleet:
    servers: list[InProcessServer]
    backends: list[Faulty]
    channels: list[grpc.Channel]

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def stub(self, i: int) -> pb_grpc.EngineServiceStub:
        return pb_grpc.EngineServiceStub(self.channels[i])

    def outputs(self) -> list[tuple[list[int], list[float]]]:
        """Each worker's greedy rollout of one prompt: what bit-exact compares."""
        return [
            tokens_and_logprobs(greedy_rollout(self.stub(i), PROMPT, 12, timeout=30))
            for i in range(len(self.servers))
        ]

    def states(self) -> list[pb.RefitState]:
        return [
            self.stub(i).GetLoad(pb.GetLoadRequest(), timeout=10).refit_state
            for i in range(len(self.servers))
        ]

    def versions(self) -> list[tuple[str, bool]]:
        return [(s.weight_version, s.weight_version_declared) for s in self.states()]


@contextmanager
def serving(backends: Sequence[Faulty]) -> Iterator[Fleet]:
    """A fleet of one in-process engine server per backend and a channel to each;
    the channels closed and the servers stopped when the block ends."""
    servers = [InProcessServer(b, ServerConfig(listen="127.0.0.1:0")).start() for b in backends]
    channels = [grpc.insecure_channel(s.address) for s in servers]
    try:
        yield Fleet(servers, list(backends), channels)
    finally:
        for channel in channels:
            channel.close()
        for server in servers:
            server.stop()


@pytest.fixture
def fleet(model_dir: Path) -> Iterator[Fleet]:
    with serving([Faulty(model_dir) for _ in range(4)]) as served:
        yield served


@pytest_asyncio.fixture
async def trainer(fleet: Fleet) -> AsyncIterator[EngineRefitClient]:
    async with EngineRefitClient(fleet.addresses) as client:
        yield client


def real(path: Path) -> str:
    return os.path.realpath(path)


def assert_back_on(fleet: Fleet, outputs: object, version: tuple[str, bool]) -> None:
    """Every worker resumed, under ``version``, serving exactly ``outputs``."""
    states = fleet.states()
    assert [s.paused for s in states] == [False] * 4
    assert fleet.versions() == [version] * 4
    assert fleet.outputs() == outputs


async def test_a_refit_that_fails_on_one_worker_leaves_every_worker_as_before(
    fleet: Fleet, trainer: EngineRefitClient
) -> None:
    before = fleet.outputs()
    new = tiny_weights_dir(1)
    fleet.backends[2].refused.add(real(new))
    with pytest.raises(RefitError) as failed:
        await trainer.refit("1", path=str(new))
    report = failed.value.report
    assert not report.committed and report.previous == "default"
    assert report.outcomes() == {a: Outcome.ROLLED_BACK for a in fleet.addresses}
    (culprit,) = report.failed
    assert culprit.worker == fleet.addresses[2] and culprit.stage == "update"
    assert "refused by the test" in str(culprit.error) and "refused by the test" in str(
        failed.value
    )
    # The others had loaded the new weights: each was sent the start checkpoint again.
    assert all(w.rollback_s > 0 and w.resumed for w in report.workers)
    assert_back_on(fleet, before, ("default", False))
    # Then the same refit commits everywhere once nobody refuses.
    fleet.backends[2].refused.clear()
    report = await trainer.refit("1", path=str(new))
    assert report.ok and report.outcomes() == {a: Outcome.UPDATED for a in fleet.addresses}
    assert fleet.versions() == [("1", True)] * 4
    after = fleet.outputs()
    assert after != before and len({str(o) for o in after}) == 1


async def test_streamed_weights_roll_back_by_sending_the_previous_tensors_again(
    fleet: Fleet, trainer: EngineRefitClient
) -> None:
    first = checkpoint_tensors(tiny_weights_dir(1))
    await trainer.refit("1", tensors=first)
    before = fleet.outputs()
    fleet.backends[0].refuse_streams = 1
    with pytest.raises(RefitError) as failed:
        await trainer.refit("2", tensors=checkpoint_tensors(tiny_weights_dir(2)))
    report = failed.value.report
    assert report.previous == "1" and report.failed[0].worker == fleet.addresses[0]
    assert report.outcomes() == {a: Outcome.ROLLED_BACK for a in fleet.addresses}
    assert trainer.committed is not None and trainer.committed.version == "1"
    assert isinstance(trainer.committed.source, PushedSource)
    assert trainer.committed.source.tensors is first
    assert_back_on(fleet, before, ("1", True))


async def test_a_worker_that_does_not_answer_within_its_deadline_fails_the_refit(
    fleet: Fleet,
) -> None:
    before = fleet.outputs()
    new = tiny_weights_dir(1)
    fleet.backends[3].slow[real(new)] = 1.5
    deadlines = Deadlines(update_s=0.3, rollback_s=10)
    async with EngineRefitClient(fleet.addresses, deadlines=deadlines) as trainer:
        with pytest.raises(RefitError) as failed:
            await trainer.refit("1", path=str(new))
    report = failed.value.report
    slow = report.workers[3]
    assert slow.stage == "update"
    assert slow.error == "did not answer within its update deadline of 0.3 s"
    assert 0.3 <= slow.update_s < 1.0
    # Its engine went on loading; the rollback ran after it, under the refit lock.
    assert slow.rollback_s >= 1.0
    assert report.outcomes() == {a: Outcome.ROLLED_BACK for a in fleet.addresses}
    assert_back_on(fleet, before, ("default", False))


async def test_a_worker_that_cannot_be_rolled_back_leaves_the_pool(
    fleet: Fleet, trainer: EngineRefitClient
) -> None:
    a, b = tiny_weights_dir(1), tiny_weights_dir(2)
    await trainer.refit("a", path=str(a))
    before = fleet.outputs()
    fleet.backends[0].refused.add(real(b))  # the refit fails here
    fleet.backends[1].refused.add(real(a))  # going back is refused: it holds b
    fleet.backends[2].breaks.add(real(a))  # going back fails part way: weights unknown
    with pytest.raises(RefitError) as failed:
        await trainer.refit("b", path=str(b))
    report = failed.value.report
    outcomes = report.outcomes()
    addresses = fleet.addresses
    assert [outcomes[w] for w in addresses] == [
        Outcome.ROLLED_BACK,
        Outcome.REMOVED,
        Outcome.REMOVED,
        Outcome.ROLLED_BACK,
    ]
    refused, broken = report.workers[1], report.workers[2]
    assert refused.error is None and broken.error is None  # their updates succeeded
    assert "refused by the test" in str(refused.rollback_error)
    assert "weights are unknown" in str(broken.rollback_error)
    assert not refused.resumed and not broken.resumed and refused.version is None
    assert "removed" in str(failed.value)
    # Out of the pool: the bridge follows NOT_SERVING. One was put to sleep (it
    # serves b), the other says its weights are unknown by itself.
    assert health_status(addresses[1]) == NOT_SERVING
    assert health_status(addresses[2]) == NOT_SERVING
    states = fleet.states()
    assert states[1].sleeping and states[1].paused and not states[2].sleeping
    # The rest serve exactly what they served before.
    for i in (0, 3):
        assert health_status(addresses[i]) == SERVING
        assert not states[i].paused and states[i].weight_version == "a"
        got = tokens_and_logprobs(greedy_rollout(fleet.stub(i), PROMPT, 12, timeout=30))
        assert got == before[i]


async def test_the_committed_record_moves_only_with_a_committed_refit(
    fleet: Fleet, tmp_path: Path
) -> None:
    store = FileCommittedStore(tmp_path / "kv", "ns", "backend")
    new, other = tiny_weights_dir(1), tiny_weights_dir(2)
    async with EngineRefitClient(fleet.addresses, store=store) as trainer:
        assert store.read() is None
        await trainer.refit("1", path=str(new))
        record = store.read()
        assert record is not None and record.workers == tuple(fleet.addresses)
        assert record.weights == CommittedWeights("1", CheckpointSource(str(new)))
        raw = store.path.read_bytes()
        fleet.backends[1].refused.add(real(other))
        with pytest.raises(RefitError):
            await trainer.refit("2", path=str(other))
        assert store.path.read_bytes() == raw
    # A fresh trainer rolls back to what the record says.
    fleet.backends[3].refuse_streams = 1
    before = fleet.outputs()
    async with EngineRefitClient(fleet.addresses, store=store) as fresh:
        with pytest.raises(RefitError) as failed:
            await fresh.refit("2", tensors=checkpoint_tensors(other))
    assert failed.value.report.previous == "1"
    assert_back_on(fleet, before, ("1", True))


class BrokenStore(FileCommittedStore):
    """Writes the first record, then says it failed (a reply lost after the write)."""

    def swap(self, expected: bytes | Unread | None, new: bytes | None) -> None:
        super().swap(expected, new)
        if new is not None and expected is None:
            raise ConnectionError("etcd: the reply was lost")


async def test_a_record_that_cannot_be_written_fails_the_refit(
    fleet: Fleet, tmp_path: Path
) -> None:
    store = BrokenStore(tmp_path / "kv", "ns")
    before = fleet.outputs()
    async with EngineRefitClient(fleet.addresses, store=store) as trainer:
        with pytest.raises(RefitError) as failed:
            await trainer.refit("1", path=str(tiny_weights_dir(1)))
    report = failed.value.report
    assert report.publish_error == "etcd: the reply was lost"
    assert report.outcomes() == {a: Outcome.ROLLED_BACK for a in fleet.addresses}
    assert store.read() is None  # what was there before: nothing
    # Labelled before the publish, so labelled back: the start label, now declared.
    assert_back_on(fleet, before, ("default", True))


# -- the choreography on a scripted fleet ------------------------------------------


class Scripted(FleetCycle):
    """Workers as scripted coroutines: each step's behaviour by (worker, step)."""

    def __init__(self, workers: list[str], deadlines: Deadlines) -> None:
        super().__init__(None, None, deadlines)
        self.workers = workers
        self.hang: set[tuple[str, str]] = set()
        self.fail: set[tuple[str, str]] = set()
        self.healths: dict[str, WorkerHealth] = {}
        self.calls: list[tuple[str, str]] = []

    async def _step(self, worker: str, step: str) -> None:
        self.calls.append((worker, step))
        if (worker, step) in self.hang:
            await asyncio.Event().wait()
        if (worker, step) in self.fail:
            raise RuntimeError(f"{step} failed on {worker}")

    def _fleet(self) -> list[str]:
        return self.workers

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        await self._step(worker, "pause")

    async def _resume(self, worker: str) -> None:
        await self._step(worker, "resume")

    async def _load(self, worker: str, source: WeightSource, expect: int | None) -> None:
        assert isinstance(source, CheckpointSource)
        await self._step(worker, "rollback" if source.path == "/old" else "update")

    async def _label(self, worker: str, version: str, expect: int | None) -> None:
        await self._step(worker, "label")

    async def _serving(self, worker: str) -> Served:
        return Served("?")

    async def _health(self, worker: str) -> WorkerHealth:
        await self._step(worker, "health")
        return self.healths.get(worker, WorkerHealth.SERVING)

    async def _sleep(self, worker: str) -> None:
        await self._step(worker, "sleep")

    def _loads(self, source: WeightSource) -> bool:
        return isinstance(source, CheckpointSource)

    async def _start_state(self) -> dict[str, RollbackTarget]:
        return {w: RollbackTarget("old", CheckpointSource("/old")) for w in self.workers}

    async def refit(self) -> None:
        await self._run("new", CheckpointSource("/new"), "wait", True)


async def test_a_worker_neither_brought_back_nor_put_to_sleep_is_reported_and_stays_paused() -> (
    None
):
    fleet = Scripted(["w0", "w1", "w2"], deadlines=Deadlines(rollback_s=0.05, control_s=0.05))
    fleet.fail.add(("w0", "update"))
    fleet.hang |= {("w1", "rollback"), ("w1", "sleep")}
    fleet.fail.add(("w2", "rollback"))
    fleet.healths["w2"] = WorkerHealth.UNREACHABLE
    with pytest.raises(RefitError) as failed:
        await fleet.refit()
    report = failed.value.report
    assert report.outcomes() == {
        "w0": Outcome.ROLLED_BACK,
        "w1": Outcome.ROLLBACK_FAILED,
        "w2": Outcome.REMOVED,
    }
    w1 = report.workers[1]
    assert w1.rollback_error == (
        "did not answer within its rollback deadline of 0.05 s; "
        "taking it out failed: did not go to sleep within 0.05 s"
    )
    assert "out of the pool (unreachable)" in str(report.workers[2].rollback_error)
    # Only the worker that went back resumes; no label was set anywhere.
    assert [w for w, step in fleet.calls if step == "resume"] == ["w0"]
    assert not any(step == "label" for _, step in fleet.calls)
    assert "failed to roll back" in str(failed.value)


async def test_a_failed_pause_sends_no_weights_and_resumes_every_worker() -> None:
    fleet = Scripted(["w0", "w1"], deadlines=Deadlines(pause_s=0.05))
    fleet.hang.add(("w1", "pause"))
    with pytest.raises(RefitError) as failed:
        await fleet.refit()
    report = failed.value.report
    assert report.outcomes() == {"w0": Outcome.UNCHANGED, "w1": Outcome.UNCHANGED}
    assert report.workers[1].error == "did not answer within its pause deadline of 0.05 s"
    assert {step for _, step in fleet.calls} == {"pause", "resume"}
    assert all(w.resumed and w.version == "old" for w in report.workers)


async def test_a_refit_that_could_not_be_undone_is_refused_before_any_call(
    fleet: Fleet, trainer: EngineRefitClient
) -> None:
    # The routes cannot tell which checkpoint a worker started on.
    async with RefitClient(["http://127.0.0.1:9"]) as routes:
        with pytest.raises(ValueError, match="committed="):
            await routes.refit("/ckpt", "1")
    # A version set by someone else: this client does not know those weights.
    fleet.stub(1).UpdateWeightVersion(pb.UpdateWeightVersionRequest(weight_version="x"))
    with pytest.raises(ValueError, match="serves version 'x' set by a refit"):
        await trainer.refit("1", path=str(tiny_weights_dir(1)))
    # Pushed weights known only from a record cannot be sent again.
    pushed = CommittedWeights("x", PushedSource())
    async with EngineRefitClient(fleet.addresses, committed=pushed) as blind:
        with pytest.raises(ValueError, match="cannot load again"):
            await blind.refit("1", path=str(tiny_weights_dir(1)))
    assert [s.paused for s in fleet.states()] == [False] * 4
    with pytest.raises(ValueError, match="printable"):
        await trainer.refit("bad\nlabel", path=str(tiny_weights_dir(1)))


def test_the_record_reads_back_and_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    store = FileCommittedStore(tmp_path, "ns", "backend")
    assert store.path == tmp_path / "v1" / "rl_weights" / "ns%2Fbackend"
    for weights in (
        CommittedWeights("7", CheckpointSource("/ckpt/step-7")),
        CommittedWeights("8", PushedSource([Tensor("w", "uint8", (1,), b"\0")])),
    ):
        record = CommittedRecord.now(weights, ["a", "b"])
        store.publish(record)
        back = store.read()
        assert back is not None and back.weights == weights and back.workers == ("a", "b")
    assert [p.name for p in store.path.parent.iterdir()] == ["ns%2Fbackend"]  # no temp file
    store.path.write_bytes(b'{"schema": 2, "version": "9"}')
    with pytest.raises(ValueError, match="schema 2"):
        store.read()
    store.delete()
    assert store.read() is None
    with pytest.raises(ValueError, match="without '/'"):
        FileCommittedStore(tmp_path, "a/b")
