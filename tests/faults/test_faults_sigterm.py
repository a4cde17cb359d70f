"""Item 4: SIGTERM on either process drains gracefully within a configurable
grace period, exits 0 and leaves nothing running.

Engine server: ``--grace-period-s``; requests that finish within it succeed,
the rest are aborted when it ends. Bridge: Dynamo's
``DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS``; the worker leaves discovery at
once, requests in flight finish, then ``cleanup()`` cancels whatever is left
(and the engine aborts it).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
from grpc_health.v1 import health_pb2

from harness.engine import health_status, idle, wait_load
from harness.http import HttpOutcome, post_rollout, served_models
from harness.procs import Proc, group_alive
from harness.stack import Stack, stack_under
from harness.waits import wait_until
from rl_client import driver
from tests.faults.faults_common import LONG_SIM_ARGS, prompt, record

pytestmark = [pytest.mark.serial, pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-sigterm"
GRACE_S = 2.0
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# 20 ms per token: 25 tokens end well within the grace period, 1500 never do.
SHORT, LONG = 25, 1500


@contextmanager
def one_worker(
    tmp_path: Path, model_dir: Path, engine_args: Sequence[str] = (), **bridge_env: str
) -> Iterator[Stack]:
    """MODEL served: one sim engine server (LONG_SIM_ARGS, then ``engine_args``)
    behind one bridge (``bridge_env``: its DYN_* variables), and a frontend."""
    with stack_under(tmp_path, model_dir, MODEL) as stack:
        _, address = stack.start_engine("engine", *LONG_SIM_ARGS, *engine_args)
        stack.start_bridge("bridge", address, **bridge_env)
        stack.start_frontend()
        stack.wait_serving()
        yield stack


async def sigterm_under_load(
    session: aiohttp.ClientSession, stack: Stack, proc: Proc, longs: int
) -> tuple[list[asyncio.Task[HttpOutcome]], list[asyncio.Task[HttpOutcome]], float]:
    """8 rollouts that end well within the grace period and ``longs`` that never do;
    once all run in the engine (but short ones that already ended: on a slow machine
    the first may end before the last arrives), SIGTERM to ``proc``. Returns (the
    short ones, the long ones, when the signal went)."""
    short = [
        asyncio.create_task(
            post_rollout(session, stack.base_url, MODEL, prompt(i), max_tokens=SHORT)
        )
        for i in range(8)
    ]
    long = [
        asyncio.create_task(
            post_rollout(session, stack.base_url, MODEL, prompt(50 + i), max_tokens=LONG)
        )
        for i in range(longs)
    ]
    running = len(short) + len(long)
    await asyncio.to_thread(
        wait_load,
        stack.address(),
        lambda load: load.running_requests + sum(t.done() for t in short) >= running,
        30,
    )
    proc.signal(signal.SIGTERM)
    return short, long, time.monotonic()


async def test_engine_server_sigterm_drains(tmp_path: Path, model_dir: Path) -> None:
    with one_worker(tmp_path, model_dir, ("--grace-period-s", str(GRACE_S))) as stack:
        engine, bridge = stack.engines[0].proc, stack.bridges[0]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            short, long, sent = await sigterm_under_load(session, stack, engine, longs=8)
            # Draining (NOT_SERVING: set once the server has taken the signal, which a
            # request sent at once can beat): new requests are refused at once (a
            # migratable 5xx).
            await asyncio.to_thread(
                wait_until,
                lambda: health_status(stack.address()) == NOT_SERVING,
                5,
                "the engine server draining (NOT_SERVING)",
                [engine],
                0.01,
            )
            refused = await post_rollout(session, stack.base_url, MODEL, prompt(99), max_tokens=2)
            assert 500 <= refused.status < 600, (refused.status, refused.body)
            code = await asyncio.to_thread(engine.wait_exit, GRACE_S + 10)
            exit_s = time.monotonic() - sent
            short_done = await asyncio.gather(*short)
            long_done = await asyncio.gather(*long)
        assert code == 0
        assert not group_alive(engine.pid)
        assert [o.status for o in short_done] == [200] * 8, [o.body for o in short_done]
        # Past the grace period: aborted by the engine and reported as a retryable
        # (migratable) 5xx, never as a partial result and never a hang.
        reasons = [
            driver.parse_rollout_response(o.body).finish_reason if o.status == 200 else o.status
            for o in long_done
        ]
        # (A greedy sim rollout may still end early on a stop token.)
        assert all(r == "stop" or (isinstance(r, int) and 500 <= r < 600) for r in reasons), str(
            reasons
        )
        assert sum(r != "stop" for r in reasons) >= len(reasons) // 2, str(reasons)
        assert GRACE_S - 0.5 < exit_s < GRACE_S + 5, exit_s
        bridge.check_alive()
        record(
            "sigterm_engine_server", grace_period_s=GRACE_S, exit_after_sigterm_s=round(exit_s, 2)
        )


async def test_bridge_sigterm_drains(tmp_path: Path, model_dir: Path) -> None:
    grace = {"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": str(int(GRACE_S))}
    with one_worker(tmp_path, model_dir, **grace) as stack:
        engine, bridge, frontend = stack.engines[0].proc, stack.bridges[0], stack.frontend
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            short, long, sent = await sigterm_under_load(session, stack, bridge, longs=4)
            code = await asyncio.to_thread(bridge.wait_exit, 30)
            exit_s = time.monotonic() - sent
            short_done = await asyncio.gather(*short)
            await asyncio.gather(*long)
        assert code == 0, bridge.log_tail()
        assert not group_alive(bridge.pid)
        assert "bridge cleaned up" in bridge.log_tail(100_000)
        assert [o.status for o in short_done] == [200] * 8, [o.body for o in short_done]
        # Nothing left running in the engine; the model is gone from the frontend.
        await asyncio.to_thread(wait_load, stack.address(), idle, 5)
        assert frontend is not None
        wait_until(
            lambda: MODEL not in served_models(stack.base_url), 10, "the model to go", [frontend]
        )
        engine.check_alive()
        record("sigterm_bridge", grace_period_s=GRACE_S, exit_after_sigterm_s=round(exit_s, 2))
