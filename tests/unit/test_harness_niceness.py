"""A test run started under ``nice`` keeps its processes niced: ``make test`` runs
the BESIDE_SERIAL files at the lowest priority beside the ``serial`` ones, and each
engine, bridge or frontend the harness starts leads a session of its own, which the
kernel's autogroup scheduling would otherwise weigh as any other session."""

from __future__ import annotations

import os
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


REPORT = """
import os
from pathlib import Path
group = Path("/proc/self/autogroup")
print(os.getsid(0), os.getpriority(os.PRIO_PROCESS, 0),
      group.read_text().split()[-1] if group.exists() else "-")
"""


def lowest_priority(**popen: object) -> tuple[int, int, str]:
    """A command run through ``harness.lowest_priority``: its session, niceness and
    session group's niceness ("-" where the kernel groups no sessions)."""
    argv = [sys.executable, "-m", "harness.lowest_priority", sys.executable, "-c", REPORT]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen) as proc:  # type: ignore[call-overload]
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    session, niceness, group = out.split()
    return int(session), int(niceness), group


@pytest.mark.parametrize("leader", [False, True], ids=["in-a-group", "leading-a-group"])
def test_lowest_priority_runs_a_command_niced_in_a_niced_session_of_its_own(
    leader: bool,
) -> None:
    """``make test`` runs BESIDE_SERIAL so: niced within the harness's own session,
    those files' busy processes would take a session's share of the CPU from the
    engine servers the ``serial`` tests start. A shell with job control runs each
    command as a process group's leader, which cannot start a session."""
    session, niceness, group = lowest_priority(process_group=0 if leader else None)
    assert session != os.getsid(0)
    assert niceness == 19
    assert group == ("19" if AUTOGROUP.exists() else "-")


def test_lowest_priority_gives_the_commands_exit_status() -> None:
    argv = [sys.executable, "-m", "harness.lowest_priority", "sh", "-c", "exit 3"]
    assert subprocess.run(argv, timeout=60, process_group=0).returncode == 3
    assert subprocess.run(argv, timeout=60).returncode == 3
