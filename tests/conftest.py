"""Shared options for the whole suite (pytest reads addoption only from the root conftest)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine server conformance")
    group.addoption(
        "--engine-address",
        default=None,
        help="run the conformance suite against this running engine server "
        "(HOST:PORT or unix:PATH) instead of the servers the suite starts itself",
    )
