"""A third-party backend, installed as a package that registers it under the entry
point group ``engine_server.backends``, is served by ``--backend NAME`` with no
edit to this project; an entry that is no EngineBackend is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.procs import ProcessGroup

MODULE = '''
import dataclasses

from engine_server.backends.sim.backend import SimBackend


class ThirdParty(SimBackend):
    """The sim under another name, as a package outside this project ships it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.info = dataclasses.replace(self.info, backend_name="third-party")


class NotABackend:
    pass
'''

ENTRY_POINTS = """[engine_server.backends]
thirdparty = thirdparty_backend:ThirdParty
notabackend = thirdparty_backend:NotABackend
"""


def installed_package(root: Path) -> Path:
    """A folder holding the package as pip would install it (module + dist-info)."""
    site = root / "site"
    info = site / "thirdparty_backend-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "thirdparty_backend.py").write_text(MODULE)
    metadata = "Metadata-Version: 2.1\nName: thirdparty-backend\nVersion: 1.0\n"
    (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


def test_an_installed_entry_point_backend_is_served(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(installed_package(tmp_path))}
    with ProcessGroup(tmp_path / "logs") as group:
        _, address = group.engine_server(
            "thirdparty", "--zero-delay", backend="thirdparty", env=env, timeout=60
        )
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            assert info.backend_name == "third-party", info.backend_name
            answer = stub.Rollout(
                pb.RolloutRequest(request_id="ep", prompt_token_ids=[5, 6], max_new_tokens=4),
                timeout=10,
            )
            assert len(answer.token_ids) == 4


def test_an_entry_point_that_is_no_backend_is_refused_by_name(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(installed_package(tmp_path))}
    done = subprocess.run(
        [sys.executable, "-m", "engine_server", "--backend", "notabackend"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "'notabackend'" in done.stderr and "not an EngineBackend" in done.stderr, done.stderr
