"""Version-guarded rollouts (contract revision 8) through the real stack: driver ->
Dynamo frontend -> bridge -> engine server, two workers, refits running the whole
time.

The driver names the weight version each rollout requires (the last one the
trainer's refit committed). Refits alternate WAIT and KEEP modes and checkpoints,
each to a new version, one after the other for as long as rollouts run. Every
token that comes back is of the version its rollout required (every span is
checked); a rollout a KEEP-mode refit caught ends there ("weight_version_changed",
the tokens so far); one a worker refused (its weights moved on meanwhile) is sent
again, for the new version, until served. A worker serving another version hands
a rollout on to the one that serves it (the frontend's migration).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import tiny_weights_dir
from harness.engine import load
from harness.metrics import scrape
from harness.ports import free_port, free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from rl_client import driver, wire
from rl_client.committed import CheckpointSource, CommittedWeights
from rl_client.refit import RefitClient

pytestmark = pytest.mark.dynamo

MODEL = "tiny-guard"
# Decode slow enough (2 ms a token) that a KEEP-mode refit finds rollouts mid-way.
SIM_ARGS = ("--eos-rate", "0.02", "--decode-step-ms", "2")
ROLLOUTS = int(os.environ.get("WEIGHT_GUARD_ROLLOUTS", "1000"))
CONCURRENCY = 48
# Rollouts served between two refits: the refits follow one another this closely.
PER_REFIT = 25
ENDS = {"stop", "length", wire.WEIGHT_VERSION_CHANGED}


@dataclass
class GuardStack:
    stack: Stack
    admins: list[str]  # each worker's system URL (its RL routes)
    addresses: list[str]  # each worker's engine server
    metrics: list[str]  # each engine server's /metrics

    def total(self, name: str, **labels: str) -> float:
        """A counter summed over both engine servers."""
        return sum(scrape(url).value(name, **labels) for url in self.metrics)


@pytest.fixture(scope="module")
def guard_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[GuardStack]:
    root = tmp_path_factory.mktemp("guard-stack")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        admins, addresses, metrics = [], [], []
        for i in range(2):
            metrics_port = free_port()
            _, address = stack.start_engine(
                f"engine-{i}", *SIM_ARGS, "--seed", str(i), "--metrics-port", str(metrics_port)
            )
            port = free_system_port()
            stack.start_bridge(f"bridge-{i}", address, "--enable-rl", DYN_SYSTEM_PORT=str(port))
            admins.append(f"http://127.0.0.1:{port}")
            addresses.append(address)
            metrics.append(f"http://127.0.0.1:{metrics_port}/metrics")
        # A refused rollout goes to the other worker (it may pick the same one again).
        stack.start_frontend("--migration-limit", "8")
        stack.wait_serving(workers=2, timeout=60)
        stack.wait_routed(workers=2)
        yield GuardStack(stack, admins, addresses, metrics)


@dataclass
class Trainer:
    """The versions refits committed, and what the rollouts saw of them."""

    version: str
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    served_since_refit: int = 0
    refits: Counter[str] = field(default_factory=Counter)

    async def commit(self, version: str) -> None:
        async with self.changed:
            self.version = version
            self.served_since_refit = 0
            self.changed.notify_all()

    async def served(self) -> None:
        async with self.changed:
            self.served_since_refit += 1
            self.changed.notify_all()

    async def wait(self, what: str, predicate: Callable[[], bool]) -> None:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), 60)
            except TimeoutError:
                raise AssertionError(f"{what}: not within 60 s") from None


def server_info(address: str) -> pb.GetServerInfoResponse:
    with grpc.insecure_channel(address) as channel:
        answer: pb.GetServerInfoResponse = pb_grpc.EngineServiceStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=10
        )
        return answer


def prompt_of(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 1000) for _ in range(rng.randrange(6, 40))]


def check(result: driver.RolloutResult, required: str, max_tokens: int) -> None:
    """Every token of the required version; an early end only at a weight change."""
    assert result.finish_reason in ENDS, result.finish_reason
    spans = result.weight_versions
    assert spans is not None  # in order and without gaps: checked by the driver
    assert sum(end - start for _, start, end in spans) == len(result.token_ids), spans
    others = [span for span in spans if span[0] != required]
    assert not others, (required, spans)
    if result.finish_reason == wire.WEIGHT_VERSION_CHANGED:
        assert len(result.token_ids) < max_tokens and not result.truncated


async def test_a_worker_serving_another_version_hands_the_rollout_on(
    guard_stack: GuardStack,
) -> None:
    gs = guard_stack
    first = gs.admins[0]
    # Both workers serve the tiny model's checkpoint, as started (or as the other
    # test leaves them), under one label.
    before = load(gs.addresses[1]).refit_state.weight_version
    assert load(gs.addresses[0]).refit_state.weight_version == before
    committed = CommittedWeights(before, CheckpointSource(str(gs.stack.model_dir)))
    instances = [server_info(a).instance_id for a in gs.addresses]
    refused_before = gs.total("engine_server_weight_version_refusals_total")
    async with RefitClient([first], committed=committed) as client:
        await client.refit(str(tiny_weights_dir(1)), "only-first")
    try:
        once = driver.RetryPolicy(attempts=1)
        async with driver.RolloutClient(gs.stack.base_url, MODEL, timeout_s=60, retry=once) as rc:
            for required, index in (("only-first", 0), (before, 1)):
                results = await asyncio.gather(
                    *(
                        rc.rollout(prompt_of(2000 + i), max_tokens=8, weight_version=required)
                        for i in range(12)
                    )
                )
                for result in results:
                    check(result, required, 8)
                # Each served by the one worker whose weights carry that version.
                assert {r.instance_id for r in results} == {instances[index]}
        # Some went to the other worker first (round robin), which refused them: the
        # frontend migrated them, since no try of the driver's failed.
        assert gs.total("engine_server_weight_version_refusals_total") > refused_before
    finally:
        async with RefitClient([first], committed=committed) as client:
            await client.refit(str(gs.stack.model_dir), before)


async def test_guarded_rollouts_get_only_their_version_while_refits_run(
    guard_stack: GuardStack,
) -> None:
    gs = guard_stack
    checkpoints = [str(tiny_weights_dir(1)), str(gs.stack.model_dir)]
    trainer = Trainer(version=load(gs.addresses[0]).refit_state.weight_version)
    ends: Counter[str] = Counter()
    refusals: list[str] = []
    retried: Counter[int] = Counter()
    served = 0
    refused_before = gs.total("engine_server_weight_version_refusals_total")
    changed_before = gs.total(
        "engine_server_requests_total", kind="rollout", finish_reason=wire.WEIGHT_VERSION_CHANGED
    )
    started = time.monotonic()

    # The checkpoint the workers serve (started on it, or left on it by the other test).
    committed = CommittedWeights(trainer.version, CheckpointSource(str(gs.stack.model_dir)))

    async def refits() -> None:
        async with RefitClient(gs.admins, committed=committed) as client:
            step = 0
            while served < ROLLOUTS:
                await trainer.wait(
                    "rollouts served since the last refit",
                    lambda: trainer.served_since_refit >= PER_REFIT or served >= ROLLOUTS,
                )
                if served >= ROLLOUTS:
                    return
                step += 1
                mode = ("wait", "keep")[step % 2]
                version = f"v{step}-{mode}"
                report = await client.refit(checkpoints[step % 2], version, mode=mode)
                assert report.ok, report
                trainer.refits[mode] += 1
                await trainer.commit(version)

    async def rollouts(client: driver.RolloutClient, next_index: Iterator[int]) -> None:
        nonlocal served
        for i in next_index:
            max_tokens = 8 + i % 40
            while True:
                required = trainer.version
                try:
                    result = await client.rollout(
                        prompt_of(i), max_tokens=max_tokens, weight_version=required
                    )
                except driver.RolloutHTTPError as e:
                    # Refused (the frontend says no more than 503): the worker's weights
                    # moved on. Send it again, for the version committed since.
                    assert e.status == 503, e
                    refusals.append(e.message)
                    retried[i] += 1
                    await trainer.wait("a newer version", lambda: trainer.version != required)  # noqa: B023
                    continue
                check(result, required, max_tokens)
                ends[result.finish_reason] += 1
                served += 1
                await trainer.served()
                break

    indexes = iter(range(ROLLOUTS))
    once = driver.RetryPolicy(attempts=1)
    async with driver.RolloutClient(gs.stack.base_url, MODEL, timeout_s=60, retry=once) as client:
        await asyncio.gather(refits(), *(rollouts(client, indexes) for _ in range(CONCURRENCY)))
    elapsed = time.monotonic() - started
    assert served == ROLLOUTS and sum(ends.values()) == ROLLOUTS
    # Both modes ran, and both of the guard's outcomes happened.
    assert trainer.refits["wait"] and trainer.refits["keep"], trainer.refits
    assert ends[wire.WEIGHT_VERSION_CHANGED], ends
    assert refusals, "no rollout was refused"
    # Every 503 was the guard's refusal (one or more: the frontend migrates it first),
    # and every early end a weight change's.
    refused = gs.total("engine_server_weight_version_refusals_total") - refused_before
    assert refused >= len(refusals), (refused, len(refusals))
    changed = gs.total(
        "engine_server_requests_total", kind="rollout", finish_reason=wire.WEIGHT_VERSION_CHANGED
    )
    assert changed - changed_before == ends[wire.WEIGHT_VERSION_CHANGED]
    print(
        f"{ROLLOUTS} guarded rollouts in {elapsed:.1f}s, refits {dict(trainer.refits)}, "
        f"ends {dict(ends)}, {len(refusals)} refusals of {len(retried)} rollouts, sent again"
    )
