"""NeMo RL's own traffic, replayed against two workers in Dynamo's cluster mode.

Two ``python -m engine_worker`` workers, each started from exactly the command line
and environment NeMo RL's managed runtime builds for ``python -m dynamo.vllm``
(etcd discovery, TCP requests, KV events over NATS, ``--enable-rl``, vLLM on CPU
with the template-less tiny model and ``--weight-transfer-config '{"backend":
"gloo"}'`` for its NCCL), on a real etcd and NATS, behind a Dynamo frontend
routing by KV overlap, as NeMo RL starts it. The planes come from the flags alone:
NeMo RL strips ``DYN_*`` from a worker's environment.

- Its rollouts (one sample per ``/v1/completions``, all at once, ids from
  ``nvext.completion_token_ids``, logprobs from ``token_logprobs``) reach both
  workers, and their batch is laid out as its ``GenerationOutputSpec``. Both
  workers are in etcd and the router places a repeated prefix on the worker whose
  KV events (over NATS) said it holds it.
- Its refit: one gloo group for the fleet (the trainer at rank 0, worker i at
  ``rank_offset`` = trainer world size + i), initialized once; vLLM's own trainer
  engine broadcasts the seed-1 checkpoint while both workers run the start,
  update, finish phases of ``update_weights_from_distributed`` in NeMo RL's bodies
  (``allow_unpaused: true, reset_prefix_cache: false``); then on each worker
  ``pause_generation {"mode": "wait", "clear_cache": true}`` and
  ``resume_generation``. Both workers then serve what ``AsyncLLM`` serves on that
  checkpoint directly: NeMo RL's rollouts and batch bit for bit at the float32 it
  keeps (the frontend writes logprobs as float32), the driver's rollouts bit for
  bit at float64, under the version sent, and no prefix cached before the refit
  is reused after it.

NeMo RL's finish body carries no version; the one here adds ``weight_version``
(dynamo.vllm's own key) so that the rollouts can show which weights made them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from engine_server.vllm_processes import before_engine_start
from harness.checkpoints import tiny_weights_dir
from harness.cluster import Etcd, Nats, etcd_binary, nats_binary
from harness.engine import tiny_vllm_args
from harness.env import importable
from harness.http import post, routed_to
from harness.metrics import scrape
from harness.nemo_rl import (
    GLOO,
    NEMO_RL_PLANES,
    Completion,
    Worker,
    completion_body,
    frontend_args,
    frontend_has_router_reset_states,
    parse_completion,
    ready_fleet,
    sampler_metrics,
    send_gloo_weights,
    start_worker,
    worker_argv,
)
from harness.procs import Proc, ProcessGroup, worker_children
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir
from harness.waits import settle, wait_until
from rl_client import driver
from rl_client.batch import GenerationOutput, assemble
from rl_client.weight_sync import DynamoWeightSyncClient

pytestmark = [
    pytest.mark.serial,
    pytest.mark.dynamo,
    pytest.mark.cluster,
    pytest.mark.vllm,
    pytest.mark.slow,
    # Two vLLM engines start in the module's fixture, on two shared cores.
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        etcd_binary() is None or nats_binary() is None,
        reason="etcd or nats-server not installed (`make cluster-deps` installs them)",
    ),
    pytest.mark.skipif(not importable("vllm"), reason="vLLM not installed"),
]

MODEL = "tiny-nemo-rl"
NAMESPACE = "nemorl"
WORKERS = 2
TRAIN_WORLD_SIZE = 1  # the trainer: one rank, the sender
CONTROL_TIMEOUT_S = 60  # NeMo RL's dynamo_cfg.control_timeout_s
VERSION = "step-1"
BLOCK = 32
MAX_MODEL_LEN = 512
MAX_NEW_TOKENS = 16
VLLM_ARGS = (*tiny_vllm_args(MAX_MODEL_LEN), "--block-size", str(BLOCK))


def prompt(seed: int) -> list[int]:
    """Two full KV blocks and a part, its first token its own (no prefix in common)."""
    return [(seed * 719 + i * 7) % 900 + 3 for i in range(2 * BLOCK + 6)]


PROMPTS = [prompt(s) for s in range(8)]  # NeMo RL's batch, before and after the refit
DRIVER_PROMPTS = [prompt(100 + s) for s in range(6)]  # the driver's, after it

Outputs = list[tuple[list[int], list[float], str]]  # tokens, logprobs, finish reason


@dataclass
class Replay:
    """The module's stack: the frontend, the two workers, etcd, the model's ids."""

    stack: Stack
    etcd: Etcd
    workers: list[Worker]
    eos: int
    pad: int

    def registered(self) -> set[int]:
        """The instance ids registered in etcd for the generate endpoint."""
        keys = self.etcd.keys(f"v1/instances/{NAMESPACE}/backend/generate/")
        return {int(key.rsplit("/", 1)[1], 16) for key in keys}

    def served(self) -> list[tuple[int | None, float]]:
        """Each worker's instance id (None before its first request) and the requests
        its generate endpoint served, from its own /metrics."""
        out: list[tuple[int | None, float]] = []
        for worker in self.workers:
            samples = scrape(f"{worker.system_url}/metrics")
            name = "dynamo_component_requests_total"
            ids = {
                int(ls["worker_id"], 16)
                for ls in samples.labels(name)
                if ls.get("dynamo_endpoint") == "generate"
            }
            try:
                count = samples.value(name, dynamo_endpoint="generate")
            except KeyError:  # nothing served yet
                count = 0.0
            out.append((ids.pop() if len(ids) == 1 else None, count))
        return out

    def kv_events_relayed(self) -> int:
        """KV events the workers' bridges handed to Dynamo's publisher so far."""
        name = "bridge_kv_events_relayed_total"
        return int(sum(scrape(f"{w.system_url}/metrics").value(name) for w in self.workers))


def wait_ready(stack: Stack, procs: Sequence[Proc], timeout: float) -> list[str]:
    """Until the fleet is ready by NeMo RL's own rule (``ready_fleet``: its
    ``ManagedDynamoRuntime._wait_for_frontend``, polled each second as it polls);
    the instance ids."""
    return wait_until(
        lambda: ready_fleet(stack.base_url, NAMESPACE, WORKERS, MODEL),
        timeout,
        "NeMo RL's readiness rule: /health generate ids == rl ids, one per worker, "
        "then the model in /v1/models",
        procs,
        1.0,
    )


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replay]:
    root = tmp_path_factory.mktemp("nemo-rl-replay")
    model_dir = tiny_model_dir("base")
    config = json.loads((model_dir / "config.json").read_text())
    with ProcessGroup(root / "logs") as group:
        etcd = Etcd.start(group, root / "etcd")
        nats = Nats.start(group, root / "nats")
        stack = Stack.new(root, group, model_dir, MODEL, NAMESPACE, etcd=etcd, nats=nats)
        # Only ETCD_ENDPOINTS and NATS_SERVER: the flags choose the planes.
        for key in ("DYN_DISCOVERY_BACKEND", "DYN_REQUEST_PLANE", "DYN_EVENT_PLANE"):
            del stack.env[key]
        argv = worker_argv(model_dir, MODEL, NAMESPACE, GLOO, NEMO_RL_PLANES)
        workers = [
            start_worker(
                stack, f"worker-{i}", *argv, *VLLM_ARGS, control_timeout_s=CONTROL_TIMEOUT_S
            )
            for i in range(WORKERS)
        ]
        frontend = stack.start_frontend(*frontend_args(NAMESPACE))
        procs = [*(w.proc for w in workers), frontend]
        wait_ready(stack, procs, 600)
        yield Replay(stack, etcd, workers, int(config["eos_token_id"]), int(config["pad_token_id"]))


# -- NeMo RL's rollouts ------------------------------------------------------------


def nemo_rl_generate(r: Replay, prompts: Sequence[list[int]]) -> list[Completion]:
    """NeMo RL's greedy generate through the frontend: every sample posted at once,
    its budget min(max_new_tokens, max_model_len - prompt length), EOS its stop token."""

    async def run() -> list[Completion]:
        url = f"{r.stack.base_url}/v1/completions"
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(
                *(
                    post(session, url, completion_body(MODEL, p, budget(p), stop_token_ids=[r.eos]))
                    for p in prompts
                )
            )
        for answer in answers:
            assert answer.status == 200, (answer.status, answer.body, answer.error)
        return [parse_completion(a.body) for a in answers]

    def budget(p: list[int]) -> int:
        return min(MAX_NEW_TOKENS, MAX_MODEL_LEN - len(p))

    return asyncio.run(run())


def batch(r: Replay, prompts: Sequence[list[int]], outputs: Outputs) -> GenerationOutput:
    """NeMo RL's GenerationOutputSpec of these rollouts, as the driver lays it out."""
    results = [
        driver.RolloutResult(tokens, logprobs, reason == "length", reason)
        for tokens, logprobs, reason in outputs
    ]
    return assemble(prompts, results, pad_token_id=r.pad)


