"""Fixtures of the fault tests: the tiny offline model."""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import tiny_model_dir


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model_dir()
