"""A version-guarded rollout refused with the fleet's versions, through the real
stack: driver -> Dynamo frontend (migrations on) -> bridge -> engine server, the
fleet's committed record in the file store beside discovery (issue 37, 10a).

The trainer commits two refits ("v1", then "v2") through the record. A rollout
that requires "v1" then fails at its first try, never migrated nor sent again,
with an error naming the version it requires, the one the worker serves and the
committed one. One that requires a version a refit under way may bring is still
retried: it names the three versions once its tries are spent, and succeeds once
the refit commits that version.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import tiny_weights_dir
from harness.metrics import scrape
from harness.ports import free_port
from harness.stack import Stack, stack_under
from rl_client import driver
from rl_client.committed import FileCommittedStore
from rl_client.refit import EngineRefitClient

pytestmark = pytest.mark.dynamo

MODEL = "tiny-refusal"
PROMPT = [5, 6, 7, 8]
REFUSALS = "engine_server_weight_version_refusals_total"


@dataclass
class RefusalStack:
    stack: Stack
    address: str  # the engine server's
    metrics: str  # its /metrics
    store: FileCommittedStore  # the fleet's committed record

    def refusals(self) -> float:
        return scrape(self.metrics).value(REFUSALS)

    def committed(self) -> str:
        record = self.store.read()
        assert record is not None
        return record.weights.version

    def trainer(self) -> EngineRefitClient:
        return EngineRefitClient([self.address], store=self.store)

    def pause(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            pb_grpc.EngineServiceStub(channel).PauseGeneration(
                pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT, clear_cache=False), timeout=10
            )

    def resume(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            pb_grpc.EngineServiceStub(channel).ResumeGeneration(
                pb.ResumeGenerationRequest(), timeout=10
            )


@pytest.fixture(scope="module")
def refusal_stack(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[RefusalStack]:
    with stack_under(tmp_path_factory.mktemp("refusal-stack"), model_dir, MODEL) as stack:
        metrics_port = free_port()
        _, address = stack.start_engine(
            "engine", "--decode-step-ms", "1", "--metrics-port", str(metrics_port)
        )
        # Catch-up on (the bridge's default): the bridge reads the fleet's record.
        stack.start_bridge("bridge", address)
        # Migrations on: a migratable refusal would be tried again by the frontend.
        stack.start_frontend("--migration-limit", "3")
        stack.wait_serving(timeout=90)
        rs = RefusalStack(
            stack,
            address,
            f"http://127.0.0.1:{metrics_port}/metrics",
            FileCommittedStore(stack.kv_dir, stack.namespace),
        )

        async def two_refits() -> None:
            async with rs.trainer() as trainer:
                for version, path in (("v1", tiny_weights_dir(1)), ("v2", model_dir)):
                    report = await trainer.refit(version, path=str(path))
                    assert report.ok, report.describe()

        asyncio.run(two_refits())
        assert rs.committed() == "v2"
        yield rs


def client(base_url: str, retry: driver.RetryPolicy) -> driver.RolloutClient:
    return driver.RolloutClient(base_url, MODEL, timeout_s=60, retry=retry)


async def test_a_version_the_fleet_moved_on_from_fails_at_once_naming_the_versions(
    refusal_stack: RefusalStack,
) -> None:
    rs = refusal_stack
    committed = rs.committed()
    assert committed != "v1"
    before = rs.refusals()
    # Tries enough that a retry would show, spaced closely.
    retry = driver.RetryPolicy(attempts=3, initial_s=0.05, max_s=0.1)
    started = time.monotonic()
    async with client(rs.stack.base_url, retry) as rc:
        with pytest.raises(driver.WeightVersionRefusedError) as refused:
            await rc.rollout(PROMPT, max_tokens=4, weight_version="v1")
    elapsed = time.monotonic() - started
    err = refused.value
    assert not err.retryable
    assert (err.required, err.serving, err.committed) == ("v1", committed, committed)
    message = str(err)
    assert "required 'v1'" in message, message
    assert f"serving {committed!r}" in message and f"committed {committed!r}" in message
    assert "not retried" in message
    # One refusal in all: one try of the driver's, not migrated by the frontend.
    assert rs.refusals() - before == 1
    assert elapsed < 5, elapsed
    # The committed version itself is served.
    async with client(rs.stack.base_url, retry) as rc:
        result = await rc.rollout(PROMPT, max_tokens=4, weight_version=committed)
    assert result.weight_version == committed


async def test_a_version_a_refit_under_way_may_bring_is_retried(
    refusal_stack: RefusalStack,
) -> None:
    rs = refusal_stack
    committed = rs.committed()
    coming = f"{committed}-next"
    # A refit under way: the trainer paused the worker, nothing loaded yet.
    await asyncio.to_thread(rs.pause)
    try:
        # Its tries spent while the refit runs on: refused on each, and the last
        # refusal names the versions.
        before = rs.refusals()
        retry = driver.RetryPolicy(attempts=3, initial_s=0.05, max_s=0.1)
        async with client(rs.stack.base_url, retry) as rc:
            with pytest.raises(driver.WeightVersionRefusedError) as refused:
                await rc.rollout(PROMPT, max_tokens=4, weight_version=coming)
        err = refused.value
        assert err.retryable
        assert (err.required, err.serving, err.committed) == (coming, committed, committed)
        assert f"required {coming!r}" in str(err) and "paused for a refit" in str(err)
        assert rs.refusals() - before == 3  # each try once, none migrated

        # Patient enough for the refit: refused while it runs, served once it commits.
        before = rs.refusals()
        patient = driver.RetryPolicy(attempts=60, initial_s=0.1, max_s=0.25)
        async with client(rs.stack.base_url, patient) as rc:
            rollout = asyncio.ensure_future(rc.rollout(PROMPT, max_tokens=4, weight_version=coming))
            deadline = time.monotonic() + 20
            while rs.refusals() == before:
                assert time.monotonic() < deadline, "the rollout was never refused"
                assert not rollout.done(), rollout
                await asyncio.sleep(0.05)
            async with rs.trainer() as trainer:
                report = await trainer.refit(coming, path=str(tiny_weights_dir(1)))
            assert report.ok, report.describe()
            result = await asyncio.wait_for(rollout, 30)
        assert result.weight_version == coming
        assert rs.refusals() - before >= 1
        assert rs.committed() == coming
    finally:
        await asyncio.to_thread(rs.resume)
