"""The engine server: serves an inference engine over the engine_contract.v1 gRPC contract.

Import side-effect free (vLLM's spawned processes re-import the main module,
and load ``engine_server.vllm_plugin`` in every process): the names below are
imported on first use. Library use: ``handle = await serve(backend,
ServerConfig(...))``; ``await handle.stop()``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_server.config import GenerationDefaults, Limits, ServerConfig, TlsConfig
    from engine_server.server import EngineServerHandle, serve, start_server

_EXPORTS = {
    "GenerationDefaults": "engine_server.config",
    "Limits": "engine_server.config",
    "ServerConfig": "engine_server.config",
    "TlsConfig": "engine_server.config",
    "EngineServerHandle": "engine_server.server",
    "serve": "engine_server.server",
    "start_server": "engine_server.server",
}

__all__ = [
    "EngineServerHandle",
    "GenerationDefaults",
    "Limits",
    "ServerConfig",
    "TlsConfig",
    "serve",
    "start_server",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
