"""A bridge's etcd leases, noted by the bridge (bridge.lease_note) and revoked by
its supervisor when it exits (launch.leases), in a real etcd: the records go at
once; the worker's lease is found from its model card when it has no instance
record; leases already gone are no error; an orderly exit, a note of none and a
file that is not a note revoke nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.lease_note import LeaseNote
from harness.cluster import Etcd, etcd_binary
from harness.procs import ProcessGroup
from launch.leases import LEASES_FILE_ENV, Leases, LeasesFile, read, write
from rl_client import etcd_gateway

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (make cluster-deps)"),
]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    with ProcessGroup(tmp_path / "logs") as group:
        yield Etcd.start(group, tmp_path / "etcd")


def call(etcd: Etcd, path: str, body: dict[str, object]) -> dict[str, object]:
    return etcd_gateway.call([etcd.endpoint], path, body, 5)


def put_under_new_lease(etcd: Etcd, key: str) -> int:
    """``key`` written under a fresh 30 s lease, as a Dynamo runtime writes its records."""
    lease = int(str(call(etcd, "lease/grant", {"TTL": "30"})["ID"]))
    value = etcd_gateway.b64(b"{}")
    call(
        etcd, "kv/put", {"key": etcd_gateway.b64(key.encode()), "value": value, "lease": str(lease)}
    )
    return lease


async def test_the_supervisor_revokes_what_the_bridge_noted(etcd: Etcd, tmp_path: Path) -> None:
    """The bridge notes the lease of each record it follows, one written after it
    began to look included; once revoked, etcd holds neither record, and the note is
    gone for the next bridge."""
    supervisor = LeasesFile(tmp_path)
    env = {**supervisor.env(), "ETCD_ENDPOINTS": etcd.endpoint}
    note = LeaseNote.from_env("etcd", env)
    assert note is not None and note.path == supervisor.path
    worker = put_under_new_lease(etcd, "v1/instances/ns/backend/generate/1")
    note.follow("v1/instances/ns/backend/generate/1")
    note.follow("v1/instances/ns/backend_rl/carrier/2")
    await asyncio.sleep(0.5)  # the carrier registers later than the worker
    carrier = put_under_new_lease(etcd, "v1/instances/ns/backend_rl/carrier/2")
    for _ in range(100):
        if (noted := read(supervisor.path)) is not None and len(noted.ids) == 2:
            break
        await asyncio.sleep(0.05)
    assert read(supervisor.path) == Leases((etcd.endpoint,), (worker, carrier))
    await note.stop()

    await supervisor.revoke(-9)
    assert etcd.keys("v1/instances/") == []
    assert not supervisor.path.exists()
    await supervisor.revoke(-9)  # nothing noted: nothing to do


async def test_leases_already_gone_are_no_error(
    etcd: Etcd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lease gone already (expired, or revoked by a bridge that failed as it
    ended): revoking it again warns of nothing."""
    lease = put_under_new_lease(etcd, "v1/instances/ns/backend/generate/1")
    call(etcd, "lease/revoke", {"ID": str(lease)})
    supervisor = LeasesFile(tmp_path)
    write(supervisor.path, Leases((etcd.endpoint,), (lease,)))
    with caplog.at_level(logging.DEBUG, logger="launch.leases"):
        await supervisor.revoke(1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not supervisor.path.exists()


async def test_a_file_that_is_not_a_note_revokes_nothing(
    etcd: Etcd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lease = put_under_new_lease(etcd, "v1/instances/ns/backend/generate/1")
    supervisor = LeasesFile(tmp_path)
    supervisor.path.write_text(f'{{"endpoints": ["{etcd.endpoint}"], "ids": ["not a lease"]}}')
    await supervisor.revoke(1)
    assert "is not a note of leases" in caplog.text
    assert etcd.keys("v1/instances/") == ["v1/instances/ns/backend/generate/1"]
    call(etcd, "lease/revoke", {"ID": str(lease)})


def test_no_note_without_etcd_or_a_supervisor(tmp_path: Path) -> None:
    named = {LEASES_FILE_ENV: str(tmp_path / "leases.json")}
    assert LeaseNote.from_env("file", named) is None
    assert LeaseNote.from_env("etcd", {}) is None
    assert LeaseNote.from_env("etcd", named) is not None


async def test_the_workers_lease_is_found_from_its_model_card(etcd: Etcd, tmp_path: Path) -> None:
    """A worker out of the router's pool from its start (its engine asleep) has no
    instance record: its model card, under the same lease, gives the lease."""
    supervisor = LeasesFile(tmp_path)
    note = LeaseNote.from_env("etcd", {**supervisor.env(), "ETCD_ENDPOINTS": etcd.endpoint})
    assert note is not None
    lease = put_under_new_lease(etcd, "v1/mdc/ns/backend/generate/1")
    note.follow("v1/instances/ns/backend/generate/1", "v1/mdc/ns/backend/generate/1")
    for _ in range(100):
        if note.ids:
            break
        await asyncio.sleep(0.05)
    await note.stop()
    assert read(supervisor.path) == Leases((etcd.endpoint,), (lease,))


async def test_an_orderly_exit_revokes_nothing(etcd: Etcd, tmp_path: Path) -> None:
    """Exit 0: the bridge ended in order and took its records out itself; the
    supervisor only forgets the note."""
    lease = put_under_new_lease(etcd, "v1/instances/ns/backend/generate/1")
    supervisor = LeasesFile(tmp_path)
    write(supervisor.path, Leases((etcd.endpoint,), (lease,)))
    await supervisor.revoke(0)
    assert not supervisor.path.exists()
    assert etcd.keys("v1/instances/") == ["v1/instances/ns/backend/generate/1"]
    call(etcd, "lease/revoke", {"ID": str(lease)})