def completions(done: Sequence[Completion]) -> Outputs:
    return [(c.token_ids, c.logprobs, "length" if c.truncated else "stop") for c in done]


def traffic(r: Replay, send: Callable[[], Any]) -> tuple[Any, list[float]]:
    """What ``send()`` returned and how many requests each worker served for it."""
    before = [count for _, count in r.served()]
    result = send()
    return result, [count - was for (_, count), was in zip(r.served(), before, strict=True)]


def test_both_workers_register_serve_nemo_rl_rollouts_and_route_by_their_kv_events(
    replay: Replay,
) -> None:
    r = replay
    assert len(r.registered()) == WORKERS
    # NeMo RL's readiness rule holds on the ids etcd has: one id per worker for
    # generate and rl alike.
    assert ready_fleet(r.stack.base_url, NAMESPACE, WORKERS, MODEL) == sorted(
        str(i) for i in r.registered()
    )
    if frontend_has_router_reset_states():  # NeMo RL's pinned Dynamo: its argv as is
        assert "--no-router-reset-states" in r.stack.frontend.argv

    # The batch: both workers serve part of it; each row is the prompt, then the
    # generated ids, right-padded; logprobs 0 over the prompt, then float32.
    done, served = traffic(r, lambda: nemo_rl_generate(r, PROMPTS))
    assert sum(served) == len(PROMPTS) and all(served), served
    out = batch(r, PROMPTS, completions(done))
    width = len(PROMPTS[0]) + max(len(c.token_ids) for c in done)
    assert out.output_ids.shape == out.logprobs.shape == (len(PROMPTS), width)
    assert out.logprobs.dtype == np.float32
    for i, (p, c) in enumerate(zip(PROMPTS, done, strict=True)):
        assert 0 < len(c.token_ids) <= MAX_NEW_TOKENS
        row = [*p, *c.token_ids]
        assert out.output_ids[i].tolist() == row + [r.pad] * (width - len(row))
        assert out.logprobs[i, : len(p)].tolist() == [0.0] * len(p)
        gen = out.logprobs[i, len(p) : len(row)]
        assert gen.tobytes() == np.array(c.logprobs, np.float32).tobytes()
        assert out.generation_lengths[i] == len(c.token_ids)
        assert out.unpadded_sequence_lengths[i] == len(row)
        assert out.truncated[i] == c.truncated
        assert not c.truncated or len(c.token_ids) == MAX_NEW_TOKENS

    # Which instance is which worker: the ids the workers' own metrics carry are
    # the ones registered in etcd.
    ids = [instance for instance, _ in r.served()]
    assert None not in ids and set(ids) == r.registered(), (ids, r.registered())

    # New prefixes, until the router placed three on each worker; once their KV
    # events arrived (over NATS), a repeat of each goes to the worker holding it.
    # Repeats are grouped by worker, so that a router that balanced load or
    # alternated would split each group.
    base = r.stack.base_url
    probes = (prompt(200 + s) for s in range(64))
    placed: dict[int, list[list[int]]] = {worker: [] for worker in ids}
    while min(len(prefixes) for prefixes in placed.values()) < 3:
        p = next(probes)
        placed[int(routed_to(base, MODEL, p)["decode_worker_id"])].append(p)
    asyncio.run(settle(r.kv_events_relayed, quiet_s=0.5, within_s=10))
    for worker, prefixes in placed.items():
        for p in prefixes:
            assert int(routed_to(base, MODEL, [*p, 5])["decode_worker_id"]) == worker
    for w in r.workers:
        log = re.sub(r"\x1b\[[0-9;]*m", "", w.proc.log_tail(2_000_000))
        assert "EventPublisher registered with discovery topic=kv-events transport=Nats" in log


