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
niceness = os.nice(int(sys.argv[1]))
with tempfile.TemporaryDirectory() as d:
    proc = Proc("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"], Path(d) / "log")
    try:
        print(niceness, Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1])
    finally:
        proc.stop()
"""


def niced_and_session(increment: int) -> tuple[int, int]:
    """A process niced by ``increment`` starts one through the harness: its own
    niceness and its child's session's."""
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(increment)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    own, session = run.stdout.split()
    return int(own), int(session)


@pytest.mark.skipif(not AUTOGROUP.exists(), reason="the kernel groups no sessions")
@pytest.mark.parametrize("increment", [19, 5])
def test_a_niced_run_starts_its_processes_in_a_niced_session(increment: int) -> None:
    own, session = niced_and_session(increment)
    assert own > 0
    assert session == own
