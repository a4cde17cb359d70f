"""Issue 31: a fleet refit is all or nothing, with real processes.

Four sim engine servers, each on a "host" of its own: started from its own
folder (``host_root.py``), so the checkpoint path every worker is given,
``/proc/self/cwd/ckpt/<name>``, is each worker's own copy, as on separate
machines. One worker's copy holds an entry no reader may open (a FIFO,
``harness.checkpoints.unreadable_entry``): its update is refused, so the whole
fleet goes back to the committed weights and version, and serves outputs
bit-exact to before. Over the contract (``EngineRefitClient``), with the
committed record in Dynamo's file store and in etcd; and over the RL routes of
four real bridges (``RefitClient``), where a worker that cannot go back either
(its copy of the committed checkpoint unreadable too) is put to sleep and its
bridge leaves the router's pool.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import tiny_weights_dir, unreadable_entry
from harness.cluster import Etcd, etcd_binary
from harness.engine import greedy_rollout, health_status, tokens_and_logprobs
from harness.ports import free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client.committed import (
    CheckpointSource,
    CommittedStore,
    CommittedWeights,
    EtcdCommittedStore,
    FileCommittedStore,
)
from rl_client.refit import EngineRefitClient, RefitClient
from rl_client.refit_report import Deadlines, Outcome, RefitError, RefitReport
from tests.faults.faults_common import prompt, record

pytestmark = [pytest.mark.slow]

MODEL = "tiny-fleet"
NAMESPACE = "nstinyfleet"
WORKERS = 4
SIM_ARGS = ("--eos-rate", "0", "--decode-step-ms", "1")
HOST_ROOT = (str(Path(__file__).parent / "host_root.py"),)
# The same path on every worker, each resolving it on its own host.
CKPT = "/proc/self/cwd/ckpt"
DEADLINES = Deadlines(pause_s=30, update_s=60, rollback_s=60, control_s=30)


@dataclass
class Hosts:
    """Each worker's folder; ``ckpt/<name>`` in it is that worker's copy."""

    folders: list[Path]

    def lay_out(self, name: str, weights: Path) -> str:
        """A copy of ``weights`` on every host as ``ckpt/<name>``; the path to give."""
        for folder in self.folders:
            shutil.copytree(weights, folder / "ckpt" / name)
        return f"{CKPT}/{name}"

    def spoil(self, worker: int, name: str) -> Path:
        return unreadable_entry(self.folders[worker] / "ckpt" / name, "FIFO")


@dataclass
class Fleet:
    hosts: Hosts
    addresses: list[str]
    channels: list[grpc.Channel]

    def outputs(self, workers: int = WORKERS) -> list[tuple[list[int], list[float]]]:
        """The first ``workers`` workers' greedy rollouts: what bit-exact compares."""
        return [
            tokens_and_logprobs(greedy_rollout(pb_grpc.EngineServiceStub(c), prompt(i), 16))
            for i, c in enumerate(self.channels[:workers])
        ]

    def states(self) -> list[pb.RefitState]:
        return [
            pb_grpc.EngineServiceStub(c).GetLoad(pb.GetLoadRequest(), timeout=10).refit_state
            for c in self.channels
        ]


def start_fleet(root: Path, stack: Stack) -> Fleet:
    """Four sim engine servers on the tiny model, each started from its own host."""
    hosts = Hosts([root / f"host-{i}" for i in range(WORKERS)])
    addresses = []
    for i, folder in enumerate(hosts.folders):
        folder.mkdir(parents=True)
        _, address = stack.start_engine(
            f"engine-{i}",
            *SIM_ARGS,
            launcher=HOST_ROOT,
            env={"FLEET_HOST_ROOT": str(folder)},
        )
        addresses.append(address)
    return Fleet(hosts, addresses, [grpc.insecure_channel(a) for a in addresses])


def timings(report: RefitReport) -> dict[str, list[float]]:
    """Each step's seconds, worker by worker, for the record."""
    return {
        stage: [round(getattr(w, f"{stage}_s"), 3) for w in report.workers]
        for stage in ("pause", "update", "label", "rollback", "resume")
    }


@pytest.fixture(params=["file", "etcd"])
def store_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "etcd" and etcd_binary() is None:
        pytest.skip("etcd not installed (make cluster-deps)")
    return str(request.param)


@pytest.fixture
def contract_fleet(
    tmp_path: Path, model_dir: Path, store_kind: str
) -> Iterator[tuple[Fleet, CommittedStore]]:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL, NAMESPACE)
        store: CommittedStore
        if store_kind == "etcd":
            etcd = Etcd.start(group, tmp_path / "etcd")
            store = EtcdCommittedStore([etcd.endpoint], NAMESPACE)
        else:
            store = FileCommittedStore(stack.kv_dir, NAMESPACE)
        fleet = start_fleet(tmp_path, stack)
        try:
            yield fleet, store
        finally:
            for channel in fleet.channels:
                channel.close()


