"""Real processes for end-to-end tests: engine servers, bridges, Dynamo frontends.

Each runs as a subprocess with its output in a log file, and is stopped
(SIGTERM, then SIGKILL) when its ``ProcessGroup`` closes, so tests and
later fault-injection tests can start, kill and restart pieces at will.
Everything binds to loopback; Dynamo uses file discovery in a private folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCKERS_DIR = Path(__file__).resolve().parent / "blockers"


def free_port() -> int:
    """A port free right now (for programs that cannot report the port they bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_system_port() -> int:
    """A free port below 32768: Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an i16."""
    for _ in range(200):
        port = random.randint(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


def health_env(system_port: int, canary_wait_s: int = 1) -> dict[str, str]:
    """Environment for a worker serving Dynamo's ``/health`` on ``system_port``, with
    the runtime's canary probing the bridge's endpoint after ``canary_wait_s`` idle."""
    return {
        "DYN_SYSTEM_PORT": str(system_port),
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "DYN_CANARY_WAIT_TIME": str(canary_wait_s),
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1",
    }


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def group_alive(pgid: int) -> bool:
    """Whether any process of the session ``pgid`` (a Proc's own) still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dynamo_env(kv_dir: Path, **extra: str) -> dict[str, str]:
    """Environment for Dynamo processes on one machine: file discovery, TCP requests,
    ZMQ events, loopback only, offline."""
    return {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(kv_dir),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "NO_COLOR": "1",
        **extra,
    }


def blocking_env(*packages: str) -> dict[str, str]:
    """Environment whose Python fails to import ``packages`` (tests/blockers)."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(BLOCKERS_DIR), str(ROOT), path) if p),
        "BLOCKED_IMPORTS": ",".join(packages),
    }


class Proc:
    """One subprocess with its log; ``stop()`` is idempotent."""

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # closed in stop()
        self.popen = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(
                f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}"
            )

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(10)

    def wait_exit(self, timeout: float) -> int:
        """The exit code once it ends; raises TimeoutError (with its log) if it does not."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"{self.name} still running after {timeout}s:\n{self.log_tail()}"
            ) from None


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    procs: Sequence[Proc] = (),
    interval: float = 0.1,
) -> Any:
    """Poll ``predicate`` until truthy; fail early if one of ``procs`` died."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in procs:
            proc.check_alive()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name} ---\n{p.log_tail(2000)}" for p in procs)
            raise TimeoutError(f"{what}: not within {timeout}s\n{logs}")
        time.sleep(interval)


def http_json(
    url: str, body: dict[str, Any] | None = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """GET (or POST ``body``) and parse the JSON answer; (status, body) also on errors."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, None
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class ProcessGroup:
    """Processes started for one test or session; closing stops them in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop()

    def get(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, self.log_dir / f"{name}.log", env)
        self.procs.append(proc)
        return proc

    # -- the three programs --------------------------------------------------

    def engine_server(
        self,
        name: str,
        *args: str,
        backend: str = "sim",
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        listen: str = "127.0.0.1:0",
        launcher: Sequence[str] = (),
    ) -> tuple[Proc, str]:
        """``python -m engine_server`` (on a free port unless ``listen`` says otherwise);
        returns (proc, address) once it reports its address. ``launcher``: a script
        put before ``-m`` that runs the module itself (tests/faults/skewed_revision.py)."""
        ready = self.log_dir / f"{name}.addr"
        ready.unlink(missing_ok=True)
        proc = self.spawn(
            name,
            [
                sys.executable,
                *launcher,
                "-m",
                "engine_server",
                "--backend",
                backend,
                "--listen",
                listen,
                "--ready-file",
                str(ready),
                *args,
            ],
            env,
        )
        wait_until(
            lambda: ready.exists() and ready.read_text().strip(), timeout, f"{name} address", [proc]
        )
        return proc, ready.read_text().strip()

    def bridge(
        self,
        name: str,
        engine_address: str,
        model_dir: Path,
        served_model_name: str,
        namespace: str,
        env: dict[str, str],
        *args: str,
        launcher: Sequence[str] = (),
    ) -> Proc:
        return self.spawn(
            name,
            [
                sys.executable,
                *launcher,
                "-m",
                "bridge",
                "--engine",
                engine_address,
                "--model-path",
                str(model_dir),
                "--served-model-name",
                served_model_name,
                "--namespace",
                namespace,
                *args,
            ],
            env,
        )

    def frontend(
        self, name: str, env: dict[str, str], *args: str, port: int | None = None
    ) -> tuple[Proc, str]:
        port = port or free_port()
        proc = self.spawn(
            name,
            [
                sys.executable,
                "-m",
                "dynamo.frontend",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(port),
                *args,
            ],
            env,
        )
        return proc, f"http://127.0.0.1:{port}"


def served_models(base_url: str) -> list[str]:
    status, body = http_json(f"{base_url}/v1/models", timeout=5)
    if status != 200 or not isinstance(body, dict):
        return []
    return [m["id"] for m in body.get("data", [])]


def registered_workers(kv_dir: Path, namespace: str) -> int:
    """Worker instances registered for ``namespace``'s generate endpoint (file discovery)."""
    instances = kv_dir / "v1" / "instances"
    if not instances.is_dir():
        return 0
    prefix = f"{namespace}%2F"
    return sum(
        1
        for p in instances.rglob("*")
        if p.is_file() and p.name.startswith(prefix) and "%2Fgenerate%2F" in p.name
    )


def wait_for_model(base_url: str, model: str, procs: Sequence[Proc], timeout: float = 60.0) -> None:
    wait_until(
        lambda: model in served_models(base_url), timeout, f"model {model} at {base_url}", procs
    )


def tiny_model_dir() -> Path:
    """The tiny offline model (tokenizer, config, random weights); built once, then cached."""
    out = ROOT / ".artifacts" / "tiny-model"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), "--out", str(out)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return out


@contextlib.contextmanager
def open_sse_stream(
    base_url: str, body: dict[str, Any], events: int = 3, timeout: float = 30
) -> Any:
    """POST a streaming /v1/completions over a raw socket, read ``events`` SSE events,
    and on leaving the block drop the connection without a word: a client that dies
    mid-stream, which aiohttp or urllib would not let us imitate as bluntly."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
        received = b""
        while received.count(b"data:") < events:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"stream closed after {received[-500:]!r}")
            received += chunk
        yield received
