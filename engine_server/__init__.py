"""The engine server: serves an inference engine over the engine_contract.v1 gRPC contract.

Import side-effect free (vLLM's spawned processes re-import the main module).
Library use: ``handle = await serve(backend, ServerConfig(...))``; ``await handle.stop()``.
"""

from engine_server.config import GenerationDefaults, Limits, ServerConfig, TlsConfig
from engine_server.server import EngineServerHandle, serve, start_server

__all__ = [
    "EngineServerHandle",
    "GenerationDefaults",
    "Limits",
    "ServerConfig",
    "TlsConfig",
    "serve",
    "start_server",
]
