"""Item 8: a one-minute soak (``make soak`` runs ten): mixed rollouts, streams,
aborts and disconnects; no leaked requests and flat RSS at the end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from procs import ROOT

pytestmark = [pytest.mark.dynamo, pytest.mark.slow]


def test_soak_one_minute() -> None:
    out = ROOT / ".artifacts" / "soak-60s.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "soak.py"),
            "--duration-s",
            "60",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    print(run.stdout[-6000:])
    figures = json.loads(out.read_text())
    assert figures["leaked_requests"] == 0, figures["final_loads"]
    assert not figures["unexpected"], figures["unexpected"]
    assert figures["all_alive"]
    assert figures["requests"] > 100
    assert figures["worst_rss_growth_pct"] <= 10.0, figures["rss"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
