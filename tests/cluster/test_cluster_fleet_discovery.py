"""The fleet's workers listed from etcd (``rl_client.fleet_discovery``) as real
bridges register in it: a worker is listed while its instance key is there, with
its admin URL and engine address; a bridge that stops is not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.cluster import Etcd, etcd_binary
from harness.http import http_json
from harness.ports import free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client.fleet_discovery import EtcdFleetDiscovery, fleet_discovery

pytestmark = [
    pytest.mark.dynamo,
    pytest.mark.cluster,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (make cluster-deps)"),
]

NAMESPACE = "fleetetcd"


def test_etcd_lists_the_registered_bridges_and_drops_a_stopped_one(
    tmp_path: Path, model_dir: Path
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        etcd = Etcd.start(group, tmp_path / "etcd")
        stack = Stack.new(tmp_path, group, model_dir, "tiny-fleet", NAMESPACE, etcd=etcd)
        ports = [free_system_port(), free_system_port()]
        addresses = []
        for i, port in enumerate(ports):
            _, address = stack.start_engine(f"engine-{i}", "--decode-step-ms", "2")
            stack.start_bridge(f"bridge-{i}", address, DYN_SYSTEM_PORT=str(port))
            addresses.append(address)
        reader = fleet_discovery(NAMESPACE, env=stack.env)
        assert isinstance(reader, EtcdFleetDiscovery)
        workers = wait_until(
            lambda: found if len(found := reader.workers()) == 2 else None,
            60,
            "two workers listed",
            stack.procs,
        )
        assert sorted(w.engine_address or "" for w in workers) == sorted(addresses)
        assert sorted(w.admin_url or "" for w in workers) == sorted(
            f"http://127.0.0.1:{p}" for p in ports
        )
        assert {w.model for w in workers} == {"tiny-fleet"}
        # The admin URL is the worker's system port: its RL routes answer there.
        for worker in workers:
            status, body = http_json(f"{worker.admin_url}/engine/get_weight_version", {})
            assert status == 200 and body["status"] == "ok", body
        stopped = time.monotonic()
        stack.bridges[0].stop()
        alive = [p for p in stack.procs if p.alive()]
        wait_until(lambda: len(reader.workers()) == 1, 30, "one worker listed", alive)
        took = time.monotonic() - stopped
        print(f"\n[cluster] a stopped bridge left the listing after {took:.2f}s")
        (left,) = reader.workers()
        assert left.engine_address == addresses[1]
