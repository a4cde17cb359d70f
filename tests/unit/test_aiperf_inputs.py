"""scripts.aiperf_inputs writes what aiperf's inputs_json loader takes and what
the bridge serves as rollouts with their text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bridge import codec
from harness import ROOT
from harness.tiny_model import tiny_model_dir


def test_inputs_are_rollouts_with_text(tmp_path: Path) -> None:
    model_dir = tiny_model_dir()
    out = tmp_path / "rollouts.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.aiperf_inputs",
            "--model",
            "m",
            "--model-dir",
            str(model_dir),
            "--out",
            str(out),
            "--count",
            "20",
            "--prompt-tokens",
            "16",
            "--max-tokens",
            "8",
            "--stream",
        ],
        cwd=ROOT,
        check=True,
    )
    data = json.loads(out.read_text())["data"]
    assert len(data) == 20 and len({s["session_id"] for s in data}) == 20
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    special = {
        t["id"] for t in json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    for session in data:
        (body,) = session["payloads"]
        assert body["model"] == "m" and body["max_tokens"] == 8 and body["stream"] is True
        assert len(body["prompt"]) == 16
        assert all(0 <= t < vocab and t not in special for t in body["prompt"])
        spec = codec.parse_request_kind(body["nvext"]["annotations"])
        assert spec is not None and spec.text and not spec.greedy
