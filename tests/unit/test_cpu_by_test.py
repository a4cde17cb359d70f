"""scripts.cpu_by_test: which kind each process counts under, the sums, and a real
run that samples a busy child and hands its exit status on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT
from scripts.cpu_by_test import Process, by_kind, by_test_file, kind_of

PY = "/repo/.venv/bin/python"


# A python process's arguments (after the interpreter) -> its kind.
PYTHON_ARGS = {
    "-m engine_server --backend vllm --model /tmp/pytest-of-root/m": "engine server (vLLM)",
    "-m engine_server --backend sim --listen 127.0.0.1:0": "engine server (other)",
    "-m engine_worker.flags bridge": "worker flag listing",
    # The launcher's first engine server: the child that listed its flags.
    "-m engine_worker.flags engine vllm --serve": "engine server (vLLM)",
    "-m engine_worker.flags engine sim --serve": "engine server (other)",
    "-m engine_worker --model /m --served-model-name x": "worker launcher",
    "-m bridge --engine 127.0.0.1:1 --model-path /tmp/pytest-of-root/m": "bridge",
    "-m dynamo.frontend --http-port 1": "Dynamo frontend",
    "-m vllm.model_executor.models.registry": "vLLM model registry probe",
    "-u -c import sys;exec(eval(sys.stdin.readline()))": "pytest",
    "-m tests.vllm_engine.dying_trainer /tmp/pytest-of-root/w": "other: python",
}


@pytest.mark.parametrize(
    ("name", "command", "kind"),
    [
        (
            "VLLM::EngineCore",
            f"{PY} -B -c from multiprocessing.spawn import spawn_main",
            "vLLM EngineCore",
        ),
        *(("python", f"{PY} {args}", kind) for args, kind in PYTHON_ARGS.items()),
        ("python", "[pytest-xdist running] tests/e2e/test_e2e_vllm.py::test_x", "pytest"),
        ("raylet", "/x/ray/core/src/ray/raylet/raylet --node", "Ray"),
    ],
)
def test_each_process_counts_under_its_kind(name: str, command: str, kind: str) -> None:
    assert kind_of(name, command) == kind


def process(command: str, test: str, cpu_s: float, name: str = "python") -> Process:
    return Process(1, 0.0, command, name, test, cpu_s, 0.0)


def test_sums_by_kind_and_by_test_file() -> None:
    processes = [
        process(f"{PY} -m bridge", "tests/e2e/test_a.py::test_x (setup)", 1.5),
        process(f"{PY} -m bridge", "tests/e2e/test_a.py::test_y (call)", 2.0),
        process("spawn_main", "tests/e2e/test_a.py::test_y (call)", 12.0, "VLLM::EngineCore"),
        process(f"{PY} -m pytest -q", "", 30.0),
    ]
    assert by_kind(processes) == {
        "bridge": (2, 3.5),
        "vLLM EngineCore": (1, 12.0),
        "pytest": (1, 30.0),
    }
    assert by_test_file(processes) == {"tests/e2e/test_a.py": (1, 15.5), "": (0, 30.0)}


def test_a_busy_child_is_sampled_and_its_exit_status_handed_on(tmp_path: Path) -> None:
    out = tmp_path / "processes.json"
    busy = (
        "import time\n"
        "end = time.process_time() + 0.8\n"
        "while time.process_time() < end: pass\n"
        "raise SystemExit(3)"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.cpu_by_test",
            "--out",
            str(out),
            "--",
            sys.executable,
            "-c",
            busy,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTEST_CURRENT_TEST": "tests/unit/test_z.py::test_busy (call)"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 3, run.stderr
    child = [p for p in json.loads(out.read_text()) if "process_time" in p["command"]]
    assert len(child) == 1
    assert child[0]["cpu_s"] >= 0.4  # sampled at least once after its first half second
    assert child[0]["test"] == "tests/unit/test_z.py::test_busy (call)"
    assert "| tests/unit/test_z.py | 0 |" in run.stdout
