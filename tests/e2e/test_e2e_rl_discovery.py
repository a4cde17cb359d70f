"""RL worker discovery through Dynamo's real frontend (issue 39 #3).

A frontend run with ``DYN_ENABLE_RL`` (and ``DYN_RL_PORT``) serves ``GET
/v1/rl/workers``: every discovered ``rl`` endpoint of its namespace, each asked
``{"method": "routes"}`` over the request plane, with the model its instance
serves. Two sim workers (engine server + bridge ``--enable-rl``) behind one
frontend: each is listed once with its system URL, world size, model and the
routes of all three spellings, and a trainer that finds them there drives them
(Prime-RL's sequence, in the sidecar's spelling; vLLM's and dynamo.vllm's read
back the same state). What Dynamo does with a worker that sleeps (out of the
router's pool, its ``rl`` endpoint still there: still listed) and one whose
bridge is killed (listed with an error until the store's TTL expires its
records, then gone) is measured, not assumed. The last test kills a bridge.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.http import http_json
from harness.ports import free_port, free_system_port
from harness.prime_rl import PRIME_RL_ROUTES
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-rl-discovery"
SIM_ARGS = ("--decode-step-ms", "2")
DYNAMO_VLLM_ROUTES = {"pause_generation", "update_weights_from_disk", "control/sleep"}
VLLM_ROUTES = {"/pause", "/resume", "/is_paused", "/update_weight_version", "/get_world_size"}


@dataclass
class Fleet:
    stack: Stack
    workers_url: str  # the frontend's /v1/rl/workers
    admins: list[str]  # each bridge's system URL, in start order
    bridges: list[Proc]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("rl-discovery")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        admins, bridges = [], []
        for i in range(2):
            _, address = stack.start_engine(f"engine-{i}", *SIM_ARGS, "--seed", str(i))
            port = free_system_port()
            bridges.append(
                stack.start_bridge(f"bridge-{i}", address, "--enable-rl", DYN_SYSTEM_PORT=str(port))
            )
            admins.append(f"http://127.0.0.1:{port}")
        rl_port = free_port()
        # The frontend lists the rl endpoints of DYN_NAMESPACE (default "dynamo").
        env = {
            **stack.env,
            "DYN_ENABLE_RL": "1",
            "DYN_RL_PORT": str(rl_port),
            "DYN_NAMESPACE": stack.namespace,
        }
        stack.frontend, stack.base_url = group.frontend("frontend", env)
        stack.wait_serving(workers=2, timeout=90)
        fleet = Fleet(stack, f"http://127.0.0.1:{rl_port}/v1/rl/workers", admins, bridges)
        wait_until(lambda: len(healthy(fleet)) == 2, 30, "both workers listed", stack.procs)
        yield fleet


def listing(fleet: Fleet) -> dict[str, Any]:
    status, body = http_json(fleet.workers_url, timeout=60)
    assert status == 200, body
    return dict(body)


def healthy(fleet: Fleet) -> dict[str, dict[str, Any]]:
    """The listed workers that answered, by system URL."""
    return {w["system_url"]: w for w in listing(fleet)["workers"] if "error" not in w}


def generate_ids(fleet: Fleet) -> set[int]:
    """The workers' instance ids in the router's pool (file discovery's records)."""
    instances = fleet.stack.kv_dir / "v1" / "instances"
    marker = "%2Fgenerate%2F"
    return {
        int(p.name.split(marker)[1], 16)
        for p in instances.rglob("*")
        if p.is_file() and p.name.startswith(f"{fleet.stack.namespace}%2F") and marker in p.name
    }


def post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    status, answer = http_json(url, body if body is not None else {})
    assert status == 200 and answer.get("status") != "error", (url, status, answer)
    return dict(answer)


def test_every_worker_is_listed_once_with_its_admin_surface(fleet: Fleet) -> None:
    body = listing(fleet)
    assert body["protocol_version"] == 1 and body["namespace"] == fleet.stack.namespace
    workers = body["workers"]
    assert sorted(w["system_url"] for w in workers) == sorted(fleet.admins)
    for worker in workers:
        assert "error" not in worker, worker
        assert worker["component"] == "backend" and worker["endpoint"] == "rl"
        assert worker["model"] == MODEL and worker["world_size"] == 1
        assert worker["request_plane_url"] == f"dyn://{fleet.stack.namespace}.backend.rl"
        routes = set(worker["routes"])
        assert PRIME_RL_ROUTES | DYNAMO_VLLM_ROUTES | VLLM_ROUTES <= routes, routes
    # One instance id per worker for generate and rl (dynamo.vllm's; NeMo RL's rule).
    assert {w["instance_id"] for w in workers} == generate_ids(fleet)


def test_a_trainer_drives_what_it_found_in_every_spelling(fleet: Fleet) -> None:
    """Prime-RL's refit sequence on every listed worker (the sidecar's spelling),
    read back in vLLM's and dynamo.vllm's; then a completion through the frontend."""
    urls = sorted(healthy(fleet))
    for url in urls:
        answer = post(
            f"{url}/engine/control/pause_generation", {"mode": "keep", "clear_cache": False}
        )
        assert answer == {"status": "paused"}
        assert post(f"{url}/engine/control/is_paused") == {"is_paused": True}
        assert post(f"{url}/engine/update/update_weight_version", {"new_version": "3"}) == {
            "success": True,
            "new_version": "3",
        }
        assert post(f"{url}/engine/control/get_weight_version") == {"weight_version": "3"}
        assert http_json(f"{url}/weight_info") == (200, {"weight_version": "3"})
        assert post(f"{url}/engine/get_weight_version")["version"] == "3"
        assert post(f"{url}/engine/control/resume_generation") == {"status": "resumed"}
        assert http_json(f"{url}/is_paused") == (200, {"is_paused": False})
    status, body = http_json(
        f"{fleet.stack.base_url}/v1/completions",
        {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4},
    )
    assert status == 200 and body["choices"], body


def test_a_sleeping_worker_leaves_the_pool_and_stays_listed(fleet: Fleet) -> None:
    """Sleep takes the worker's ``generate`` instance out of the router's pool; its
    ``rl`` endpoint stays (a trainer must be able to wake it), and Dynamo lists
    ``rl`` endpoints: the sleeping worker is still listed, answering, with its model.
    A trainer that wants the serving workers asks each ``/is_sleeping``."""
    asleep = fleet.admins[0]
    ids_before = generate_ids(fleet)
    assert http_json(f"{asleep}/sleep?level=1", {}) == (200, {"status": "sleeping", "level": 1})
    try:
        wait_until(lambda: len(generate_ids(fleet)) == 1, 10, "out of the pool")
        listed = healthy(fleet)
        assert set(listed) == set(fleet.admins)  # both still listed, no error
        assert listed[asleep]["model"] == MODEL
        assert listed[asleep]["instance_id"] in ids_before - generate_ids(fleet)
        assert http_json(f"{asleep}/is_sleeping") == (200, {"is_sleeping": True})
    finally:
        assert http_json(f"{asleep}/wake_up", {}) == (200, {"status": "awake", "tags": None})
    wait_until(lambda: generate_ids(fleet) == ids_before, 10, "back in the pool")
    assert set(healthy(fleet)) == set(fleet.admins)


def test_a_killed_bridge_drops_out_of_the_listing(fleet: Fleet) -> None:
    """SIGKILL to the whole bridge (its process group: it cannot withdraw anything).
    Its records live until the discovery store's TTL: meanwhile the frontend lists
    it with the request plane's error and no system URL (Prime-RL's client waits
    on such a worker), then it is gone; the other worker is listed throughout."""
    dead, alive = fleet.admins[1], fleet.admins[0]
    killed = time.monotonic()
    os.killpg(fleet.bridges[1].pid, signal.SIGKILL)
    seen_error = False

    def gone() -> bool:
        nonlocal seen_error
        workers = listing(fleet)["workers"]
        survivors = [w for w in workers if w.get("system_url") == alive]
        assert len(survivors) == 1 and "error" not in survivors[0], workers
        assert all(w.get("system_url") != dead for w in workers), workers  # never as healthy
        seen_error |= any("error" in w for w in workers)
        return len(workers) == 1

    wait_until(gone, 30, "the killed worker out of /v1/rl/workers", interval=0.25)
    print(
        f"killed bridge out of /v1/rl/workers after {time.monotonic() - killed:.1f} s "
        f"(listed with an error meanwhile: {seen_error})"
    )
    assert listing(fleet)["workers"][0]["system_url"] == alive
