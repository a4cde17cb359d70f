"""Issue 12, items 2 and 3: processes that stall (SIGSTOP) rather than die.

- A bridge paused past file discovery's 10 s TTL has its records deleted by the
  frontend; after SIGCONT it notices and re-registers by itself: the model is
  listed and served again within seconds, nothing restarted.
- An engine server paused under its bridge: the bridge's health watch takes the
  worker out of the router's pool, new requests fail fast (HTTP 503) instead of
  hanging, the requests that were waiting on it fail with a retryable status
  once ``--engine-stall-timeout-s`` passes, and after SIGCONT the worker rejoins
  and serves.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp
import pytest

from harness.engine import wait_load
from harness.http import post_rollout, post_stream, served_models, stream_body
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack, registered_workers
from harness.waits import wait_until
from tests.faults.faults_common import LONG_SIM_ARGS, prompt, record

pytestmark = [pytest.mark.serial, pytest.mark.dynamo, pytest.mark.slow]

# File discovery's TTL is 10 s; past it the frontend deletes a silent worker's records.
BRIDGE_STOPPED_S = 13.0
STALL_TIMEOUT_S = 3.0
# The bridge asks its engine's health every 0.25 s (1 s deadline) and gives up
# after two failures: how long until it knows.
DETECT_S = 2.5


def workers(stack: Stack) -> int:
    return registered_workers(stack.kv_dir, stack.namespace)


@contextmanager
def stopped(proc: Proc, kv_dir: Path | None = None) -> Iterator[None]:
    """SIGSTOP ``proc`` for the block; SIGCONT whatever happens in it.

    With ``kv_dir`` (file discovery), ``proc`` is stopped outside the store's
    changes. Dynamo 1.6.1 changes a bucket under an exclusive ``flock`` of its
    folder (``kv/v1/instances``, ...); a process stopped holding one keeps every
    other process from changing or expiring that bucket's records until it runs
    again, so the frontend keeps a stopped worker whose TTL has long run out (a
    bridge stopped the instant its instance record appeared met this once). That
    is Dynamo's to change; these tests are about what the bridge does once
    discovery dropped it. So the bucket locks are held while the signal lands."""
    buckets = sorted((kv_dir / "v1").iterdir()) if kv_dir is not None else []
    with ExitStack() as locks:
        for bucket in buckets:
            fd = os.open(bucket, os.O_RDONLY | os.O_DIRECTORY)
            locks.callback(os.close, fd)  # closing the folder releases its lock
            wait_until(lambda fd=fd: try_lock(fd), 10, f"{bucket}'s flock", (proc,), 0.001)
        proc.signal(signal.SIGSTOP)
        wait_until(lambda: state(proc.pid) == "T", 5, f"{proc.name} stopped", (), 0.001)
    try:
        yield
    finally:
        proc.signal(signal.SIGCONT)


def try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def state(pid: int) -> str:
    """The process state letter of ``pid`` ("T": stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> float:
    """Poll ``predicate()`` (off the loop) until truthy; the seconds it took."""
    started = time.monotonic()
    await asyncio.to_thread(wait_until, predicate, timeout, what, (), interval)
    return time.monotonic() - started


async def first_200(
    session: aiohttp.ClientSession, stack: Stack, seed: int, timeout: float
) -> tuple[float, list[int]]:
    """Rollouts until one answers 200: (seconds it took, statuses before it)."""
    started = time.monotonic()
    statuses: list[int] = []
    while True:
        outcome = await post_rollout(
            session, stack.base_url, stack.model, prompt(seed), max_tokens=2, timeout=10
        )
        if outcome.status == 200:
            return time.monotonic() - started, statuses
        statuses.append(outcome.status)
        assert time.monotonic() - started < timeout, (
            f"not served within {timeout}s: {statuses[-5:]} {outcome.body!r:.300}"
        )
        await asyncio.sleep(0.1)


async def pause_past_the_ttl(stack: Stack, bridge: Proc, name: str) -> None:
    """SIGSTOP ``bridge`` until discovery dropped it and BRIDGE_STOPPED_S passed;
    SIGCONT; it must serve again within 10 s, by itself. Records the figures."""
    async with aiohttp.ClientSession() as session:
        with stopped(bridge, stack.kv_dir):
            paused = time.monotonic()
            dropped_s = await until(
                lambda: workers(stack) == 0, 30, "discovery to drop the paused bridge", 0.2
            )
            await asyncio.sleep(max(0.0, BRIDGE_STOPPED_S - (time.monotonic() - paused)))
            assert stack.model not in served_models(stack.base_url)
        resumed = time.monotonic()

        await until(lambda: workers(stack) == 1, 10, "the worker registered again")
        registered_s = time.monotonic() - resumed
        await until(
            lambda: stack.model in served_models(stack.base_url), 10, "the model listed again"
        )
        listed_s = time.monotonic() - resumed
        _, failures = await first_200(session, stack, 2, 10)
        serving_s = time.monotonic() - resumed
    # Nothing was restarted: the same three processes serve.
    assert len(stack.group.procs) == 3
    for proc in stack.procs:
        proc.check_alive()
    log = bridge.log_tail(200_000)
    record(
        name,
        stopped_s=BRIDGE_STOPPED_S,
        registration_dropped_after_s=round(dropped_s, 2),
        registered_again_after_sigcont_s=round(registered_s, 2),
        listed_again_after_sigcont_s=round(listed_s, 2),
        served_again_after_sigcont_s=round(serving_s, 2),
        statuses_before_served=failures,
    )
    assert serving_s < 10.0, (
        f"served again {serving_s:.2f}s after SIGCONT (registered after {registered_s:.2f}s, "
        f"listed after {listed_s:.2f}s)"
    )
    assert "re-registered" in log, log[-3000:]


async def test_bridge_paused_past_the_discovery_ttl_registers_again(
    tmp_path: Path, model_dir: Path
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, "tiny-paused-bridge")
        _, address = stack.start_engine("engine", "--decode-step-ms", "2")
        bridge = stack.start_bridge("bridge", address)
        stack.start_frontend()
        stack.wait_serving()
        async with aiohttp.ClientSession() as session:
            await first_200(session, stack, 1, 10)
        # A worker that has been serving for a moment (not one paused the instant
        # it registered: see the next test).
        await asyncio.sleep(1.0)
        await pause_past_the_ttl(stack, bridge, "paused_bridge")


async def test_bridge_paused_the_moment_it_registers_exits_for_a_restart(
    tmp_path: Path, model_dir: Path
) -> None:
    """The same pause, begun as soon as the worker's instance record appears (a host
    stalling during start-up), before the bridge could keep a copy of its records:
    it exits 75 after SIGCONT, for its supervisor to restart it."""
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, "tiny-paused-at-start")
        _, address = stack.start_engine("engine", "--decode-step-ms", "2")
        bridge = stack.start_bridge("bridge", address)
        stack.start_frontend()
        await until(lambda: workers(stack) == 1, 60, "the worker to register", 0.005)
        with stopped(bridge, stack.kv_dir):
            await until(lambda: workers(stack) == 0, 30, "discovery to drop it", 0.2)
            await asyncio.sleep(BRIDGE_STOPPED_S)
        resumed = time.monotonic()
        # Its records were dropped before it could keep a copy: it cannot write them
        # back, so it exits at once with 75 for its supervisor to restart it (no
        # silent half-registered worker).
        code = await asyncio.to_thread(bridge.wait_exit, 15)
        exited_s = time.monotonic() - resumed
        log = bridge.log_tail(200_000)
        assert code == 75, log[-3000:]
        assert "cannot be written back" in log, log[-3000:]
        record("paused_bridge_at_start", exited_75_after_sigcont_s=round(exited_s, 2))


