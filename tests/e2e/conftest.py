"""Fixtures of the end-to-end tests: one shared stack per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.procs import ProcessGroup
from harness.stack import Stack
from tests.e2e.e2e_stack import start_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("e2e-stack")
    with ProcessGroup(root / "logs") as group:
        yield start_stack(root, model_dir, group)
