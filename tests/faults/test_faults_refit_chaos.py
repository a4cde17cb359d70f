"""Issue 37: a fleet refit that no race, cancellation or hang can break.

Two sim engine servers (real processes) behind two real bridges and a Dynamo
frontend, one committed record in Dynamo's file store. Each round, from a
fixed seed (``CHAOS_SEED``; ``CHAOS_ROUNDS``, default 50): two trainers (one
over the bridges' RL routes, one over the contract) refit the fleet at once,
0-10 ms apart or one after the other; one of them may be cancelled part way;
an engine may be SIGSTOPped past the pause deadline and continued; a trainer
streaming weights may be SIGKILLed mid-stream (the sim has no gloo group: the
same peer death, on the contract's tensor stream; a revision-13 stream, its end
announced, as ``EngineRefitClient`` sends: a revision-12 stream's death that the
server learns of over 0.1 s late still commits, docs/contract.md). After every
round:

- the store holds the version some trainer last reported committed;
- every engine serves that version, resumed, outputs bit-exact to a fresh
  engine loaded with that checkpoint;
- every worker whose engine serves is in the router's pool, and the frontend
  lists the model.

The round's figures go to ``.artifacts/faults/refit_chaos.json``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from engine_server.backends.sim import SimBackend
from engine_server.config import ServerConfig
from harness.checkpoints import tiny_weights_dir
from harness.engine import InProcessServer, greedy_rollout, tokens_and_logprobs
from harness.ports import free_system_port
from harness.procs import Proc, ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client.committed import (
    CheckpointSource,
    CommittedRecord,
    CommittedWeights,
    FileCommittedStore,
)
from rl_client.fleet_lease import LeaseHeld
from rl_client.refit import EngineRefitClient, RefitClient
from rl_client.refit_report import Deadlines, RefitError
from tests.faults.faults_common import prompt, record

pytestmark = [pytest.mark.slow, pytest.mark.dynamo]

MODEL = "tiny-chaos"
NAMESPACE = "nschaos"
WORKERS = 2
SIM_ARGS = ("--eos-rate", "0", "--decode-step-ms", "1")
ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "50"))
SEED = int(os.environ.get("CHAOS_SEED", "37"))
CHECKPOINTS = (1, 2, 3)
# A pause gives up well before a stopped engine continues; every other step
# outlasts the longest stop, so what a stop delays still ends.
DEADLINES = Deadlines(pause_s=1.0, update_s=20, rollback_s=20, control_s=8, lease_s=3)
STOP_S = (1.5, 2.5)
# A trainer that streams a checkpoint to one engine and dies part way, before the
# end message its manifest announced.
STREAMER = """
import sys, time, grpc
from engine_contract.tensors import update_requests
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import checkpoint_tensors
from pathlib import Path

def stream():
    yield from list(update_requests(
        checkpoint_tensors(Path(sys.argv[2])), allow_unpaused=True,
        reset_prefix_cache=False, chunk_bytes=4096, end_marker=True,
    ))[:-1]
    time.sleep(3600)

stub = pb_grpc.EngineServiceStub(grpc.insecure_channel(sys.argv[1]))
print("streaming", flush=True)
stub.UpdateWeightsFromTensors(stream())
"""


def reference_outputs(model_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Each checkpoint's greedy rollouts on a fresh engine: what every worker on it
    must give, bit for bit."""
    outputs = {}
    for name, path in [("start", model_dir)] + [(str(k), tiny_weights_dir(k)) for k in CHECKPOINTS]:
        server = InProcessServer(
            SimBackend(model=str(model_dir), zero_delay=True, eos_rate=0.0),
            ServerConfig(listen="127.0.0.1:0"),
        ).start()
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.EngineServiceStub(channel)
                stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))
                stub.UpdateWeightsFromPath(pb.UpdateWeightsFromPathRequest(path=str(path)))
                stub.ResumeGeneration(pb.ResumeGenerationRequest())
                outputs[name] = tokens_and_logprobs(greedy_rollout(stub, prompt(0), 16))
        finally:
            server.stop()
    return outputs


@dataclass
class Fleet:
    urls: list[str]
    addresses: list[str]
    store: FileCommittedStore


async def refit(
    who: str,
    offset: float,
    version: str,
    path: str,
    fleet: Fleet,
    committed: list[tuple[float, str]],
    tally: Counter[str],
) -> None:
    """One trainer's refit: A over the bridges' RL routes, B over the contract."""
    await asyncio.sleep(offset)
    trainer: RefitClient | EngineRefitClient
    if who == "A":
        trainer = RefitClient(fleet.urls, store=fleet.store, deadlines=DEADLINES)
    else:
        trainer = EngineRefitClient(fleet.addresses, store=fleet.store, deadlines=DEADLINES)
    try:
        if isinstance(trainer, RefitClient):
            await trainer.refit(path, version, mode="abort")
        else:
            await trainer.refit(version, path=path, mode="abort")
        committed.append((time.monotonic(), version))
        tally["committed"] += 1
    except LeaseHeld:
        tally["refused: lease held"] += 1
    except RefitError:
        tally["failed, rolled back"] += 1
    except asyncio.CancelledError:
        # Cancelled past the commit point, the refit committed: its report says so.
        report = trainer.last_report
        if report is not None and report.version == version and report.committed:
            committed.append((time.monotonic(), version))
            tally["cancelled after committing"] += 1
        raise
    finally:
        await trainer.close()