async def test_paused_engine_server_fails_requests_fast_and_rejoins(
    tmp_path: Path, model_dir: Path
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, "tiny-paused-engine")
        engine, address = stack.start_engine("engine", *LONG_SIM_ARGS)
        bridge = stack.start_bridge(
            "bridge", address, "--engine-stall-timeout-s", f"{STALL_TIMEOUT_S:g}"
        )
        stack.start_frontend()
        stack.wait_serving()
        base, model = stack.base_url, stack.model
        async with aiohttp.ClientSession() as session:
            await first_200(session, stack, 1, 10)
            # In flight when the engine stops: a rollout and a streamed completion
            # that would run for 30 s (1500 steps of 20 ms).
            rollout = asyncio.create_task(
                post_rollout(session, base, model, prompt(2), max_tokens=1500, timeout=60)
            )
            streamed = asyncio.create_task(
                post_stream(
                    session, f"{base}/v1/completions", stream_body(model, prompt(3), 1500), 60
                )
            )
            await asyncio.to_thread(
                wait_load,
                address,
                lambda load: load.running_requests == 2,
                10,
                "both requests running on the engine",
            )
            assert not rollout.done() and not streamed.done()

            with stopped(engine):
                paused = time.monotonic()
                left_s = await until(
                    lambda: workers(stack) == 0, 10, "the worker to leave the pool"
                )
                started = time.monotonic()
                new = await post_rollout(session, base, model, prompt(4), max_tokens=2, timeout=30)
                fail_fast_s = time.monotonic() - started
                in_flight = await asyncio.wait_for(rollout, 30)
                in_flight_s = in_flight.ended - paused
                stream_outcome = await asyncio.wait_for(streamed, 30)
                stream_s = stream_outcome.ended - paused
                bridge.check_alive()
            resumed = time.monotonic()

            rejoined_s = await until(
                lambda: workers(stack) == 1, 10, "the worker to rejoin the pool"
            )
            _, failures = await first_200(session, stack, 5, 10)
            serving_s = time.monotonic() - resumed
        record(
            "paused_engine",
            stall_timeout_s=STALL_TIMEOUT_S,
            left_pool_after_sigstop_s=round(left_s, 2),
            new_request_status=new.status,
            new_request_failed_after_s=round(fail_fast_s, 3),
            in_flight_rollout_status=in_flight.status,
            in_flight_rollout_failed_after_sigstop_s=round(in_flight_s, 2),
            in_flight_stream_status=[stream_outcome.status, stream_outcome.stream_error_code],
            in_flight_stream_failed_after_sigstop_s=round(stream_s, 2),
            rejoined_after_sigcont_s=round(rejoined_s, 2),
            served_after_sigcont_s=round(serving_s, 2),
            statuses_before_served=failures,
        )
        assert left_s < DETECT_S + 1.5, f"left the pool {left_s:.2f}s after SIGSTOP"
        assert new.status == 503, (new.status, new.body)
        assert fail_fast_s < 3.0, f"a new request took {fail_fast_s:.2f}s to fail"
        # Retryable: 5xx (the driver retries 408, 429 and 5xx), and no later than
        # the stall timeout after the bridge knew.
        assert 500 <= in_flight.status < 600, (in_flight.status, in_flight.body, in_flight.error)
        assert in_flight_s < DETECT_S + STALL_TIMEOUT_S + 3.0, in_flight_s
        assert (
            500 <= stream_outcome.status < 600 or (stream_outcome.stream_error_code or 0) >= 500
        ), stream_outcome
        assert stream_s < DETECT_S + STALL_TIMEOUT_S + 3.0, stream_s
        assert serving_s < 5.0, f"served again {serving_s:.2f}s after SIGCONT"
