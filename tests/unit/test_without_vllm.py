"""``pytest -m "not vllm"`` where vLLM (and torch) cannot be imported: the whole
suite collects, with no collection error. (Once, a ``tests/vllm`` folder answered
``find_spec("vllm")``, so the skip guard never fired and collection crashed.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import ROOT
from harness.env import blocking_env

pytestmark = pytest.mark.slow


def test_the_suite_collects_without_vllm_or_torch() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "not vllm",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env={**os.environ, **blocking_env("vllm", "torch")},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "tests collected" in summary and "error" not in summary, summary
    # The vLLM tests were skipped, not collected: nothing here imported vLLM.
    assert "tests/vllm_engine/" not in out.stdout