async def chaos(
    engines: list[Proc], stop: tuple[int, float, float] | None, tally: Counter[str]
) -> None:
    """An engine stopped (SIGSTOP) for a while, then continued."""
    if stop is not None:
        worker, after, length = stop
        await asyncio.sleep(after)
        engines[worker].signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(length)
        finally:
            engines[worker].signal(signal.SIGCONT)
        tally["engine stopped"] += 1


async def test_refit_chaos(tmp_path: Path, model_dir: Path) -> None:
    expected = reference_outputs(model_dir)
    rng = random.Random(SEED)
    tally: Counter[str] = Counter()
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL, NAMESPACE)
        store = FileCommittedStore(stack.kv_dir, NAMESPACE)
        store.publish(CommittedRecord(CommittedWeights("start", CheckpointSource(str(model_dir)))))
        engines, addresses, urls = [], [], []
        for i in range(WORKERS):
            proc, address = stack.start_engine(f"engine-{i}", *SIM_ARGS)
            port = free_system_port()
            stack.start_bridge(f"bridge-{i}", address, "--enable-rl", DYN_SYSTEM_PORT=str(port))
            engines.append(proc)
            addresses.append(address)
            urls.append(f"http://127.0.0.1:{port}")
        stack.start_frontend()
        stack.wait_serving(WORKERS)
        channels = [grpc.insecure_channel(a) for a in addresses]
        stubs = [pb_grpc.EngineServiceStub(c) for c in channels]
        sources = {"start": str(model_dir)} | {
            str(k): str(tiny_weights_dir(k)) for k in CHECKPOINTS
        }
        last_committed = "start"
        started = time.monotonic()
        for round_ in range(ROUNDS):
            committed: list[tuple[float, str]] = []
            choice = {who: rng.choice(CHECKPOINTS) for who in "AB"}
            offsets = {"A": rng.uniform(0, 0.01), "B": rng.uniform(0, 0.01)}
            if rng.random() < 0.2:
                offsets["B"] += 0.6  # one after the other
            cancel_after = rng.uniform(0.0, 0.15) if rng.random() < 0.3 else None
            stopping = (rng.randrange(WORKERS), rng.uniform(0, 0.05), rng.uniform(*STOP_S))
            stop = stopping if rng.random() < 0.2 else None
            stream_to = rng.randrange(WORKERS) if rng.random() < 0.15 else None

            streamer = None
            if stream_to is not None:
                streamer = subprocess.Popen(
                    [sys.executable, "-c", STREAMER, addresses[stream_to], sources["3"]],
                    stdout=subprocess.PIPE,
                    env={**os.environ, "PYTHONPATH": os.getcwd()},
                )
                assert streamer.stdout is not None
                await asyncio.to_thread(streamer.stdout.readline)
            tasks = [
                asyncio.ensure_future(
                    refit(
                        who,
                        offsets[who],
                        f"{who}{round_}-{choice[who]}",
                        sources[str(choice[who])],
                        Fleet(urls, addresses, store),
                        committed,
                        tally,
                    )
                )
                for who in "AB"
            ]
            if streamer is not None:
                await asyncio.sleep(0.05)
                streamer.kill()
                streamer.wait()
                tally["streaming trainer killed"] += 1
            if cancel_after is not None:
                await asyncio.sleep(cancel_after)
                tasks[0].cancel()
                tally["cancelled"] += 1
            results = await asyncio.gather(
                *tasks, chaos(engines, stop, tally), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException) and not isinstance(
                    result, asyncio.CancelledError
                ):
                    raise result
            if committed:
                last_committed = max(committed)[1]
            # -- after every round ------------------------------------------------
            current = store.read()
            assert current is not None and current.weights.version == last_committed, (
                round_,
                committed,
            )
            checkpoint = last_committed.rsplit("-", 1)[-1] if "-" in last_committed else "start"
            states = [s.GetLoad(pb.GetLoadRequest(), timeout=20).refit_state for s in stubs]
            assert [(st.weight_version, st.paused, st.sleeping) for st in states] == [
                (last_committed, False, False)
            ] * WORKERS, (round_, tally)
            for stub in stubs:
                assert (
                    tokens_and_logprobs(greedy_rollout(stub, prompt(0), 16))
                    == (expected[checkpoint])
                ), round_
            wait_until(
                lambda: stack.registered_workers() == WORKERS,
                15,
                f"every serving worker in the pool after round {round_}",
                stack.procs,
            )
        stack.wait_models([MODEL])
        for channel in channels:
            channel.close()
    print(f"\n{ROUNDS} rounds (seed {SEED}) in {time.monotonic() - started:.1f} s: {dict(tally)}")
    record(
        "refit_chaos",
        rounds=ROUNDS,
        seed=SEED,
        seconds=round(time.monotonic() - started, 1),
        **{k.replace(" ", "_").replace(",", "").replace(":", ""): v for k, v in tally.items()},
    )
