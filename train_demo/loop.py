"""The training loop: rollouts through Dynamo, a GRPO step on the trainer, the new
weights streamed back over the contract, every step.

The stack is the real one: vLLM engine servers (CPU, the tiny model) behind
bridges and a Dynamo frontend; by default a fleet of generation workers hosted
in Ray actors behind the KV router (``workers.RayFleet``), or one worker as
plain processes (``workers.ProcessStack``). Every engine server starts paused
(``--start-paused``) and waits for the trainer's weights, so that whatever
engine serves (the first ones, or one that replaced a dead worker) generates
with the trainer's current policy only.

Each step's refit is the all-or-nothing fleet refit (``rl_client.fleet_cycle``:
pause every worker, load, and only once every load succeeded label, publish,
resume), and publishes the committed version in the discovery store
(``rl_client.committed``: weights pushed by the trainer). So the bridge of a
worker that starts mid-run keeps it out of the router's pool until it serves
that version (``bridge/catch_up.py``), and the trainer's keeper
(``rl_client.keeper``) pushes it the current weights (it starts on
"default"), under the same lock as the step's refits.

Per step: B prompts x K samples as rollouts (the driver client, sampled with the
server's generation config), each requiring the step's weight version (the
version guard: a worker on other weights refuses it, retryably); provenance
(every span of every rollout is the step's version); the trainer's logprobs and
NeMo RL's ``token_mult_prob_error`` gate; group-relative advantages and a
clipped policy-gradient update; the weights streamed to every worker as version
``str(step)``; a greedy probe through the stack shows the served policy moved.

The fault, once (``fault_step``): the worker holding rollouts is killed. The
step's batch goes to engine servers paused with ``PAUSE_MODE_KEEP``, so that it
waits in them, and the one holding most is killed once it holds half its share:
whatever the machine's load, the kill lands on rollouts in the engine, which the
driver then sends again. In the fleet, with ``ray.kill``: the survivors resume
and the trainer refits them from then on, and a new actor is started in its
place; once its engine is up (paused, on its start checkpoint) the trainer adds
it to its fleet, the keeper pushes it the committed weights, and only then does
its bridge join the router's pool. It joins ``rejoin_within`` steps after the fault
at the latest (the loop waits for it there if need be), and before the last.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from engine_contract.tensors import Tensor
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.procs import ProcessGroup
from rl_client.committed import CommittedStore, CommittedWeights, committed_store
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
from train_demo.workers import (
    MODEL,
    ProcessStack,
    RayFleet,
    Worker,
    Workers,
    held_by,
    hold,
    release,
    wait_registered,
)

log = logging.getLogger(__name__)

# NeMo RL refuses a step whose generation and trainer disagree by more than
# 1.05; the same engine code in fp32 on one machine sits far below, so 1.01.
ERROR_GATE = 1.01
PROBE = [7, 300, 21, 801, 42, 5, 600, 13]
# How long a replacement may take to be in discovery once its engine is up.
CATCH_UP_TIMEOUT_S = 120.0


class RunFailed(RuntimeError):
    """The on-policy gate, the provenance check or the catch-up check failed."""


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
    # Rollouts the killed engine server held when it was killed (the fault step only).
    in_flight_at_kill: int = 0
    probe_tokens: list[int] = field(default_factory=list)
    probe_logprobs: list[float] = field(default_factory=list)
    # Weight-version spans checked (every one the step's version), probe included.
    spans_checked: int = 0
    # The step's rollouts by the worker that served them.
    served_by: dict[str, int] = field(default_factory=dict)
    # Workers the step's refit went to.
    refit_workers: int = 0


@dataclass
class FaultStats:
    """The worker killed holding rollouts and the one that replaced it."""

    step: int
    killed: str
    in_flight_at_kill: int
    replacement: str = ""
    # Seconds from the kill until the killed worker's bridge left discovery.
    unlisted_s: float | None = None
    # Seconds from the kill until the replacement's engine server was up (paused,
    # on its start checkpoint).
    replacement_start_s: float | None = None
    # Seconds from then until it was in discovery, on the committed weights: the
    # catch-up (the keeper's push and the bridge's gate).
    catch_up_s: float | None = None
    keeper_push_s: float | None = None
    # The committed version it was brought to, and when it joined.
    caught_up_to: str = ""
    joined_during_step: int = 0
    # The first step some of whose rollouts it served.
    first_served_step: int = 0


@dataclass
class RunConfig:
    steps: int = 25
    learning_rate: float = 2e-2
    seed: int = 0
    # Kill the worker holding this step's rollouts, once (0: never).
    fault_step: int = 0
    # Generation workers in Ray actors behind the KV router; 0: one worker as
    # plain processes (engine server and bridge), its engine restarted in place.
    workers: int = 2
    # The fleet: the replacement of the killed worker joins once caught up, and
    # this many steps after the fault at the latest (the loop waits for it there),
    # so that the run goes on both on the survivors and on the whole fleet again.
    rejoin_within: int = 3
    task: Task = field(default_factory=Task)


@dataclass
class RunResult:
    config: dict[str, Any]
    steps: list[StepStats]
    description: str = ""
    fault: FaultStats | None = None

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
        spans = sum(s.spans_checked for s in self.steps)
        line = (
            f"{len(self.steps)} steps: reward {self.reward_before:.3f} -> {self.reward_after:.3f} "
            f"(last 3), worst token_mult_prob_error {self.worst_error:.6f} (gate {ERROR_GATE}), "
            f"refit {refit * 1000:.0f} ms/step, engine restarts {self.steps[-1].engine_restarts}; "
            f"{spans} weight-version spans, each its step's"
        )
        if self.description:
            line += f"\n{self.description}"
        fault = self.fault
        if fault is not None:
            line += (
                f"\nstep {fault.step}: {fault.killed} killed holding {fault.in_flight_at_kill} "
                f"rollouts, out of discovery in {_secs(fault.unlisted_s)}; {fault.replacement} "
                f"up {_secs(fault.replacement_start_s)} after the kill, caught up to "
                f"{fault.caught_up_to!r} in {_secs(fault.catch_up_s)} (push "
                f"{_secs(fault.keeper_push_s)}) during step {fault.joined_during_step}, "
                f"serving from step {fault.first_served_step}"
            )
        return line

    def as_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "description": self.description,
            "fault": asdict(self.fault) if self.fault is not None else None,
            "steps": [asdict(s) for s in self.steps],
        }


@dataclass
class Progress:
    """The step under way."""

    step: int = 0


def _secs(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}s"


def policy_tensors(model: torch.nn.Module) -> list[Tensor]:
    """The trainer's weights, copied (the optimizer changes them in place), by their
    checkpoint names."""
    return [
        Tensor(name, "float32", tuple(value.shape), value.detach().clone().contiguous().numpy())
        for name, value in model.state_dict().items()
    ]


class Trainer:
    """The trainer's fleet refit client and keeper over the engine servers serving
    now; rebuilt (``retarget``) when the fleet changes, never during a refit."""

    def __init__(self, store: CommittedStore) -> None:
        self.store = store
        self.lock = asyncio.Lock()
        self.client: EngineRefitClient | None = None
        self.keeper: WeightKeeper | None = None
        # The fleet's committed weights (the tensors of the last refit).
        self.committed: CommittedWeights | None = None
        self.pushes = 0

    async def retarget(self, addresses: list[str]) -> None:
        async with self.lock:
            await self._close()
            if addresses:
                self.client = EngineRefitClient(
                    addresses, store=self.store, committed=self.committed
                )
                self.keeper = WeightKeeper(self.client)
                self.keeper.start()

    async def refit(self, version: str, tensors: list[Tensor]) -> tuple[float, int]:
        """Every engine server on ``tensors`` as ``version``, or none (RefitError):
        pause, update, label, publish, resume. Seconds taken, and on how many."""
        async with self.lock:
            if self.client is None:
                raise RunFailed("no engine server to refit")
            started = time.monotonic()
            await self.client.refit(version, tensors=tensors, mode="wait")
            self.committed = self.client.committed
            return time.monotonic() - started, len(self.client.engines)

    @property
    def last_push_s(self) -> float | None:
        return self.keeper.last_push_s if self.keeper is not None else None

    async def _close(self) -> None:
        keeper, self.keeper = self.keeper, None
        client, self.client = self.client, None
        if keeper is not None:
            await keeper.close()
            self.pushes += keeper.pushes
        if client is not None:
            await client.close()

    async def close(self) -> None:
        async with self.lock:
            await self._close()


def weight_version(address: str) -> tuple[str, bool]:
    """What an engine server serves now: its version label, and whether a refit set it."""
    with grpc.insecure_channel(address) as channel:
        answer = pb_grpc.EngineServiceStub(channel).GetWeightVersion(
            pb.GetWeightVersionRequest(), timeout=5
        )
    return answer.weight_version, answer.declared


async def watch_catch_up(
    workers: Workers, address: str, trainer: Trainer, size: int, fault: FaultStats
) -> None:
    """From an engine server's start (paused, on its start checkpoint) until its
    worker is in discovery: fails if it got there before it served the fleet's
    committed version (the count read first, then the version, each time; a refit
    may commit meanwhile)."""

    def committed_version() -> str | None:
        return trainer.committed.version if trainer.committed is not None else None

    started = time.monotonic()
    while True:
        before = committed_version()
        registered = await asyncio.to_thread(workers.stack.registered_workers)
        version, declared = await asyncio.to_thread(weight_version, address)
        committed = committed_version()
        on_committed = declared and version in (before, committed)
        if registered >= size:
            if not on_committed:
                raise RunFailed(
                    f"{fault.replacement} joined the router's pool serving {version!r}, "
                    f"not the committed {committed!r}"
                )
            fault.catch_up_s = time.monotonic() - started
            fault.caught_up_to = version
            fault.keeper_push_s = trainer.last_push_s
            return
        if time.monotonic() - started > CATCH_UP_TIMEOUT_S:
            raise RunFailed(
                f"{fault.replacement} not in discovery {CATCH_UP_TIMEOUT_S:g}s after its "
                f"engine started (serving {version!r}, committed {committed!r})"
            )
        await asyncio.sleep(0.02)


async def replace(
    fleet: RayFleet, trainer: Trainer, fault: FaultStats, killed_at: float, progress: Progress
) -> Worker:
    """A new worker in the place of the killed one, caught up before it serves."""
    size = fleet.size
    unlisted = asyncio.ensure_future(
        wait_registered(
            fleet.stack, lambda n: n <= size - 1, 60, "the killed worker out of discovery"
        )
    )
    try:
        worker = await fleet.start_worker()
    finally:
        fault.unlisted_s = await unlisted - killed_at
    fault.replacement = worker.name
    fault.replacement_start_s = time.monotonic() - killed_at
    fleet.add(worker)
    catch_up = asyncio.ensure_future(watch_catch_up(fleet, worker.address, trainer, size, fault))
    # Between two refits: the keeper now watches it, and pushes it the committed weights.
    await trainer.retarget(fleet.addresses)
    await catch_up
    fault.joined_during_step = progress.step
    return worker


async def generate(
    client: RolloutClient, prompts: list[list[int]], task: Task, version: str
) -> list[RolloutResult]:
    return list(
        await asyncio.gather(
            *(
                client.rollout(p, greedy=False, max_tokens=task.max_tokens, weight_version=version)
                for p in prompts
            )
        )
    )


def check_provenance(results: list[RolloutResult], version: str) -> int:
    """Every token was generated by the weights of ``version``: every span of every
    rollout names it, and the spans cover its tokens. The spans checked."""
    spans = 0
    for result in results:
        covered = 0
        for span_version, start, end in result.weight_versions or []:
            if span_version != version or start != covered or end <= start:
                raise RunFailed(
                    f"rollout {result.request_id}: tokens {start}..{end} from weights "
                    f"{span_version!r} ({result.weight_versions}), expected all from {version!r}"
                )
            covered = end
            spans += 1
        if covered != len(result.token_ids):
            raise RunFailed(
                f"rollout {result.request_id}: spans {result.weight_versions} cover "
                f"{covered} of its {len(result.token_ids)} tokens"
            )
    return spans


async def run(
    config: RunConfig,
    root: Path,
    model_dir: Path,
    on_step: Callable[[StepStats], None] = lambda stats: None,
) -> RunResult:
    from transformers import AutoModelForCausalLM

    if config.workers == 1 and config.fault_step:
        # Its bridge gone, the frontend no longer knows the model (HTTP 404, which
        # no driver retries) until the replacement registers.
        raise ValueError("a fleet of one worker has no survivor to take the killed one's work")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    task = config.task
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    steps: list[StepStats] = []
    fault: FaultStats | None = None
    progress = Progress()
    with ProcessGroup(root / "logs") as group:
        workers: Workers
        if config.workers > 0:
            workers = RayFleet(root, group, model_dir, config.workers)
        else:
            workers = ProcessStack(root, group, model_dir)
        trainer: Trainer | None = None
        client: RolloutClient | None = None
        joining: asyncio.Future[Any] | None = None
        try:
            await workers.start()
            names: dict[str, str] = {}  # engine server instance id -> worker
            store = committed_store(workers.stack.namespace, env=workers.stack.env)
            trainer = Trainer(store)
            await trainer.retarget(workers.addresses)
            retry = RetryPolicy(attempts=200, initial_s=0.25, max_s=1.0)
            client = RolloutClient(workers.stack.base_url, MODEL, timeout_s=300, retry=retry)
            version = "0"
            await trainer.refit(version, policy_tensors(model))  # and the engines resume
            for step in range(1, config.steps + 1):
                progress.step = step
                due = min(config.fault_step + config.rejoin_within, config.steps)
                if joining is not None and (joining.done() or step >= due):
                    # From then on the whole fleet serves; a failed join fails the run.
                    await joining
                    joining = None
                prompts = [
                    [rng.randrange(3, 1000) for _ in range(task.prompt_length)]
                    for _ in range(task.prompts_per_step)
                ]
                batch = [p for p in prompts for _ in range(task.group_size)]
                started = time.monotonic()
                if step == config.fault_step:
                    # The batch waits in the engines until one of them is killed.
                    await hold(workers.addresses)
                rollouts = asyncio.ensure_future(generate(client, batch, task, version))
                in_flight = 0
                if step == config.fault_step:
                    fault, joining = await kill_one(
                        workers, trainer, rollouts, len(batch), progress
                    )
                    in_flight = fault.in_flight_at_kill
                results = await rollouts
                generation_s = time.monotonic() - started
                spans = check_provenance(results, version)
                names.update(await asyncio.to_thread(workers.instance_names))
                served_by = Counter(names.get(r.instance_id, r.instance_id) for r in results)

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
                refit_s, refit_workers = await trainer.refit(version, policy_tensors(model))
                probe = await client.rollout(
                    PROBE, greedy=True, max_tokens=task.max_tokens, weight_version=version
                )
                spans += check_provenance([probe], version)
                stats = StepStats(
                    step=step,
                    reward=sum(rewards) / len(rewards),
                    error=error,
                    generation_s=generation_s,
                    train_s=train_s,
                    refit_s=refit_s,
                    tokens=sum(len(g) for g in generations),
                    engine_restarts=workers.restarts,
                    in_flight_at_kill=in_flight,
                    probe_tokens=probe.token_ids,
                    probe_logprobs=probe.logprobs,
                    spans_checked=spans,
                    served_by=dict(sorted(served_by.items())),
                    refit_workers=refit_workers,
                )
                steps.append(stats)
                on_step(stats)
            if joining is not None:  # killed at the last step: its replacement too
                await joining
                joining = None
        finally:
            if joining is not None:
                joining.cancel()
                await asyncio.gather(joining, return_exceptions=True)
            if client is not None:
                await client.close()
            if trainer is not None:
                await trainer.close()
            await workers.close()
    if fault is not None and fault.replacement:
        fault.first_served_step = next(
            (s.step for s in steps if s.served_by.get(fault.replacement)), 0
        )
    return RunResult(asdict(config), steps, workers.description, fault)


async def kill_one(
    workers: Workers,
    trainer: Trainer,
    rollouts: asyncio.Future[Any],
    batch: int,
    progress: Progress,
) -> tuple[FaultStats, asyncio.Future[Worker] | None]:
    """Kill the worker holding the step's rollouts, sent to held engine servers
    (``hold``), once one holds half its share. The fleet: the survivors resume,
    and its replacement starts (the future: joined, caught up); the single stack:
    its engine server restarted in place, caught up before the rollouts end."""
    at_least = max(1, batch // (2 * len(workers.addresses)))
    address, in_flight = await held_by(workers.addresses, rollouts, at_least)
    if isinstance(workers, RayFleet):
        killed = workers.kill(address)
        killed_at = time.monotonic()
        await release(workers.addresses)  # the survivors
        fault = FaultStats(progress.step, killed.name, in_flight)
        await trainer.retarget(workers.addresses)
        joining = asyncio.ensure_future(replace(workers, trainer, fault, killed_at, progress))
        return fault, joining
    assert isinstance(workers, ProcessStack)
    fault = FaultStats(progress.step, f"engine-{workers.restarts}", in_flight)
    workers.kill()
    killed_at = time.monotonic()
    # Its bridge leaves the pool once it sees its engine gone (gRPC health).
    unlisted = asyncio.ensure_future(
        wait_registered(workers.stack, lambda n: n == 0, 60, "the worker out of discovery")
    )
    try:
        await asyncio.to_thread(workers.restart)
    finally:
        fault.unlisted_s = await unlisted - killed_at
    fault.replacement = f"engine-{workers.restarts}"
    fault.replacement_start_s = time.monotonic() - killed_at
    # Its bridge left the pool when the engine died; back once caught up (the
    # step's rollouts wait for it meanwhile: the driver retries them).
    await watch_catch_up(workers, address, trainer, 1, fault)
    fault.joined_during_step = progress.step
    return fault, None
