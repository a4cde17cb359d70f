"""Issue 12, item 1, through the whole path: an engine server at an admission limit
refuses a rollout with RESOURCE_EXHAUSTED naming the limit, and that reaches the
HTTP client as a retryable 503 (the driver retries 5xx), not the 400 a request
over the message size limit gets. The engine server is served in this process
(real gRPC on a real socket) so that its limits can be set; the bridge and
Dynamo's frontend are real processes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from harness.engine import idle, long_sim_args, wait_load
from harness.http import post_rollout
from harness.procs import ProcessGroup
from harness.stack import Stack
from tests.faults.faults_common import prompt, record
from tests.server.abuse_common import server_with_limits

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-capacity"


async def test_capacity_refusal_is_a_retryable_503(tmp_path: Path, model_dir: Path) -> None:
    server = server_with_limits(
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        *long_sim_args(decode_step_ms=20),
        max_requests_in_flight=2,
    )
    try:
        with ProcessGroup(tmp_path / "logs") as group:
            stack = Stack.new(tmp_path, group, model_dir, MODEL)
            stack.start_bridge("bridge", server.address)
            stack.start_frontend()
            stack.wait_serving()
            base = stack.base_url
            async with aiohttp.ClientSession() as session:
                # Two rollouts that would run for 30 s take the server's two places.
                running = [
                    asyncio.create_task(
                        post_rollout(session, base, MODEL, prompt(i), max_tokens=1500, timeout=60)
                    )
                    for i in range(2)
                ]
                await asyncio.to_thread(
                    wait_load, server.address, lambda load: load.registered_requests == 2, 30
                )
                started = time.monotonic()
                third = await post_rollout(session, base, MODEL, prompt(3), max_tokens=4)
                refused_s = time.monotonic() - started
                assert third.status == 503, (third.status, third.body)
                assert not any(t.done() for t in running)
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                # The dropped HTTP requests abort their engine requests: room again.
                await asyncio.to_thread(wait_load, server.address, idle, 15)
                again = await post_rollout(session, base, MODEL, prompt(4), max_tokens=4)
                assert again.status == 200, (again.status, again.body)
            record(
                "capacity_refusal_through_dynamo",
                status=third.status,
                refused_after_s=round(refused_s, 3),
                message=str(third.body)[:200],
            )
    finally:
        server.stop()
