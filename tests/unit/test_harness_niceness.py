"""A test run started under ``nice`` keeps its processes niced: ``make test`` runs
the BESIDE_SERIAL files at the lowest priority beside the ``serial`` ones, and each
engine, bridge or frontend the harness starts leads a session of its own, which the
kernel's autogroup scheduling would otherwise weigh as any other session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

AUTOGROUP = Path("/proc/self/autogroup")

CHILD = """
import os, sys, tempfile
from pathlib import Path
from harness.procs import Proc
os.nice(int(sys.argv[1]))
with tempfile.TemporaryDirectory() as d:
    proc = Proc("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"], Path(d) / "log")
    try:
        print(Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1])
    finally:
        proc.stop()
"""


def session_nice(niceness: int) -> int:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(niceness)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(run.stdout.strip())


@pytest.mark.skipif(not AUTOGROUP.exists(), reason="the kernel groups no sessions")
def test_a_niced_run_starts_its_processes_in_a_niced_session() -> None:
    assert session_nice(19) == 19
    assert session_nice(5) == 5