async def test_a_refit_one_worker_cannot_read_leaves_the_fleet_and_its_record_as_before(
    contract_fleet: tuple[Fleet, CommittedStore], model_dir: Path, store_kind: str
) -> None:
    fleet, store = contract_fleet
    a = fleet.hosts.lay_out("a", model_dir)
    b = fleet.hosts.lay_out("b", tiny_weights_dir(1))
    spoilt = fleet.hosts.spoil(2, "b")
    start = fleet.outputs()
    async with EngineRefitClient(fleet.addresses, store=store, deadlines=DEADLINES) as trainer:
        committed = await trainer.refit("a", path=a)
        record_a = store.read()
        assert record_a is not None and record_a.weights == CommittedWeights(
            "a", CheckpointSource(a)
        )
        assert record_a.workers == tuple(fleet.addresses)
        before = fleet.outputs()
        assert before == start  # checkpoint a is the one they started on
        with pytest.raises(RefitError) as failed:
            await trainer.refit("b", path=b)
        report = failed.value.report
        culprit = report.workers[2]
        assert culprit.stage == "update" and spoilt.name in str(culprit.error)
        assert "is a FIFO" in str(culprit.error)
        assert report.outcomes() == {w: Outcome.ROLLED_BACK for w in fleet.addresses}
        assert [s.paused for s in fleet.states()] == [False] * WORKERS
        assert [(s.weight_version, s.weight_version_declared) for s in fleet.states()] == [
            ("a", True)
        ] * WORKERS
        assert fleet.outputs() == before
        assert store.read() == record_a
        # Once every copy is readable the same refit commits everywhere.
        spoilt.unlink()
        done = await trainer.refit("b", path=b)
        after = fleet.outputs()
        assert after != before
        assert [s.weight_version for s in fleet.states()] == ["b"] * WORKERS
        record_b = store.read()
        assert record_b is not None and record_b.weights.version == "b"
    record(
        f"fleet_refit_contract_{store_kind}",
        workers=WORKERS,
        commit_s=round(committed.seconds, 3),
        failed_refit_s=round(report.seconds, 3),
        failed_refit=timings(report),
        commit_b_s=round(done.seconds, 3),
    )


@pytest.mark.dynamo
async def test_over_the_rl_routes_a_worker_that_cannot_go_back_leaves_the_pool(
    tmp_path: Path, model_dir: Path
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL, NAMESPACE)
        fleet = start_fleet(tmp_path, stack)
        urls = []
        for i, address in enumerate(fleet.addresses):
            port = free_system_port()
            stack.start_bridge(f"bridge-{i}", address, "--enable-rl", DYN_SYSTEM_PORT=str(port))
            urls.append(f"http://127.0.0.1:{port}")
        wait_until(
            lambda: stack.registered_workers() == WORKERS,
            120,
            "four workers registered",
            stack.procs,
        )
        a = fleet.hosts.lay_out("a", model_dir)
        b = fleet.hosts.lay_out("b", tiny_weights_dir(1))
        start = CommittedWeights("start", CheckpointSource(str(model_dir)))
        store = FileCommittedStore(stack.kv_dir, NAMESPACE)
        async with RefitClient(urls, committed=start, store=store, deadlines=DEADLINES) as trainer:
            await trainer.refit(a, "a")
            before = fleet.outputs()
            fleet.hosts.spoil(0, "b")  # the refit fails here
            fleet.hosts.spoil(3, "a")  # and this worker cannot go back
            with pytest.raises(RefitError) as failed:
                await trainer.refit(b, "b")
            report = failed.value.report
            assert report.workers[0].stage == "update"
            assert [report.outcomes()[u] for u in urls] == [
                Outcome.ROLLED_BACK,
                Outcome.ROLLED_BACK,
                Outcome.ROLLED_BACK,
                Outcome.REMOVED,
            ]
            removed = report.workers[3]
            assert removed.error is None and "x.safetensors" in str(removed.rollback_error)
            assert not removed.resumed and "removed" in str(failed.value)
            # Its label was never changed (no worker was labelled "b"), but it holds b.
            assert await trainer.versions() == {u: "a" for u in urls}
            # Asleep, NOT_SERVING, and its bridge left the router's pool.
            assert health_status(fleet.addresses[3]) == health_pb2.HealthCheckResponse.NOT_SERVING
            wait_until(
                lambda: stack.registered_workers() == WORKERS - 1,
                10,
                "the worker that could not go back left the pool",
                stack.procs,
            )
            states = fleet.states()
            assert states[3].sleeping
            assert [s.paused for s in states[:3]] == [False] * 3
            assert fleet.outputs(3) == before[:3]
            record_a = store.read()
            assert record_a is not None and record_a.weights.version == "a"
        for channel in fleet.channels:
            channel.close()
    record(
        "fleet_refit_routes",
        workers=WORKERS,
        failed_refit_s=round(report.seconds, 3),
        failed_refit=timings(report),
    )
