"""The training loop: rollouts through Dynamo, a GRPO step on the trainer, the new
weights streamed back over the contract, every step.

The stack is the real one: a vLLM engine server (CPU, the tiny model), a
bridge, a Dynamo frontend. The engine server starts paused (``--start-paused``)
and waits for the trainer's weights, so that whatever engine serves (the first
one, or one restarted after a crash) generates with the trainer's current
policy only. Each step's refit publishes the committed version in the discovery
store (``rl_client.committed``: pushed by the trainer), so the bridge keeps a
restarted engine out of the router's pool until it serves it
(``bridge/catch_up.py``), and the trainer's keeper (``rl_client.keeper``)
pushes it the current weights (a restarted engine reports its initial
"default"), under the same lock as the step's refit.

Per step: B prompts x K samples as rollouts (the driver client, sampled with the
server's generation config); provenance (every token's weight version is the
step's); the trainer's logprobs and NeMo RL's ``token_mult_prob_error`` gate;
group-relative advantages and a clipped policy-gradient update; the weights
streamed with ``EngineRefitClient`` (pause, update, resume) as version
``str(step)``; a greedy probe through the stack shows the served policy moved.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine_contract.tensors import Tensor
from harness.engine import load, tiny_vllm_args
from harness.ports import free_port
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack
from rl_client.committed import committed_store
from rl_client.driver import RetryPolicy, RolloutClient, RolloutResult
from rl_client.keeper import WeightKeeper
from rl_client.refit import EngineRefitClient
from train_demo.grpo import (
    Task,
    group_advantages,
    policy_loss,
    token_mult_prob_error,
    trainer_logprobs,
)

log = logging.getLogger(__name__)

MODEL = "policy"
# NeMo RL refuses a step whose generation and trainer disagree by more than
# 1.05; the same engine code in fp32 on one machine sits far below, so 1.01.
ERROR_GATE = 1.01
PROBE = [7, 300, 21, 801, 42, 5, 600, 13]


class RunFailed(RuntimeError):
    """The on-policy gate or the provenance check failed."""


@dataclass
class StepStats:
    step: int
    reward: float
    error: float
    generation_s: float
    train_s: float
    refit_s: float
    tokens: int
    engine_restarts: int
    # Rollouts the engine server held when it was killed (the fault step only).
    in_flight_at_kill: int = 0
    probe_tokens: list[int] = field(default_factory=list)
    probe_logprobs: list[float] = field(default_factory=list)


@dataclass
class RunConfig:
    steps: int = 25
    learning_rate: float = 2e-2
    seed: int = 0
    # Kill -9 the engine server once, mid-generation of this step (0: never).
    fault_step: int = 0
    task: Task = field(default_factory=Task)


@dataclass
class RunResult:
    config: dict[str, Any]
    steps: list[StepStats]

    @property
    def reward_before(self) -> float:
        return self.steps[0].reward

    @property
    def reward_after(self) -> float:
        tail = self.steps[-3:]
        return sum(s.reward for s in tail) / len(tail)

    @property
    def worst_error(self) -> float:
        return max(s.error for s in self.steps)

    def summary(self) -> str:
        refit = sum(s.refit_s for s in self.steps) / len(self.steps)
        return (
            f"{len(self.steps)} steps: reward {self.reward_before:.3f} -> {self.reward_after:.3f} "
            f"(last 3), worst token_mult_prob_error {self.worst_error:.6f} (gate {ERROR_GATE}), "
            f"refit {refit * 1000:.0f} ms/step, engine restarts {self.steps[-1].engine_restarts}"
        )

    def as_json(self) -> dict[str, Any]:
        return {"config": self.config, "steps": [asdict(s) for s in self.steps]}


def policy_tensors(model: torch.nn.Module) -> list[Tensor]:
    """The trainer's weights, copied (the optimizer changes them in place), by their
    checkpoint names."""
    return [
        Tensor(name, "float32", tuple(value.shape), value.detach().clone().contiguous().numpy())
        for name, value in model.state_dict().items()
    ]


class PolicyStack:
    """Frontend, bridge and a paused-at-start vLLM engine server on a fixed address."""

    def __init__(self, root: Path, group: ProcessGroup, model_dir: Path) -> None:
        self.stack = Stack.new(root, group, model_dir, MODEL, bridge_blocks=())
        self.listen = f"127.0.0.1:{free_port()}"
        self.engine: Proc | None = None
        self.restarts = 0

    def start(self) -> None:
        self.start_engine()
        self.stack.start_bridge("bridge", self.listen, "--log-level", "warning")
        self.stack.start_frontend()
        self.stack.wait_serving(timeout=300)

    def start_engine(self) -> None:
        name = f"engine-{self.restarts}"
        self.engine, _ = self.stack.start_engine(
            name,
            *tiny_vllm_args(max_model_len=512),
            "--block-size",
            "32",
            "--start-paused",
            backend="vllm",
            listen=self.listen,
            timeout=300,
        )

    def kill_and_restart(self) -> None:
        assert self.engine is not None
        self.engine.signal(signal.SIGKILL)
        self.engine.wait_exit(30)
        self.restarts += 1
        self.start_engine()


async def held_by_the_engine(address: str, rollouts: asyncio.Future[Any]) -> int:
    """Once the engine server holds some of the step's rollouts, how many (0 when
    the batch ended first): the moment to kill it mid-generation."""
    deadline = time.monotonic() + 10
    while not rollouts.done() and time.monotonic() < deadline:
        held = (await asyncio.to_thread(load, address)).registered_requests
        if held:
            return held
        await asyncio.sleep(0.01)
    return 0


async def push(trainer: EngineRefitClient, version: str, tensors: list[Tensor]) -> float:
    """Stream ``tensors`` as ``version`` (pause, update, label, publish, resume);
    seconds taken."""
    started = time.monotonic()
    await trainer.refit(version, tensors=tensors, mode="wait")
    return time.monotonic() - started


async def generate(
    client: RolloutClient, prompts: list[list[int]], task: Task
) -> list[RolloutResult]:
    return list(
        await asyncio.gather(
            *(client.rollout(p, greedy=False, max_tokens=task.max_tokens) for p in prompts)
        )
    )


def check_provenance(results: list[RolloutResult], version: str) -> None:
    """Every token was generated by the weights of ``version``."""
    for result in results:
        expected = [(version, 0, len(result.token_ids))] if result.token_ids else []
        if (result.weight_versions or []) != expected:
            raise RunFailed(
                f"rollout {result.request_id}: tokens from weights {result.weight_versions}, "
                f"expected all from {version!r}"
            )


async def run(
    config: RunConfig,
    root: Path,
    model_dir: Path,
    on_step: Callable[[StepStats], None] = lambda stats: None,
) -> RunResult:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    task = config.task
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    steps: list[StepStats] = []
    with ProcessGroup(root / "logs") as group:
        policy = PolicyStack(root, group, model_dir)
        await asyncio.to_thread(policy.start)
        store = committed_store(policy.stack.namespace, env=policy.stack.env)
        trainer = EngineRefitClient([policy.listen], store=store)
        keeper = WeightKeeper(trainer)
        retry = RetryPolicy(attempts=200, initial_s=0.25, max_s=1.0)
        client = RolloutClient(policy.stack.base_url, MODEL, timeout_s=300, retry=retry)
        try:
            version = "0"
            await push(trainer, version, policy_tensors(model))  # and the engine resumes
            keeper.start()
            for step in range(1, config.steps + 1):
                prompts = [
                    [rng.randrange(3, 1000) for _ in range(task.prompt_length)]
                    for _ in range(task.prompts_per_step)
                ]
                batch = [p for p in prompts for _ in range(task.group_size)]
                started = time.monotonic()
                rollouts = asyncio.ensure_future(generate(client, batch, task))
                in_flight = 0
                if step == config.fault_step:
                    in_flight = await held_by_the_engine(policy.listen, rollouts)
                    await asyncio.to_thread(policy.kill_and_restart)
                results = await rollouts
                generation_s = time.monotonic() - started
                check_provenance(results, version)

                started = time.monotonic()
                generations = [r.token_ids for r in results]
                generation_lps = [r.logprobs for r in results]
                model.train()
                train_lps = trainer_logprobs(model, batch, generations)
                error = token_mult_prob_error(generation_lps, train_lps)
                if error > ERROR_GATE:
                    raise RunFailed(
                        f"step {step}: token_mult_prob_error {error:.6f} over the gate {ERROR_GATE}"
                    )
                rewards = [task.reward(g) for g in generations]
                advantages = group_advantages(rewards, task.group_size)
                loss = policy_loss(train_lps, generation_lps, advantages)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                train_s = time.monotonic() - started

                version = str(step)
                refit_s = await push(trainer, version, policy_tensors(model))
                probe = await client.rollout(PROBE, greedy=True, max_tokens=task.max_tokens)
                check_provenance([probe], version)
                stats = StepStats(
                    step=step,
                    reward=sum(rewards) / len(rewards),
                    error=error,
                    generation_s=generation_s,
                    train_s=train_s,
                    refit_s=refit_s,
                    tokens=sum(len(g) for g in generations),
                    engine_restarts=policy.restarts,
                    in_flight_at_kill=in_flight,
                    probe_tokens=probe.token_ids,
                    probe_logprobs=probe.logprobs,
                )
                steps.append(stats)
                on_step(stats)
        finally:
            await client.close()
            await keeper.close()
            await trainer.close()
    cfg = asdict(config)
    return RunResult(cfg, steps)
