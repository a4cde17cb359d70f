"""Options and fixtures for the whole suite (pytest reads addoption only from the
root conftest). Shared helpers live in the ``harness`` package at the repo root."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from harness.tiny_model import tiny_model_dir

# vLLM's CPU build computes on OpenMP threads that, by default, spin for a while after
# each parallel region instead of sleeping. The suite runs engines side by side on
# two cores (xdist workers, a test beside its engine servers), where those spins take
# the core another process waits for: measured, four vLLM files on two workers used
# 180 CPU-seconds in 117 s with spinning, 126 in 96 s without (docs/testing.md).
# Set before anything imports torch; every process the suite starts inherits it.
# It changes no result: only what an idle OpenMP thread does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine server conformance")
    group.addoption(
        "--engine-address",
        default=None,
        help="run the conformance suite against this running engine server "
        "(HOST:PORT or unix:PATH) instead of the servers the suite starts itself",
    )


# Folders whose files share session-scoped, parametrized servers (the conformance
# suite's engine servers, one per kind). pytest orders a session's tests so that each
# server starts once; on xdist workers, a file per work unit, every file started them
# all again (the vLLM one: eleven start-ups instead of one, about 24 CPU-seconds
# each). Each such folder is one work unit instead, run in pytest's order on one worker.
ONE_WORK_UNIT = ("tests/conformance/",)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, but each ``ONE_WORK_UNIT`` folder is one unit."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FolderUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for folder in ONE_WORK_UNIT:
                if nodeid.startswith(folder):
                    return folder
            return super()._split_scope(nodeid)

    return FolderUnits(config, log)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny offline model (tokenizer, config, random weights); built once, then cached."""
    return tiny_model_dir()
