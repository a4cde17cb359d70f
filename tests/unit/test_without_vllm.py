"""``pytest -m "not vllm"`` where vLLM (and torch) cannot be imported: the whole
suite collects, with no collection error, and the vLLM tests skip themselves.
(Once, a ``tests/vllm`` folder answered ``find_spec("vllm")``, so the skip guard
never fired and collection crashed.)

ai-dynamo's own pytest plugin (``vllm_tests``) ignores every ``test_vllm_*.py``
where vLLM is missing; it is switched off here, so that what is proven is our
own guard, which is all an install without Dynamo has."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import ROOT
from harness.env import blocking_env

pytestmark = pytest.mark.slow


def pytest_without_vllm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:vllm_tests", *args],
        cwd=ROOT,
        env={**os.environ, **blocking_env("vllm", "torch")},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_suite_collects_without_vllm_or_torch() -> None:
    out = pytest_without_vllm("--collect-only", "-q", "-m", "not vllm")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "tests collected" in summary and "error" not in summary, summary
    assert "tests/vllm_engine/" not in out.stdout  # skipped: nothing imported vLLM


def test_the_vllm_tests_skip_themselves() -> None:
    out = pytest_without_vllm("-q", "-rs", "tests/vllm_engine")
    # 5: no test collected, every module skipped at import.
    assert out.returncode == 5, out.stdout[-4000:] + out.stderr[-4000:]
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    modules = sorted((ROOT / "tests" / "vllm_engine").glob("test_*.py"))
    assert len(skipped) == len(modules) > 0, out.stdout[-4000:]
    assert all("needs vLLM" in line for line in skipped), skipped
