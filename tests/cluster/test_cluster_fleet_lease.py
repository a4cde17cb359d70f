"""The fleet's lease and the record's compare-and-set in a real etcd (cluster
mode): a second writer refused at once naming the holder, a dead holder's lease
gone with its etcd lease, the record replaced only while it holds what its
writer read, and two trainers with one etcd store never breaking a fleet."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.config import ServerConfig
from harness.checkpoints import tiny_weights_dir
from harness.cluster import Etcd, etcd_binary
from harness.engine import InProcessServer
from harness.procs import ProcessGroup
from rl_client.committed import (
    UNREAD,
    CheckpointSource,
    CommittedRecord,
    CommittedWeights,
    EtcdCommittedStore,
    RecordChanged,
)
from rl_client.fleet_lease import LeaseHeld, LeaseLost
from rl_client.refit import EngineRefitClient
from tests.rl_client.test_fleet_refit import Faulty

pytestmark = [
    pytest.mark.serial,
    pytest.mark.cluster,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (make cluster-deps)"),
]


@pytest.fixture
def etcd_store(tmp_path: Path) -> Iterator[EtcdCommittedStore]:
    with ProcessGroup(tmp_path / "logs") as group:
        etcd = Etcd.start(group, tmp_path / "etcd")
        yield EtcdCommittedStore([etcd.endpoint], "ns")


def test_the_etcd_lease_refuses_a_second_writer_and_expires_with_its_holder(
    etcd_store: EtcdCommittedStore,
) -> None:
    first, second = etcd_store.lease(), etcd_store.lease()
    token = first.acquire("trainer A", 2)
    started = time.monotonic()
    with pytest.raises(LeaseHeld, match=r"held by trainer A \(its lease runs out in"):
        second.acquire("trainer B", 2)
    assert time.monotonic() - started < 1.0
    first.renew(token, 2)
    with pytest.raises(LeaseLost):
        second.renew(token, 2)  # not a lease this client holds
    first.release(token)
    token_b = second.acquire("trainer B", 2)
    # B dies (never renews): its etcd lease expires, and the key with it.
    deadline = time.monotonic() + 10
    while True:
        try:
            first.release(first.acquire("trainer A", 2))
            break
        except LeaseHeld:
            assert time.monotonic() < deadline, "the dead holder's lease never expired"
            time.sleep(0.5)
    with pytest.raises(LeaseLost):
        second.renew(token_b, 2)


def test_the_etcd_record_is_a_compare_and_set(etcd_store: EtcdCommittedStore) -> None:
    one = CommittedRecord(CommittedWeights("1", CheckpointSource("/c/1"))).to_json()
    two = CommittedRecord(CommittedWeights("2", CheckpointSource("/c/2"))).to_json()
    etcd_store.swap(None, one)
    with pytest.raises(RecordChanged, match="another writer published meanwhile"):
        etcd_store.swap(None, two)  # expected none: there is one
    with pytest.raises(RecordChanged):
        etcd_store.swap(two, None)
    etcd_store.swap(one, two)
    assert etcd_store.read_raw() == two
    etcd_store.swap(UNREAD, one)  # a trainer given committed= writes over anything
    etcd_store.swap(one, None)
    assert etcd_store.read() is None


async def test_two_trainers_with_one_etcd_store_never_break_a_fleet(
    etcd_store: EtcdCommittedStore, model_dir: Path
) -> None:
    backends = [Faulty(model_dir) for _ in range(2)]
    servers = [InProcessServer(b, ServerConfig(listen="127.0.0.1:0")).start() for b in backends]
    addresses = [s.address for s in servers]
    etcd_store.publish(
        CommittedRecord(CommittedWeights("0", CheckpointSource(str(tiny_weights_dir(0)))))
    )
    rng = random.Random(7)
    try:
        for i in range(10):
            committed: list[tuple[float, str]] = []
            refused: list[str] = []

            async def refit(
                who: str,
                i: int = i,
                committed: list[tuple[float, str]] = committed,
                refused: list[str] = refused,
            ) -> None:
                await asyncio.sleep(rng.uniform(0, 0.01))
                async with EngineRefitClient(addresses, store=etcd_store) as trainer:
                    try:
                        version = f"{who}{i}"
                        await trainer.refit(version, path=str(tiny_weights_dir(1 + i % 3)))
                        committed.append((time.monotonic(), version))
                    except LeaseHeld as e:
                        refused.append(str(e))

            await asyncio.gather(refit("A"), refit("B"))
            assert committed and len(committed) + len(refused) == 2
            record = etcd_store.read()
            assert record is not None and record.weights.version == max(committed)[1]
            for address in addresses:
                with grpc.insecure_channel(address) as channel:
                    state = (
                        pb_grpc.EngineServiceStub(channel)
                        .GetLoad(pb.GetLoadRequest(), timeout=10)
                        .refit_state
                    )
                assert (state.weight_version, state.paused) == (record.weights.version, False)
    finally:
        for server in servers:
            server.stop()
