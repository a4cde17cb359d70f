"""Item 1: the engine server dies (SIGKILL) with 64+ requests in flight.

Every request in flight ends within 2 s with a migratable error (5xx through
the frontend), the bridge stays up, new requests fail fast, the bridge's
Dynamo /health turns notready, and when an engine server comes back at the
same address (a new instance id) the bridge serves again within 1 s of it
being ready, with the KV router's view of the old instance cleared.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from harness.engine import load, wait_load
from harness.env import health_env
from harness.http import HttpOutcome, http_json, post_rollout, post_stream, stream_body
from harness.ports import free_port, free_system_port
from harness.procs import ProcessGroup
from harness.stack import KV_ROUTER_ARGS, Stack
from harness.waits import wait_until, wait_until_probe_async
from rl_client import driver
from tests.faults.faults_common import (
    LONG_SIM_ARGS,
    kv_hit_rate,
    kv_prompt,
    prompt,
    record,
    wait_kv_hit,
)

pytestmark = [pytest.mark.serial, pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-engine-death"
IN_FLIGHT_ROLLOUTS = 64
IN_FLIGHT_STREAMS = 8
OLD_PROMPTS = 8


def health(port: int) -> int:
    status, _ = http_json(f"http://127.0.0.1:{port}/health", timeout=2)
    return status


async def test_engine_server_killed_with_requests_in_flight(
    tmp_path: Path, model_dir: Path
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    system_port = free_system_port()
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL)
        engine, address = stack.start_engine("engine-1", *LONG_SIM_ARGS, listen=listen)
        bridge = stack.start_bridge("bridge", address, **health_env(system_port))
        stack.start_frontend(*KV_ROUTER_ARGS)
        stack.wait_serving()
        base = stack.base_url
        wait_until(lambda: health(system_port) == 200, 30, "bridge /health ready", [bridge])

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # The router learns these prompts' blocks from the relay: repeats score hits.
            old_prompts = [kv_prompt(i) for i in range(OLD_PROMPTS)]
            for tokens in old_prompts:
                await kv_hit_rate(session, base, MODEL, tokens=tokens)
            assert await wait_kv_hit(session, base, MODEL, old_prompts[-1]) > 0

            tasks = [
                asyncio.create_task(post_rollout(session, base, MODEL, prompt(i), max_tokens=1500))
                for i in range(IN_FLIGHT_ROLLOUTS)
            ] + [
                asyncio.create_task(
                    post_stream(
                        session, f"{base}/v1/completions", stream_body(MODEL, prompt(100 + i), 1500)
                    )
                )
                for i in range(IN_FLIGHT_STREAMS)
            ]
            total = IN_FLIGHT_ROLLOUTS + IN_FLIGHT_STREAMS
            await asyncio.to_thread(
                wait_load, address, lambda load: load.running_requests >= total, 60
            )
            assert not any(t.done() for t in tasks)

            engine.kill()
            killed = time.monotonic()
            outcomes: list[HttpOutcome] = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            ended = max(o.ended for o in outcomes) - killed
            rollouts, streams = outcomes[:IN_FLIGHT_ROLLOUTS], outcomes[IN_FLIGHT_ROLLOUTS:]
            assert all(500 <= o.status < 600 for o in rollouts), [
                (o.status, o.body, o.error) for o in rollouts if not 500 <= o.status < 600
            ]
            assert all((o.stream_error_code or 0) >= 500 or o.status >= 500 for o in streams), [
                (o.status, o.stream_error_code, o.error) for o in streams
            ]
            assert ended < 2.0, f"requests in flight ended {ended:.2f}s after the kill"
            bridge.check_alive()

            # While the engine is down: new requests fail fast, /health turns notready.
            started = time.monotonic()
            down = await post_rollout(session, base, MODEL, prompt(7), max_tokens=4)
            fail_fast = time.monotonic() - started
            assert 500 <= down.status < 600, (down.status, down.body)
            assert fail_fast < 2.0
            await asyncio.to_thread(
                wait_until, lambda: health(system_port) == 503, 10, "/health notready", [bridge]
            )
            unready_after = time.monotonic() - killed

            # A new engine server, same address: the bridge serves within 1 s of it being ready.
            engine2, _ = stack.start_engine("engine-2", *LONG_SIM_ARGS, listen=listen)
            ready_at = (group.log_dir / "engine-2.addr").stat().st_mtime
            answer = await wait_until_probe_async(
                lambda: post_rollout(session, base, MODEL, prompt(8), max_tokens=2),
                30,
                "a rollout served by the new engine server",
                interval=0.02,
                done=lambda answer: answer.status == 200,
            )
            recovery = time.time() - ready_at
            first = driver.parse_rollout_response(answer.body)
            assert first.instance_id and len(first.token_ids) == 2
            bridge.check_alive()
            engine2.check_alive()

            # The KV router forgets the dead instance's blocks: the relay removes
            # them when it sees the new instance id. The removal reaches the router
            # asynchronously, so probe the old prompts one by one (each probe caches
            # its prompt in the new engine) until one scores no hit; a router that
            # kept the old blocks would score hits on all of them.
            await asyncio.to_thread(
                wait_until,
                lambda: "instance changed" in bridge.log_tail(200_000),
                10,
                "the KV relay to follow the new instance",
                [bridge],
            )
            hits = []
            for tokens in old_prompts:
                hits.append(await kv_hit_rate(session, base, MODEL, tokens=tokens))
                if hits[-1] == 0.0:
                    break
                await asyncio.sleep(0.3)
            assert hits[-1] == 0.0, hits
            # ... and learns the new engine's blocks again.
            assert await wait_kv_hit(session, base, MODEL, old_prompts[0]) > 0
            await asyncio.to_thread(
                wait_until, lambda: health(system_port) == 200, 10, "/health ready", [bridge]
            )
            ready_again = time.monotonic() - killed

        record(
            "engine_death",
            in_flight=total,
            in_flight_ended_after_kill_s=round(ended, 3),
            new_request_fail_fast_s=round(fail_fast, 3),
            health_notready_after_kill_s=round(unready_after, 2),
            served_again_after_engine_ready_s=round(recovery, 3),
            health_ready_again_after_kill_s=round(ready_again, 2),
            kv_probes_until_old_view_cleared=len(hits),
        )
        assert recovery < 1.0, f"served again {recovery:.2f}s after the engine server was ready"


async def test_requests_on_a_dead_engine_migrate(tmp_path: Path, model_dir: Path) -> None:
    """The error is one Dynamo migrates: with a frontend ``--migration-limit``, the
    rollouts in flight on a killed engine server finish on the other worker (200).
    New requests too, although the frontend (1.6.1) keeps routing to the worker
    whose /health says notready: migration, not health, keeps them whole."""
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, "tiny-migrate")
        addresses = []
        for i in range(2):
            _, address = stack.start_engine(f"engine-{i}", *LONG_SIM_ARGS)
            stack.start_bridge(f"bridge-{i}", address)
            addresses.append(address)
        # The frontend may pick the dead worker again on a retry (it stays
        # registered): enough retries that all 64 get through (2^-20 each).
        stack.start_frontend("--migration-limit", "20")
        stack.wait_serving(workers=2)
        base = stack.base_url
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [
                asyncio.create_task(post_rollout(session, base, "tiny-migrate", prompt(i), 250))
                for i in range(IN_FLIGHT_ROLLOUTS)
            ]

            def all_running() -> bool:
                running = [load(a).running_requests for a in addresses]
                return sum(running) >= IN_FLIGHT_ROLLOUTS and all(running)

            # 5 s each: all of them run, on both engines, well before any ends.
            await asyncio.to_thread(wait_until, all_running, 60, "all rollouts running")
            stack.engines[0].proc.kill()
            killed = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            migrated_s = max(o.ended for o in outcomes) - killed
            assert [o.status for o in outcomes] == [200] * IN_FLIGHT_ROLLOUTS, [
                (o.status, o.body) for o in outcomes if o.status != 200
            ]
            # All finished whole on the surviving engine server.
            results = [driver.parse_rollout_response(o.body) for o in outcomes]
            assert len({r.instance_id for r in results}) == 1
            assert all(r.finish_reason in ("length", "stop") and r.token_ids for r in results)
            after = [
                await post_rollout(session, base, "tiny-migrate", prompt(200 + i), 2)
                for i in range(6)
            ]
            assert [o.status for o in after] == [200] * 6
        record(
            "engine_death_migration",
            in_flight=IN_FLIGHT_ROLLOUTS,
            all_finished_after_kill_s=round(migrated_s, 2),
        )
