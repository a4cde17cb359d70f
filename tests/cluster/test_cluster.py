"""Dynamo's cluster mode on a real etcd and a real NATS server: two simulated engine
servers, two bridges and two frontends, discovery in etcd, requests and KV events
over NATS. Each test measures how long the cluster takes to heal and prints it
(``pytest -s``); the figures are also kept in ``.artifacts/cluster/``.

The tests run in order on one stack: routing, a NATS restart, an etcd restart,
then a bridge stopped past its lease (it comes back under a new instance id).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness import ARTIFACTS
from harness.cluster import Etcd, Nats, etcd_binary, nats_binary
from harness.engine import kv_sim_args
from harness.http import http_json, routed_to, served_models
from harness.procs import Proc, ProcessGroup
from harness.stack import KV_ROUTER_ARGS, Stack
from harness.waits import wait_until

pytestmark = [
    pytest.mark.serial,
    pytest.mark.dynamo,
    pytest.mark.cluster,
    pytest.mark.skipif(
        etcd_binary() is None or nats_binary() is None,
        reason="etcd or nats-server not installed (`make cluster-deps` installs Debian's "
        "etcd-server and nats-server)",
    ),
]

MODEL = "tiny-cluster"
NAMESPACE = "cluster"
BLOCK = 16
# Long enough to ride out an etcd restart (leases survive it on disk), short
# enough for the SIGSTOP test to wait it out.
LEASE_TTL_S = 10


def record(name: str, **figures: Any) -> None:
    folder = ARTIFACTS / "cluster"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\n[cluster] {name}: {json.dumps(figures)}", flush=True)


@dataclass
class Cluster:
    stack: Stack
    etcd: Etcd
    nats: Nats
    urls: list[str]
    frontends: list[Proc]

    def instances(self) -> list[str]:
        return self.etcd.keys(f"v1/instances/{NAMESPACE}/backend/generate/")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    with ProcessGroup(root / "logs") as group:
        started = time.monotonic()
        etcd = Etcd.start(group, root / "etcd")
        nats = Nats.start(group, root / "nats")
        stack = Stack.new(
            root, group, model_dir, MODEL, NAMESPACE, etcd=etcd, nats=nats, lease_ttl_s=LEASE_TTL_S
        )
        stack.start_workers(2, *kv_sim_args(BLOCK))
        urls, frontends = [], []
        for _ in range(2):
            frontends.append(stack.start_frontend(*KV_ROUTER_ARGS))
            urls.append(stack.base_url)
        stack.wait_serving(workers=2, timeout=60)
        for url in urls:
            wait_until(
                lambda u=url: MODEL in served_models(u), 60, f"{MODEL} at {url}", group.procs
            )
        record("start", seconds=round(time.monotonic() - started, 2))
        yield Cluster(stack, etcd, nats, urls, frontends)


def prefixes(seed: int, count: int = 8) -> list[list[int]]:
    """``count`` prompts of six full blocks, new for each ``seed``."""
    return [
        [(seed * 7919 + p * 97 + i * 7) % 900 + 3 for i in range(6 * BLOCK)] for p in range(count)
    ]


def worker_of(url: str, prompt: list[int]) -> int:
    return int(routed_to(url, MODEL, prompt)["decode_worker_id"])


def affinity(c: Cluster, seed: int) -> tuple[int, set[int]]:
    """New prefixes sent through one frontend, then repeated through the other (whose
    router never saw them, so it knows where they are only from the KV events): how
    many repeats went to the worker holding the prefix, and the workers used."""
    first = {p: worker_of(c.urls[0], [*pre, 1000 - p]) for p, pre in enumerate(prefixes(seed))}
    time.sleep(1.0)  # the events' trip: worker -> NATS -> the other router (ms; slack for CI)
    hits = sum(
        worker_of(c.urls[1], [*pre, 900, 901 + p]) == first[p]
        for p, pre in enumerate(prefixes(seed))
    )
    return hits, set(first.values())


def test_both_frontends_list_the_model_and_route_by_kv(cluster: Cluster) -> None:
    assert len(cluster.instances()) == 2
    assert cluster.etcd.granted_ttls() and set(cluster.etcd.granted_ttls()) == {LEASE_TTL_S}
    for url in cluster.urls:
        assert MODEL in served_models(url)
    started = time.monotonic()
    # Every repeat went, through the other frontend, to the worker that holds its
    # prefix; and both workers got new prefixes (so affinity is not trivial).
    used: set[int] = set()
    for seed in range(1, 6):
        hits, workers = affinity(cluster, seed)
        assert hits == 8, (hits, seed)
        used |= workers
        if len(used) == 2:
            break
    assert len(used) == 2, used
    # And the other way round.
    cluster.urls.reverse()
    try:
        assert affinity(cluster, seed=9)[0] == 8
    finally:
        cluster.urls.reverse()
    record(
        "kv_routing_two_frontends", hits=f"{hits}/8", seconds=round(time.monotonic() - started, 2)
    )


def test_nats_restart_kv_events_flow_again(cluster: Cluster) -> None:
    started = time.monotonic()
    cluster.nats.restart()
    restarted = time.monotonic()
    seed, last = 10, None
    while True:
        try:
            last = affinity(cluster, seed)
        except AssertionError as e:  # a frontend not serving yet
            last = (0, {str(e)[:80]})
        if last[0] == 8 and len(last[1]) == 2:
            break
        assert time.monotonic() - restarted < 60, f"KV hits not back within 60 s: {last}"
        seed += 1
    record(
        "nats_restart",
        nats_down_s=round(restarted - started, 2),
        kv_hits_back_after_s=round(time.monotonic() - restarted, 2),
        rounds=seed - 9,
    )


@dataclass
class Traffic:
    """Requests through both frontends from four threads until ``stop()``; every one
    ends (a 30 s client deadline would show a hanging one as status 0)."""

    urls: list[str]
    results: list[tuple[float, float, int]]
    running: bool = True

    def __post_init__(self) -> None:
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(4)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        k = 0
        while self.running:
            k += 1
            begun = time.monotonic()
            status, _ = http_json(
                f"{self.urls[i % 2]}/v1/completions",
                {"model": MODEL, "prompt": [3, 4, 5, i, k % 50], "max_tokens": 8},
                timeout=30,
            )
            self.results.append((begun, time.monotonic() - begun, status))

    def stop(self) -> None:
        self.running = False
        for t in self.threads:
            t.join(60)


class FrontendSupervisor:
    """Restarts a frontend that exited on its own port, as systemd or Kubernetes would:
    Dynamo 1.6.1's runtime shuts down (and the frontend exits) once it could not
    renew its etcd lease for ``ETCD_LEASE_TTL``, and after an etcd restart it keeps
    reconnecting without renewing until then. (A bridge starts itself afresh.)"""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.restarts: list[float] = []
        self.running = True
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            for i, proc in enumerate(self.c.frontends):
                if not proc.alive():
                    self.restarts.append(time.monotonic())
                    port = int(self.c.urls[i].rsplit(":", 1)[1])
                    self.c.frontends[i] = self.c.stack.start_frontend(*KV_ROUTER_ARGS, port=port)
            time.sleep(0.2)

    def stop(self) -> None:
        self.running = False
        self.thread.join(10)


def afresh(c: Cluster) -> int:
    """How many times the bridges started themselves afresh after a lost lease."""
    return sum(b.log_path.read_text().count("starting afresh") for b in c.stack.bridges)


def test_etcd_restart_mid_traffic(cluster: Cluster) -> None:
    before = set(cluster.instances())
    restarts_before = afresh(cluster)
    supervisor = FrontendSupervisor(cluster)
    traffic = Traffic(cluster.urls, [])
    try:
        time.sleep(1.0)
        down = time.monotonic()
        cluster.etcd.stop()
        time.sleep(1.0)
        cluster.etcd.run()
        up = time.monotonic()

        # The runtimes that could not renew their lease give up one TTL after the
        # outage began (bridges then start afresh, frontends are restarted): past
        # that window, two workers are registered (the same or anew) and serve.
        time.sleep(max(0.0, down + LEASE_TTL_S + 2 - time.monotonic()))
        wait_until(lambda: len(cluster.instances()) == 2, 30, "two workers registered")
        registered = time.monotonic()

        def serving() -> bool:
            after = [s for b, _, s in traffic.results if b > registered]
            return len(after) >= 20 and all(s == 200 for s in after[-12:])

        wait_until(serving, 60, "requests served through both frontends again")
        resumed = time.monotonic()
        time.sleep(1.0)
    finally:
        traffic.stop()
        supervisor.stop()
    results = traffic.results
    assert not any(t.is_alive() for t in traffic.threads), "a request is still hanging"
    longest = max(d for _, d, _ in results)
    # Nothing hung: every request ended well within the client's 30 s deadline
    # (failed ones at once: 503, or a refused connection while a frontend restarted).
    assert longest < 15, longest
    for url in cluster.urls:
        assert MODEL in served_models(url)
    assert all(b.alive() for b in cluster.stack.bridges)
    failed = [b for b, _, s in results if s != 200]
    record(
        "etcd_restart",
        lease_ttl_s=LEASE_TTL_S,
        etcd_down_s=round(up - down, 2),
        workers_registered_after_s=round(registered - up, 2),
        instances_changed=len(set(cluster.instances()) - before),
        serving_after_s=round(resumed - up, 2),
        bridges_started_afresh=afresh(cluster) - restarts_before,
        frontends_restarted_at_s=[round(t - up, 2) for t in supervisor.restarts],
        requests=len(results),
        failed=len(failed),
        failed_between_s=[round(min(failed) - up, 2), round(max(failed) - up, 2)] if failed else [],
        longest_request_s=round(longest, 2),
    )


def test_sigstopped_bridge_leaves_routing_and_comes_back(cluster: Cluster) -> None:
    bridge = cluster.stack.bridges[0]
    before = set(cluster.instances())
    restarts_before = afresh(cluster)
    bridge.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_until(lambda: len(cluster.instances()) == 1, LEASE_TTL_S + 20, "lease expired")
        dropped = time.monotonic()
        (survivor,) = cluster.instances()
        survivor_id = int(survivor.rsplit("/", 1)[1], 16)
        # Dropped from routing: every request goes to the other worker, none fails.
        for url in cluster.urls:
            for p, pre in enumerate(prefixes(30, 4)):
                assert worker_of(url, [*pre, p]) == survivor_id
    finally:
        bridge.signal(signal.SIGCONT)
    resumed = time.monotonic()
    wait_until(lambda: len(cluster.instances()) == 2, 30, "the bridge registered again", [bridge])
    back = time.monotonic()
    (new,) = set(cluster.instances()) - before
    new_id = int(new.rsplit("/", 1)[1], 16)

    def routed_to_new() -> bool:
        return any(worker_of(cluster.urls[1], [*pre, 7]) == new_id for pre in prefixes(40, 16))

    wait_until(routed_to_new, 30, "the frontends route to the bridge again")
    routed = time.monotonic()
    assert bridge.alive()
    assert afresh(cluster) == restarts_before + 1
    record(
        "sigstop_past_lease",
        lease_ttl_s=LEASE_TTL_S,
        dropped_after_s=round(dropped - stopped, 2),
        registered_after_sigcont_s=round(back - resumed, 2),
        routed_after_sigcont_s=round(routed - resumed, 2),
    )
