"""Options and fixtures for the whole suite (pytest reads addoption only from the
root conftest). Shared helpers live in the ``harness`` package at the repo root."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.tiny_model import tiny_model_dir


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine server conformance")
    group.addoption(
        "--engine-address",
        default=None,
        help="run the conformance suite against this running engine server "
        "(HOST:PORT or unix:PATH) instead of the servers the suite starts itself",
    )


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny offline model (tokenizer, config, random weights); built once, then cached."""
    return tiny_model_dir()
