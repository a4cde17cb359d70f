"""Backends by name. Each is imported only when chosen, so the sim backend runs
without vLLM installed.

A backend class implements ``EngineBackend`` and two classmethods the CLI uses:
``add_cli_args(parser)`` (its own flags, in an argument group) and
``from_cli_args(args) -> EngineBackend``.
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, str] = {
    "sim": "engine_server.backends.sim:SimBackend",
    "vllm": "engine_server.backends.vllm:VllmBackend",
}


def load_backend_class(name: str) -> Any:
    """Import and return the backend class registered under ``name``."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}") from None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