# -- NeMo RL's refit ---------------------------------------------------------------


class NemoRlFleet:
    """vLLM's ``VLLMWeightSyncClient`` over the whole fleet, each worker's RL routes
    called with NeMo RL's bodies (its ``DynamoRefitChannel``): the init with the
    rendezvous alone, worker i at ``rank_offset`` = trainer world size + i; the update
    info as its ``prepare_refit_info`` writes it (``"packed": true``, vLLM's default
    buffers on both sides). Each phase runs on every worker at once: the updates
    block in the broadcast until all ranks take part."""

    def __init__(self, urls: Sequence[str], weight_version: str) -> None:
        self.clients = [
            DynamoWeightSyncClient(
                u, weight_version=weight_version, timeout_s=2 * CONTROL_TIMEOUT_S
            )
            for u in urls
        ]
        self.init_bodies: list[dict[str, Any]] = []

    def _on_all(self, call: Callable[[int, DynamoWeightSyncClient], None]) -> None:
        with ThreadPoolExecutor(len(self.clients)) as pool:
            for done in [pool.submit(call, i, c) for i, c in enumerate(self.clients)]:
                done.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        assert init_info["world_size"] == TRAIN_WORLD_SIZE + len(self.clients)
        self.init_bodies = [
            {
                "master_address": init_info["master_address"],
                "master_port": init_info["master_port"],
                "rank_offset": TRAIN_WORLD_SIZE + i,
                "world_size": init_info["world_size"],
            }
            for i in range(len(self.clients))
        ]
        self._on_all(lambda i, c: c.init_weight_transfer_engine(self.init_bodies[i]))

    def start_weight_update(self) -> None:
        self._on_all(lambda _, c: c.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        info = {k: update_info[k] for k in ("names", "dtype_names", "shapes")} | {"packed": True}
        self._on_all(lambda _, c: c.update_weights(info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._on_all(lambda _, c: c.finish_weight_update(weight_version))


def asyncllm_outputs(
    model_dir: Path, prompts: Sequence[list[int]], eos: int
) -> tuple[Outputs, bool]:
    """What vLLM's ``AsyncLLM`` generates on ``model_dir`` directly, one prompt at a
    time: the engine the workers run (the flags above, NeMo RL's seed, processed
    logprobs as the engine server sets them) with NeMo RL's greedy sampling; and
    whether this vLLM gives the same bits when the prompts run all at once (0.32's
    CPU build does; 0.23's gives batch-dependent logprobs, tokens the same)."""
    from engine_server.backends.vllm._env import apply_env_defaults

    apply_env_defaults()  # the CPU build's, as `--backend vllm` gets them
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    async def run() -> Outputs:
        before_engine_start()  # its sockets and EngineCore go with this process
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model_dir),
                max_model_len=MAX_MODEL_LEN,
                enforce_eager=True,
                dtype="float32",
                kv_cache_memory_bytes=64 << 20,
                block_size=BLOCK,
                seed=7,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
            )
        )

        def params_for(p: list[int]) -> Any:
            return SamplingParams(
                temperature=0.0,
                top_p=1.0,
                top_k=1,
                max_tokens=min(MAX_NEW_TOKENS, MAX_MODEL_LEN - len(p)),
                logprobs=0,
                stop_token_ids=[eos],
                include_stop_str_in_output=True,
            )

        async def one(rid: str, p: list[int]) -> tuple[list[int], list[float], str]:
            final: Any = None
            async for output in engine.generate(
                TokensPrompt(prompt_token_ids=p), params_for(p), rid
            ):
                final = output
            c = final.outputs[0]
            tokens = list(c.token_ids)
            logprobs = [c.logprobs[j][t].logprob for j, t in enumerate(tokens)]
            return tokens, logprobs, str(c.finish_reason)

        try:
            alone: Outputs = []
            for i, p in enumerate(prompts):
                alone.append(await one(f"ref-{i}", p))
            await engine.reset_prefix_cache()
            together = await asyncio.gather(*(one(f"all-{i}", p) for i, p in enumerate(prompts)))
        finally:
            engine.shutdown()
        return alone, list(together) == alone

    return asyncio.run(run())


