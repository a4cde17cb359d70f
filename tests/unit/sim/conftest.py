"""Fixtures for the sim backend's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from engine_server.backends.sim import SimBackend
from tests.unit.sim.sim_helpers import EventRecorder

MakeBackend = Callable[..., Awaitable[tuple[SimBackend, EventRecorder]]]


@pytest.fixture
async def make_backend() -> AsyncIterator[MakeBackend]:
    """``backend, events = await make_backend(**SimConfig fields)``; shut down after."""
    started: list[SimBackend] = []

    async def make(**fields: Any) -> tuple[SimBackend, EventRecorder]:
        fields.setdefault("zero_delay", True)
        recorder = EventRecorder()
        backend = SimBackend(**fields)
        recorder.backend = backend
        await backend.start(recorder)
        started.append(backend)
        return backend, recorder

    yield make
    for backend in started:
        await backend.shutdown()
