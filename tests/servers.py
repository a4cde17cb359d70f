"""Engine servers for tests: in-process (own thread and loop) or the CLI as a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


class InProcessServer:
    """An engine server on its own event loop in a daemon thread of this process.

    Its own loop keeps it independent of pytest-asyncio's per-test loops, while
    still being in-process (real gRPC over a real socket).
    """

    def __init__(self, backend: Any, config: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.handle: Any = None
        self._backend = backend
        self._config = config

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def start(self, wait_ready: bool = True) -> InProcessServer:
        from engine_server.server import start_server

        self.handle = self.run(start_server(self._backend, self._config))
        if wait_ready:
            self.run(self.handle.wait_ready())
        return self

    @property
    def address(self) -> str:
        return str(self.handle.address)

    def stop(self, grace: float = 0) -> None:
        if self.handle is not None:
            self.run(self.handle.stop(grace))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class ServerProcess:
    """``python -m engine_server ...`` as a subprocess, logs to a file."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.ready_file = log_path.with_suffix(".addr")
        self.ready_file.unlink(missing_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine_server", *args, "--ready-file", str(self.ready_file)],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.address = ""

    def wait_ready(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists() and self.ready_file.read_text().strip():
                self.address = self.ready_file.read_text().strip()
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine server exited with {self.proc.returncode}:\n{self.log_text()}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"engine server not ready in {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def sim_cli_args(*extra: str) -> list[str]:
    return ["--backend", "sim", "--listen", "127.0.0.1:0", *extra]


def wait_for_load(address: str, predicate: Any, timeout: float = 5.0) -> pb.GetLoadResponse:
    """Poll GetLoad until ``predicate(load)`` holds; return the last answer either way."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        deadline = time.monotonic() + timeout
        while True:
            load = stub.GetLoad(pb.GetLoadRequest(), timeout=5)
            if predicate(load) or time.monotonic() > deadline:
                return load
            time.sleep(0.02)
