"""Engine servers swapped in place: a new instance at the bridge's address is re-read
and served (another backend, another supported contract revision) when it fits
what the worker registered with Dynamo, and refused loudly (out of the router's
pool) when it does not (another shape, a revision older than the supported
two); the frontend is never restarted.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.engine import tiny_vllm_args
from harness.http import http_json
from harness.ports import free_port
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack, registered_workers
from harness.waits import wait_until
from rl_client import driver
from tests.faults.faults_common import record
from tests.faults.test_faults_version_skew import OLDEST_SERVER, SKEWED, skew

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]

MODEL = "tiny-swap"
# What vLLM's CPU build serves the tiny model with (tiny_vllm_args): the sim
# takes the same shape, so that either can stand in for the other.
SHAPE = ("--block-size", "32", "--context-length", "1024")


def rollout(stack: Stack) -> driver.RolloutResult:
    status, body = http_json(
        f"{stack.base_url}/v1/completions",
        driver.build_rollout_body(MODEL, [5, 6, 7, 8], greedy=True, max_tokens=4),
    )
    assert status == 200, body
    return driver.parse_rollout_response(body)


def served_by_new(stack: Stack, bridge: Proc, old: str, timeout: float = 20) -> tuple[str, float]:
    """Until a rollout comes back from an instance other than ``old``: that instance,
    and the seconds it took."""
    started = time.monotonic()

    def new_instance() -> str | None:
        try:
            instance = rollout(stack).instance_id
        except AssertionError:
            return None
        return instance if instance != old else None

    instance = wait_until(
        new_instance, timeout, f"a rollout from an instance other than {old}", [bridge], 0.2
    )
    return instance, time.monotonic() - started


def sim_stack(
    tmp_path: Path, group: ProcessGroup, model_dir: Path, listen: str
) -> tuple[Stack, Proc, Proc, str]:
    """A sim engine server of vLLM's shape at ``listen``, a bridge and a frontend:
    (stack, engine, bridge, the instance the first rollout came from)."""
    stack = Stack.new(tmp_path, group, model_dir, MODEL)
    engine, address = stack.start_engine("sim", *SHAPE, listen=listen)
    bridge = stack.start_bridge("bridge", address)
    stack.start_frontend()
    stack.wait_serving()
    return stack, engine, bridge, rollout(stack).instance_id


def test_replacements_that_fit_are_served_and_others_refused(
    tmp_path: Path, model_dir: Path
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    with ProcessGroup(tmp_path / "logs") as group:
        stack, engine, bridge, first = sim_stack(tmp_path, group, model_dir, listen)

        # A server of the oldest supported revision at the same address: served.
        engine.kill()
        engine, _ = stack.start_engine(
            "sim-oldest", *SHAPE, listen=listen, env=skew(OLDEST_SERVER), launcher=SKEWED
        )
        second, oldest_s = served_by_new(stack, bridge, first)
        log = bridge.log_tail(100_000)
        assert f", contract {OLDEST_SERVER}, rollouts multiplexed" in log, log[-3000:]

        # One older than that: refused, out of the pool.
        engine.kill()
        engine, _ = stack.start_engine(
            "sim-too-old", *SHAPE, listen=listen, env=skew(OLDEST_SERVER - 1), launcher=SKEWED
        )
        refusal = (
            f"implements contract revision {OLDEST_SERVER - 1}, but this bridge needs at least "
            f"revision {OLDEST_SERVER}: upgrade the engine server"
        )
        wait_until(lambda: refusal in bridge.log_tail(100_000), 20, "refusal logged", [bridge])
        wait_until(
            lambda: registered_workers(stack.kv_dir, stack.namespace) == 0,
            10,
            "out of the pool",
            [bridge],
        )

        # One that does not fit the registration (another KV block size): refused.
        engine.kill()
        engine, _ = stack.start_engine(
            "sim-misfit", "--block-size", "16", "--context-length", "1024", listen=listen
        )
        wait_until(
            lambda: "KV block size 32 -> 16" in bridge.log_tail(100_000),
            20,
            "refusal logged",
            [bridge],
        )
        wait_until(
            lambda: registered_workers(stack.kv_dir, stack.namespace) == 0,
            10,
            "out of the pool",
            [bridge],
        )
        status, _ = http_json(
            f"{stack.base_url}/v1/completions",
            driver.build_rollout_body(MODEL, [5, 6, 7, 8], greedy=True, max_tokens=4),
        )
        assert status != 200

        # A fitting one again: back in the pool and served.
        engine.kill()
        stack.start_engine("sim-again", *SHAPE, listen=listen)
        third, back_s = served_by_new(stack, bridge, second)
        assert third not in (first, second)
        assert registered_workers(stack.kv_dir, stack.namespace) == 1
        assert bridge.alive()
        record(
            "engine_swap",
            oldest_revision_served_after_s=round(oldest_s, 2),
            fitting_served_again_after_s=round(back_s, 2),
        )


@pytest.mark.vllm
def test_sim_replaced_by_vllm_at_the_same_address(tmp_path: Path, model_dir: Path) -> None:
    pytest.importorskip("vllm")
    listen = f"127.0.0.1:{free_port()}"
    with ProcessGroup(tmp_path / "logs") as group:
        stack, engine, bridge, first = sim_stack(tmp_path, group, model_dir, listen)
        engine.kill()
        stack.start_engine(
            "vllm",
            *tiny_vllm_args(max_model_len=1024),
            "--block-size",
            "32",
            backend="vllm",
            listen=listen,
            timeout=240,
        )
        _, took = served_by_new(stack, bridge, first, timeout=30)
        assert "(vllm " in bridge.log_tail(100_000)
        record("engine_swap_vllm", served_after_vllm_ready_s=round(took, 2))