def refit(r: Replay, weights: Path) -> NemoRlFleet:
    """NeMo RL's refit of the fleet to ``weights`` under VERSION, the trainer being
    vLLM's own for ``gloo``, then its cache flush (pause every worker, clearing its
    cache, then resume every worker)."""
    fleet = NemoRlFleet([w.system_url for w in r.workers], VERSION)
    send_gloo_weights(weights, fleet, TRAIN_WORLD_SIZE + len(r.workers))
    flush(fleet)
    return fleet


def flush(fleet: NemoRlFleet) -> None:
    """NeMo RL's cache flush: every worker paused, clearing its cache, then resumed."""
    for c in fleet.clients:
        answer = c.call("pause_generation", {"mode": "wait", "clear_cache": True})
        assert answer["clear_cache"] is True, answer
    for c in fleet.clients:
        c.call("resume_generation", {})


def same_tokens_close_logprobs(got: Outputs, expected: Outputs) -> None:
    """Tokens and finish reasons equal, logprobs within float32 noise: what a vLLM
    whose logprobs depend on the batch gives (the bits are checked one at a time)."""
    for i, ((tokens, logprobs, reason), (want, want_logprobs, want_reason)) in enumerate(
        zip(got, expected, strict=True)
    ):
        assert (tokens, reason) == (want, want_reason), f"rollout {i}"
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=0, atol=1e-4)


