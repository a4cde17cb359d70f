"""The fleet's workers listed from etcd (``rl_client.fleet_discovery``) as real
bridges register in it: a worker is listed while its instance key is there, with
its admin URL and engine address; a bridge that stops is not."""

from __future__ import annotations

import signal
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


def test_a_bridge_asked_to_end_stays_out_of_etcd_while_it_drains(
    tmp_path: Path, model_dir: Path
) -> None:
    """SIGTERM: Dynamo's worker deletes the instance key, then serves on through its
    grace period (5 s) and drain; the bridge's keeper once registered it again
    within half a second, and the router sent new requests to a worker on its way out."""
    with ProcessGroup(tmp_path / "logs") as group:
        etcd = Etcd.start(group, tmp_path / "etcd")
        stack = Stack.new(tmp_path, group, model_dir, "tiny-drain", NAMESPACE, etcd=etcd)
        _, address = stack.start_engine("engine", "--decode-step-ms", "2")
        bridge = stack.start_bridge("bridge", address, DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS="5")
        wait_until(lambda: stack.registered_workers() == 1, 60, "the worker registered", [bridge])
        time.sleep(1.0)  # the keeper's watch running (it polls every 0.5 s)
        bridge.signal(signal.SIGTERM)
        wait_until(lambda: stack.registered_workers() == 0, 5, "the worker out of etcd", [])
        counts: list[int] = []
        while bridge.alive():
            counts.append(stack.registered_workers())
            time.sleep(0.1)
        assert bridge.wait_exit(30) == 0
        assert len(counts) > 30, "the bridge exited before its grace period ended"
        assert set(counts) == {0}, counts
