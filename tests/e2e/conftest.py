"""Fixtures of the end-to-end tests: the tiny model, and one shared stack per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_stack import Stack, start_stack
from procs import ProcessGroup, tiny_model_dir


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("e2e-stack")
    with ProcessGroup(root / "logs") as group:
        yield start_stack(root, model_dir, group)