def same_bits(got: Outputs, expected: Outputs, dtype: type) -> None:
    """Tokens and finish reasons equal; logprobs equal bit for bit in ``dtype``."""
    for i, ((tokens, logprobs, reason), (want, want_logprobs, want_reason)) in enumerate(
        zip(got, expected, strict=True)
    ):
        assert (tokens, reason) == (want, want_reason), f"rollout {i}"
        as_bits = [np.array(x, dtype).tobytes() for x in (logprobs, want_logprobs)]
        assert as_bits[0] == as_bits[1], f"rollout {i}: {logprobs} != {want_logprobs}"


def test_nemo_rl_refit_of_both_workers_serves_what_asyncllm_serves_on_the_new_weights(
    replay: Replay,
) -> None:
    r = replay
    weights = tiny_weights_dir(1, "base")
    before = completions(nemo_rl_generate(r, PROMPTS))  # cached on the old weights
    expected, batch_invariant = asyncllm_outputs(weights, [*PROMPTS, *DRIVER_PROMPTS], r.eos)
    reference, driver_reference = expected[: len(PROMPTS)], expected[len(PROMPTS) :]
    assert [t for t, _, _ in before] != [t for t, _, _ in reference]  # the weights differ

    fleet = refit(r, weights)
    # One group: the trainer at rank 0, worker i at the trainer's world size + i.
    assert [b["rank_offset"] for b in fleet.init_bodies] == [1, 2]
    assert {b["world_size"] for b in fleet.init_bodies} == {3}
    for c in fleet.clients:
        assert c.call("get_weight_version", {})["version"] == VERSION

    def same_batch(got: Outputs) -> None:
        ours, theirs = batch(r, PROMPTS, got), batch(r, PROMPTS, reference)
        for key, value in theirs.to_dict().items():
            mine = ours.to_dict()[key]
            assert mine.dtype == value.dtype and mine.tobytes() == value.tobytes(), key

    # NeMo RL's batch (the prompts cached before the refit), all at once, on both
    # workers: what AsyncLLM made, bit for bit at NeMo RL's float32, and the same
    # batch, where vLLM's own logprobs do not depend on the batch (0.32); the same
    # tokens where they do (0.23), whose bits are checked one at a time below.
    done, served = traffic(r, lambda: nemo_rl_generate(r, PROMPTS))
    assert sum(served) == len(PROMPTS) and all(served), served
    got = completions(done)
    if batch_invariant:
        same_bits(got, reference, np.float32)
        same_batch(got)
    else:
        same_tokens_close_logprobs(got, reference)

    # The driver's rollouts on both workers, all at once, under VERSION.
    async def rollouts(prompts: Sequence[list[int]]) -> list[driver.RolloutResult]:
        async with driver.RolloutClient(r.stack.base_url, MODEL, timeout_s=120) as client:
            return await asyncio.gather(
                *(
                    client.rollout(p, greedy=True, max_tokens=MAX_NEW_TOKENS, worker_id=True)
                    for p in prompts
                )
            )

    def outputs(results: Sequence[driver.RolloutResult]) -> Outputs:
        return [(x.token_ids, x.logprobs, x.finish_reason) for x in results]

    results = asyncio.run(rollouts(DRIVER_PROMPTS))
    if batch_invariant:
        same_bits(outputs(results), driver_reference, np.float64)
    else:
        same_tokens_close_logprobs(outputs(results), driver_reference)
    assert {x.weight_version for x in results} == {VERSION}
    assert {int(x.worker_id["decode_worker_id"]) for x in results} == r.registered()

    # One request at a time after NeMo RL's flush, as AsyncLLM ran them: bit for bit
    # on any vLLM (NeMo RL's float32, the driver's float64), and NeMo RL's batch.
    flush(fleet)
    alone = [completions(nemo_rl_generate(r, [p]))[0] for p in PROMPTS]
    same_bits(alone, reference, np.float32)
    same_batch(alone)
    driver_alone = [asyncio.run(rollouts([p]))[0] for p in DRIVER_PROMPTS]
    same_bits(outputs(driver_alone), driver_reference, np.float64)


