"""Options and fixtures for the whole suite (pytest reads addoption only from the
root conftest). Shared helpers live in the ``harness`` package at the repo root."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.tiny_model import tiny_model_dir
from tests import work_units

# vLLM's CPU build computes on OpenMP threads that, by default, spin for a while after
# each parallel region instead of sleeping. The suite runs engines side by side on
# two cores (xdist workers, a test beside its engine servers), where those spins take
# the core another process waits for: measured, four vLLM files on two workers used
# 180 CPU-seconds in 117 s with spinning, 126 in 96 s without (docs/testing.md).
# Set before anything imports torch; every process the suite starts inherits it.
# It changes no result: only what an idle OpenMP thread does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# vLLM's cache of model-class facts (VLLM_CACHE_ROOT/modelinfos) names a file per
# class, not per vLLM version, and keys it by the model file's hash: the two ends of
# the range on one machine (`make test` runs both) overwrote each other's entry, and
# each miss costs an engine start a child process that imports vLLM (8-9
# CPU-seconds; four or five a run, measured: docs/testing.md). One cache per environment.
VLLM_CACHE_ROOT_GIVEN = "VLLM_CACHE_ROOT" in os.environ
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(sys.prefix) / "vllm-cache"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine server conformance")
    group.addoption(
        "--engine-address",
        default=None,
        help="run the conformance suite against this running engine server "
        "(HOST:PORT or unix:PATH) instead of the servers the suite starts itself",
    )
    parser.addoption(
        "--record-unit-seconds",
        action="store_true",
        help="merge each work unit's seconds in this run into tests/unit_seconds.json, "
        "the order xdist runs hand units out in (tests/work_units.py)",
    )


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, but each ``ONE_WORK_UNIT`` folder is one unit, and the
    units go out in the workers' collection order: heaviest first (``work_units``)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # off: xdist would order units by test count

    class FolderUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_units.unit_of(nodeid)

    return FolderUnits(config, log)


@pytest.hookimpl(trylast=True)  # after pytest's own order (session-scoped parameters)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the scheduler takes this order
        items[:] = work_units.heaviest_first(items, work_units.read_seconds())


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("record_unit_seconds") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(work_units.UnitClock(), "unit-clock")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny offline model (tokenizer, config, random weights); built once, then cached."""
    return tiny_model_dir()
