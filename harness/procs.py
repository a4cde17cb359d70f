"""Real processes: engine servers, bridges, Dynamo frontends and helpers.

Each runs as a subprocess in its own session with its output in a log file,
has a ``Role``, and is stopped (SIGTERM, then SIGKILL) when its
``ProcessGroup`` closes, in reverse order of start, so tests can start, kill
and restart pieces at will. Everything binds to loopback.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bridge.logging import SKIP_SGLANG_LOGGING_ENV
from harness import ROOT
from harness.ports import free_port
from harness.waits import wait_until


class Role(enum.Enum):
    """What a process is to the system under test (the benchmark's CPU accounting
    goes by it)."""

    ENGINE_SERVER = "engine"
    BRIDGE = "bridge"
    FRONTEND = "frontend"
    # A Dynamo worker serving an engine in its own process (the benchmark's
    # one-process design), or a program driving an engine directly.
    WORKER = "worker"
    OTHER = "other"


def keep_niceness(pid: int) -> None:
    """Give the new session ``pid`` leads this process's niceness.

    Where the kernel groups processes by session for scheduling (autogroup, on by
    default on many distributions), a process's nice value only ranks it within its
    session: a test run started under ``nice`` would otherwise start every engine,
    bridge and frontend at full weight. Linux's ``/proc/PID/autogroup`` takes the
    session's nice value; elsewhere nothing is done."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness <= 0:
        return
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(niceness))


class Proc:
    """One subprocess with its log; ``stop()`` is idempotent."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        role: Role = Role.OTHER,
    ) -> None:
        self.name = name
        self.role = role
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
        keep_niceness(self.popen.pid)

    def __repr__(self) -> str:
        return f"Proc({self.name!r}, {self.role.value}, pid {self.pid})"

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

    def signal_until_exit(self, sig: int, timeout: float, every_s: float = 0.002) -> int:
        """Send ``sig`` every ``every_s`` until it exits, as a supervisor repeating a
        stop does (up to its very end); its exit code."""
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} still running after {timeout}s:\n{self.log_tail()}"
                )
            self.signal(sig)
            time.sleep(every_s)
        return self.wait_exit(5)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
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


class ProcessGroup:
    """Processes started for one test, session or run; closing stops them in reverse order."""

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

    def with_role(self, role: Role) -> list[Proc]:
        return [p for p in self.procs if p.role is role]

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        role: Role = Role.OTHER,
    ) -> Proc:
        proc = Proc(name, argv, self.log_dir / f"{name}.log", env, role)
        self.procs.append(proc)
        return proc

    def stop(self, *procs: Proc) -> None:
        """Stop ``procs`` now and forget them (so idle ones weigh on nothing later)."""
        for proc in procs:
            proc.stop()
            self.procs.remove(proc)

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
        ready_file: bool = True,
    ) -> tuple[Proc, str]:
        """``python -m engine_server`` (on a free port unless ``listen`` says
        otherwise); returns (proc, address) once it has written its address to
        ``--ready-file``. ``ready_file=False``: the command as given, no such flag,
        returned at once (``listen`` must then name the port; wait for it with
        ``harness.engine.wait_serving``). ``launcher``: a script put before ``-m``
        that runs the module itself (tests/faults/skewed_revision.py)."""
        argv = [
            sys.executable,
            *launcher,
            "-m",
            "engine_server",
            "--backend",
            backend,
            "--listen",
            listen,
            *args,
        ]
        if not ready_file:
            return self.spawn(name, argv, env, Role.ENGINE_SERVER), listen
        ready = self.log_dir / f"{name}.addr"
        ready.unlink(missing_ok=True)
        proc = self.spawn(name, [*argv, "--ready-file", str(ready)], env, Role.ENGINE_SERVER)
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
        """``python -m bridge`` in front of ``engine_address``; returns at once."""
        argv = [
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
        ]
        return self.spawn(name, argv, env, Role.BRIDGE)

    def frontend(
        self, name: str, env: dict[str, str], *args: str, port: int | None = None
    ) -> tuple[Proc, str]:
        """``python -m dynamo.frontend`` on ``port`` (a free one by default); returns
        (proc, base URL) at once. Without SGLang's logging config, which Dynamo
        would write to a new temporary file at each start and never remove."""
        port = port or free_port()
        env = {SKIP_SGLANG_LOGGING_ENV: "1", **env}
        argv = [
            sys.executable,
            "-m",
            "dynamo.frontend",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(port),
            *args,
        ]
        return self.spawn(name, argv, env, Role.FRONTEND), f"http://127.0.0.1:{port}"


def worker_children(pid: int) -> dict[str, int]:
    """An ``engine_worker`` launcher's live children by kind ("engine-server", "bridge")."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) != pid or fields[0] == "Z":
            continue
        if b"engine_worker.flags" in cmdline:
            # A flag listing; the engine side's becomes the first engine server.
            if b"--serve" in cmdline:
                found["engine-server"] = int(entry.name)
        elif b"engine_server" in cmdline:
            found["engine-server"] = int(entry.name)
        elif b"bridge" in cmdline:
            found["bridge"] = int(entry.name)
    return found


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