def test_nemo_rl_metrics_sampler_finds_vllm_series_on_each_system_port(replay: Replay) -> None:
    """NeMo RL's ``DynamoMetricsSampler`` scrapes each worker's ``{system_url}/metrics``
    and parses it with its ``parse_prometheus_metrics`` (``sampler_metrics`` here):
    the vLLM series it keeps by default are there, from each worker's own engine."""
    r = replay
    nemo_rl_generate(r, PROMPTS[:2])
    for w in r.workers:
        with urllib.request.urlopen(f"{w.system_url}/metrics", timeout=10) as resp:
            found = sampler_metrics(resp.read().decode())
        for name in (
            "vllm_num_requests_running",
            "vllm_num_requests_waiting",
            "vllm_kv_cache_usage_perc",
            "vllm_prompt_tokens_total",
        ):
            assert name in found, (w.system_url, name, sorted(found))
        assert found["vllm_generation_tokens_total"] > 0, found
        assert 0.0 <= found["vllm_kv_cache_usage_perc"] <= 1.0, found


# -- a child restarted, then NeMo RL's shutdown -------------------------------------


def test_a_restarted_bridge_child_meets_nemo_rl_readiness_again(replay: Replay) -> None:
    """A worker's bridge child killed: its records leave etcd at once (the launcher
    revokes the leases the bridge noted, instead of leaving them for the lease TTL:
    30 s at ai-dynamo 1.6.1), the launcher restarts it under a new instance id, and
    NeMo RL's rule holds again: the new id serves generate and rl, and NeMo RL's
    rollouts reach both workers."""
    r = replay
    before = set(ready_fleet(r.stack.base_url, NAMESPACE, WORKERS, MODEL) or [])
    assert len(before) == WORKERS
    worker = r.workers[0]
    os.kill(worker_children(worker.proc.pid)["bridge"], signal.SIGKILL)
    procs = [w.proc for w in r.workers]
    wait_until(
        lambda: len({str(i) for i in r.registered()} & before) == WORKERS - 1,
        5,
        "the killed bridge's instance gone from etcd (its launcher revoked its leases)",
        procs,
        0.1,
    )
    after = set(
        wait_until(
            lambda: (
                (ids := ready_fleet(r.stack.base_url, NAMESPACE, WORKERS, MODEL))
                and set(ids) != before
                and ids
            ),
            120,
            "NeMo RL's readiness rule, with the restarted bridge's new instance id",
            procs,
            1.0,
        )
    )
    assert len(after - before) == 1 and len(after & before) == 1, (before, after)
    assert after == {str(i) for i in r.registered()}
    _, served = traffic(r, lambda: nemo_rl_generate(r, PROMPTS))
    assert sum(served) == len(PROMPTS) and all(served), served


def test_nemo_rl_shutdown_killpg_sigterm_exits_0_within_15s(replay: Replay) -> None:
    """NeMo RL's worker shutdown: ``os.killpg(pid, SIGTERM)`` on the worker's process
    group, then 15 s before it would SIGKILL: every worker exits 0 within them, and
    leaves discovery."""
    r = replay
    started = time.monotonic()
    for w in r.workers:
        os.killpg(w.proc.pid, signal.SIGTERM)
    codes = [w.proc.wait_exit(15 - (time.monotonic() - started)) for w in r.workers]
    assert codes == [0] * WORKERS, codes
    wait_until(lambda: not r.registered(), 15, "the workers left etcd")
