"""An engine served inside the calling process: the one-process design.

Built from the engine server's own CLI flags and answered by the engine
server's own core (``ServerCore``), minus gRPC, so that what differs from the
two-process path is the hop alone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence

from engine_contract.v1 import engine_pb2 as pb
from engine_server import cli
from engine_server.backends.base import EngineInfo
from engine_server.core import ServerCore


class LocalEngine:
    """``LocalEngine(["--backend", "sim", "--zero-delay", ...])``; ``await start()``,
    then ``await rollout(pb.RolloutRequest)`` as the Rollout RPC would answer it,
    or ``generate(pb.GenerateRequest)`` for the Generate RPC's messages."""

    def __init__(self, argv: Sequence[str]) -> None:
        backend, config = cli.backend_and_config(cli.parse_args(list(argv)))
        self.core = ServerCore(backend, config, uuid.uuid4().hex)

    def on_kv_batch(self, listener: Callable[[pb.KvEventBatch], object]) -> None:
        """Hand every KV-event batch, numbered as the server numbers them, to ``listener``."""
        self.core.hub.listeners.append(listener)

    async def start(self) -> None:
        await self.core.start_engine()

    @property
    def info(self) -> EngineInfo:
        info = self.core.info
        if info is None:
            raise RuntimeError("start() first")
        return info

    async def rollout(self, request: pb.RolloutRequest) -> pb.RolloutResponse:
        return await self.core.rollout(request)

    def generate(self, request: pb.GenerateRequest) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The Generate RPC's messages; close the iterator early to abort."""
        return self.core.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.core.registry.abort(request_id)

    async def shutdown(self) -> None:
        await self.core.backend.shutdown()


async def run_local(argv: Sequence[str]) -> LocalEngine:
    engine = LocalEngine(argv)
    await engine.start()
    await asyncio.sleep(0)
    return engine
