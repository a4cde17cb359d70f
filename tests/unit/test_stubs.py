"""The committed stubs match proto/, and the check notices when they do not."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scripts.gen_proto", "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_stubs_are_current() -> None:
    result = run_check(ROOT)
    assert result.returncode == 0, result.stderr


def test_a_stale_stub_is_detected(tmp_path: Path) -> None:
    for part in ("proto", "engine_contract", "scripts"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    proto = tmp_path / "proto" / "engine_contract" / "v1" / "engine.proto"
    proto.write_text(
        proto.read_text().replace(
            "message GetLoadRequest {}", "message GetLoadRequest {\n  bool verbose = 1;\n}"
        )
    )
    result = run_check(tmp_path)
    assert result.returncode == 1
    assert "stale generated stubs" in result.stderr and "make proto" in result.stderr


def test_make_proto_is_idempotent(tmp_path: Path) -> None:
    for part in ("proto", "engine_contract", "scripts"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    before = {p: p.read_bytes() for p in (tmp_path / "engine_contract").rglob("*_pb2*")}
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "scripts.gen_proto"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "wrote" not in result.stdout
    assert {p: p.read_bytes() for p in before} == before
