"""What every part of the bench uses: its options, a scratch folder, the tiny
model and its prompts, and the processes (one Dynamo frontend for all parts,
the simulated engine servers parts 1 and 2 share)."""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.http import wait_for_model
from harness.procs import Proc, ProcessGroup, Role
from harness.progress import waiting
from harness.stack import Stack
from harness.tiny_model import tiny_model_dir

PROMPT_TOKENS = 64
GEN_TOKENS = 32
CONCURRENCY = (1, 16, 64, 256)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass(frozen=True)
class Options:
    reps: int
    quick: bool
    # Extra flags for the sim engine servers of parts 1 and 2.
    engine_server_args: tuple[str, ...] = ()
    # The aiperf command part 8 runs ("": the README's .aiperf/bin/aiperf, if any).
    aiperf: str = ""


@dataclass(frozen=True)
class SimEngine:
    proc: Proc
    address: str


class Bench:
    def __init__(self, options: Options, root: Path, group: ProcessGroup) -> None:
        self.options = options
        self.root = root
        self.group = group
        # Bridges import what they like here: the dependency rule is the tests' job.
        self.stack = Stack.new(root, group, tiny_model_dir(), "bench", bridge_blocks=())
        config = json.loads((self.model_dir / "config.json").read_text())
        self.prompts = prompts(4096, int(config["vocab_size"]))
        self._sim_engines: dict[str, SimEngine] = {}

    @property
    def model_dir(self) -> Path:
        return self.stack.model_dir

    def start_frontend(self) -> str:
        """Dynamo's frontend, started on first use and kept for every part; its URL."""
        if self.stack.frontend is None:
            self.stack.start_frontend()
        return self.stack.base_url

    def frontend(self) -> Proc:
        self.start_frontend()
        assert self.stack.frontend is not None
        return self.stack.frontend

    def requests_for(self, concurrency: int) -> int:
        n = {1: 300, 16: 800, 64: 1280, 256: 2048}[concurrency]
        return max(concurrency, n // 8) if self.options.quick else n

    def sim_args(self) -> list[str]:
        """The zero-delay sim engine of parts 1 and 2: exactly GEN_TOKENS tokens out."""
        return [
            "--model",
            str(self.model_dir),
            "--zero-delay",
            "--eos-rate",
            "0",
            "--max-new-tokens",
            str(GEN_TOKENS),
        ]

    # -- processes -----------------------------------------------------------

    def sim_engines(self) -> dict[str, SimEngine]:
        """The sim engine servers of parts 1 and 2, on TCP (``tcp``) and on a unix
        socket (``unix``); started on first use."""
        if not self._sim_engines:
            args = [*self.sim_args(), *self.options.engine_server_args]
            with waiting("  sim engine servers starting"):
                tcp = self.group.engine_server("engine-tcp", *args)
                sock = self.root / "engine.sock"
                unix = self.group.engine_server("engine-unix", *args, listen=f"unix:{sock}")
            self._sim_engines = {"tcp": SimEngine(*tcp), "unix": SimEngine(*unix)}
        return self._sim_engines

    def own_sim_engine(self, name: str) -> SimEngine:
        """One more sim engine server on TCP, for one bridge alone (the caller stops
        it): a deployment pairs each bridge with its own engine server, and an
        engine server that streams its KV events to several bridges, each relaying
        them to Dynamo, would charge the configuration measured for all of them."""
        args = [*self.sim_args(), *self.options.engine_server_args]
        with waiting(f"  sim engine server {name} starting"):
            return SimEngine(*self.group.engine_server(f"engine-{name}", *args))

    def stop_sim_engines(self) -> None:
        self.stop(*(e.proc for e in self._sim_engines.values()))
        self._sim_engines = {}

    def start_bridge(self, name: str, engine_address: str, *extra: str) -> Proc:
        """A bridge serving model ``name`` (namespace ``ns-<name>``)."""
        return self.stack.start_bridge(
            f"bridge-{name}",
            engine_address,
            "--log-level",
            "warning",
            *extra,
            model=name,
            namespace=f"ns-{name}",
        )

    def start_worker(self, name: str, engine_args: Sequence[str]) -> Proc:
        """(a): a Dynamo worker serving the sim engine in its own process, as model ``name``."""
        argv = [
            sys.executable,
            "-m",
            "bench.inprocess_engine",
            "--model-path",
            str(self.model_dir),
            "--served-model-name",
            name,
            "--namespace",
            f"ns-{name}",
            "--log-level",
            "warning",
            "--",
            "--backend",
            "sim",
            *engine_args,
        ]
        return self.group.spawn(f"worker-{name}", argv, self.stack.env, Role.WORKER)

    def wait_models(self, names: Sequence[str], timeout: float = 120.0) -> None:
        with waiting(f"  workers starting, {', '.join(names)} registering"):
            for name in names:
                wait_for_model(self.stack.base_url, name, self.group.procs, timeout)

    def stop(self, *procs: Proc) -> None:
        """Stop processes a part is done with, so idle ones do not weigh on later parts."""
        self.group.stop(*procs)


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(count)]
