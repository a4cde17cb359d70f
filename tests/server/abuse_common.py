"""What the abuse tests share: a server with chosen admission limits, the peak RSS
of a process sampled in a thread, and GetLoad's latency seen from a process of
its own (tests/server/getload_probe.py)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from harness import ROOT
from harness.engine import InProcessServer, sim_cli_args


def server_with_limits(*args: str, **limits: int) -> InProcessServer:
    """An in-process sim server (``args``: more CLI flags) with these admission limits
    (``Limits`` field names), started."""
    from engine_server import cli

    backend, config = cli.backend_and_config(cli.parse_args(sim_cli_args(*args)))
    config = dataclasses.replace(config, limits=dataclasses.replace(config.limits, **limits))
    return InProcessServer(backend, config).start()


class PeakRss:
    """``with PeakRss(pid) as rss: ...``: the process's RSS before (``base``) and its
    highest while the block ran (``peak``), sampled every ``interval`` s."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self._process = psutil.Process(pid)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.base = self.peak = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._process.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(self._interval)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 1e6

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        self._stop.set()
        self._thread.join(5)


class GetLoadProbe:
    """``with GetLoadProbe(address, out) as probe: ...``: another process asks GetLoad
    every 10 ms while the block runs; ``probe.result`` then holds its calls, errors
    and worst latency (``worst_ms``)."""

    def __init__(self, address: str, out: Path, interval_s: float = 0.01) -> None:
        self._argv = [
            sys.executable,
            "-m",
            "tests.server.getload_probe",
            address,
            str(out),
            str(interval_s),
        ]
        self._out = out
        self._proc: subprocess.Popen[str] | None = None
        self.result: dict[str, Any] = {}

    def __enter__(self) -> GetLoadProbe:
        self._out.unlink(missing_ok=True)
        self._proc = subprocess.Popen(self._argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if line != "ready":
            self._proc.kill()
            raise RuntimeError(f"GetLoad probe did not start: {line!r}")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        proc = self._proc
        assert proc is not None
        # Let it take a few more samples of the server at rest.
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        self.result = json.loads(self._out.read_text())

    @property
    def worst_ms(self) -> float:
        return float(self.result["worst_ms"])

    def summary(self, since: float | None = None) -> str:
        """The figures, for an assertion message (``since``: a ``time.monotonic()``
        the worst call's start is given relative to)."""
        latencies = sorted(self.result["latencies_ms"])
        at = ""
        if since is not None:
            at = f" (started {self.result['worst_at'] - since:+.3f} s after the load began)"
        return (
            f"{self.result['calls']} GetLoad calls, worst {self.worst_ms:.1f} ms{at}, "
            f"slowest ten {latencies[-10:]}, errors {self.result['errors'][:3]}"
        )


def server_cost(rss: PeakRss, probe: GetLoadProbe) -> dict[str, float]:
    """What an abuse cost the server, for ``record``: its RSS before and at the peak
    (MB), and the GetLoad calls the probe made and the slowest of them (ms)."""
    return {
        "rss_before_mb": round(rss.base / 1e6, 1),
        "rss_peak_mb": round(rss.peak / 1e6, 1),
        "getload_calls": probe.result["calls"],
        "getload_worst_ms": round(probe.worst_ms, 1),
    }
