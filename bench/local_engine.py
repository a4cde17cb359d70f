"""An engine served inside the calling process: the one-process design.

Built from the engine server's own CLI flags and answered by the engine
server's own admission and servicer code, minus gRPC, so that what differs
from the two-process path is the hop alone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence

from engine_contract.v1 import engine_pb2 as pb
from engine_server import admission, cli
from engine_server.backends import load_backend_class
from engine_server.backends.base import EngineBackend, EngineInfo, KvEventBatch
from engine_server.kv_events import KvEventHub, encode_event
from engine_server.registry import RequestRegistry
from engine_server.servicer import EngineServicer, Readiness


class LocalEngine:
    """``LocalEngine(["--backend", "sim", "--zero-delay", ...])``; ``await start()``,
    then ``await rollout(pb.RolloutRequest)`` as the Rollout RPC would answer it."""

    def __init__(self, argv: Sequence[str]) -> None:
        args = cli.parse_args(list(argv))
        self.config = cli.config_from_args(args)
        self.backend: EngineBackend = load_backend_class(args.backend).from_cli_args(args)
        self.instance_id = uuid.uuid4().hex
        self._readiness = Readiness()
        self._registry = RequestRegistry(self.backend.abort, self.config.finished_ids_remembered)
        # The servicer wants a hub; KV events go to ``on_kv_batch`` instead.
        hub = KvEventHub(self.instance_id, 1, self.config.kv_snapshot_chunk_blocks)
        self._servicer = EngineServicer(
            self.backend, self.config, self.instance_id, self._registry, hub, self._readiness
        )
        self.on_kv_batch: Callable[[pb.KvEventBatch], object] | None = None
        self._kv_seq = 0

    def _sink(self, batch: KvEventBatch) -> None:
        if self.on_kv_batch is None:
            return
        self._kv_seq += 1
        self.on_kv_batch(
            pb.KvEventBatch(
                instance_id=self.instance_id,
                sequence_number=self._kv_seq,
                events=[encode_event(e) for e in batch.events],
                timestamp_unix_nanos=batch.timestamp_unix_nanos,
                data_parallel_rank=batch.data_parallel_rank,
            )
        )

    async def start(self) -> None:
        info = await self.backend.start(self._sink)
        self._readiness.defaults = admission.resolve_defaults(self.config.defaults, info)
        self._readiness.start_time_unix_nanos = time.time_ns()
        self._readiness.info = info

    @property
    def info(self) -> EngineInfo:
        assert self._readiness.info is not None, "start() first"
        return self._readiness.info

    async def rollout(self, request: pb.RolloutRequest) -> pb.RolloutResponse:
        info, defaults = self._servicer._serving()
        plan = admission.plan_rollout(request, info, defaults, self.config.limits)
        return await self._servicer._rollout(plan)

    async def abort(self, request_id: str) -> None:
        await self._registry.abort(request_id)

    async def shutdown(self) -> None:
        await self.backend.shutdown()


async def run_local(argv: Sequence[str]) -> LocalEngine:
    engine = LocalEngine(argv)
    await engine.start()
    await asyncio.sleep(0)
    return engine
