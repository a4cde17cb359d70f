"""The ``rl`` endpoint's record under the worker's instance id, in Dynamo's file
store (etcd: tests/cluster/test_cluster_nemo_rl_replay.py, and the real runtime's
records in tests/e2e/test_e2e_refit.py)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from bridge.admin import instance_alias
from bridge.admin.instance_alias import (
    FileAliasStore,
    InstanceAlias,
    alias_store,
    aliased,
    file_name,
)

CARRIER = {
    "type": "Endpoint",
    "component": "backend_rl",
    "endpoint": "carrier",
    "namespace": "ns-1",
    "instance_id": 0xABC,
    "transport": {"tcp": "127.0.0.1:4000/abc/ns-1/backend_rl/carrier"},
    "request_plane_codec": "msgpack",
}


def test_file_names_are_dynamos() -> None:
    # As Dynamo 1.6.1 named a carrier's record on disk.
    assert file_name("probe/backend_rl_relay/rl/121b387eb56923fd") == (
        "probe%2Fbackend%5Frl%5Frelay%2Frl%2F121b387eb56923fd"
    )
    assert file_name("nemo-rl/backend/rl/ff") == "nemo%2Drl%2Fbackend%2Frl%2Fff"


def test_the_alias_keeps_the_transport_and_takes_the_worker_id() -> None:
    """The carrier's path stays in the transport (its server answers there); the
    record says ``rl`` so that a frontend listing rl endpoints finds the worker,
    and only the worker: the carrier's own record is not an ``rl`` endpoint."""
    alias = aliased(CARRIER, "backend", 0x123)
    assert alias == {**CARRIER, "component": "backend", "endpoint": "rl", "instance_id": 0x123}
    assert instance_alias.CARRIER_ENDPOINT != "rl"
    with pytest.raises(ValueError, match="not a Dynamo instance record"):
        aliased({"instance_id": "x"}, "backend", 1)


def test_only_etcd_and_file_discovery_are_written(tmp_path: Path) -> None:
    assert isinstance(alias_store("file", {"DYN_FILE_KV": str(tmp_path)}), FileAliasStore)
    with pytest.raises(ValueError, match="'mem'"):
        alias_store("mem", {})


async def test_published_renewed_restored_and_withdrawn_in_the_file_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(instance_alias, "RENEW_EVERY_S", 0.05)
    folder = tmp_path / "v1" / "instances"
    folder.mkdir(parents=True)
    store = FileAliasStore(tmp_path)
    alias = InstanceAlias(
        store,
        namespace="ns-1",
        component="backend",
        endpoint="rl",
        worker_id=0x123,
        carrier_id=0xABC,
    )
    publishing = asyncio.create_task(alias.publish(timeout_s=5))
    await asyncio.sleep(0.2)
    assert not publishing.done()  # waits for the carrier's own record
    (folder / file_name("ns-1/backend_rl/carrier/abc")).write_text(json.dumps(CARRIER))
    await publishing
    path = folder / file_name("ns-1/backend/rl/123")
    assert json.loads(path.read_text()) == aliased(CARRIER, "backend", 0x123)
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temp left

    os.utime(path, (0, 0))
    await asyncio.sleep(0.2)
    assert path.stat().st_mtime > 1  # renewed, as Dynamo renews its own
    path.unlink()
    await asyncio.sleep(0.2)
    assert path.exists()  # put back from the carrier's record

    await alias.withdraw()
    assert not path.exists()
    await alias.withdraw()  # twice is harmless


async def test_a_carrier_that_never_registers_times_out(tmp_path: Path) -> None:
    alias = InstanceAlias(
        FileAliasStore(tmp_path),
        namespace="ns",
        component="backend",
        endpoint="rl",
        worker_id=1,
        carrier_id=2,
    )
    with pytest.raises(TimeoutError, match="never registered"):
        await alias.publish(timeout_s=0.2)
