"""Backends by name: the built-in ones, and any installed package's.

A backend is an ``EngineBackend`` subclass; the CLI calls its classmethods
``add_cli_args(parser)`` (its own flags, in an argument group) and
``from_cli_args(args)``. A third-party package registers one under the entry
point group ``engine_server.backends`` (``name = "package.module:Class"`` in its
``pyproject.toml``), and ``--backend name`` then serves it; this project's own
are registered the same way. Each is imported only when chosen, so the sim
backend runs without vLLM installed.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from engine_server.backends.base import EngineBackend

ENTRY_POINT_GROUP = "engine_server.backends"

# The project's own, also when it runs from a source tree that was never installed.
BUILTIN: dict[str, str] = {
    "sim": "engine_server.backends.sim:SimBackend",
    "vllm": "engine_server.backends.vllm:VllmBackend",
    "toy": "engine_server.backends.toy:ToyBackend",
}


def available_backends() -> dict[str, str]:
    """Every backend by name: ``module:Class``, installed entry points included."""
    found = dict(BUILTIN)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry.value)
    return found


BACKENDS = available_backends()


def load_backend_class(name: str) -> type[EngineBackend]:
    """Import and return the backend class registered under ``name``."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}") from None
    module_name, _, attr = target.partition(":")
    backend = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(backend, type) and issubclass(backend, EngineBackend)):
        raise ValueError(f"backend {name!r} ({target}) is not an EngineBackend subclass")
    return backend
