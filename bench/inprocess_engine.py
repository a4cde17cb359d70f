"""(a) of ``make bench``: a Dynamo ``LLMEngine`` that serves the engine in its own process.

The one-process design the bridge is measured against: the same request
mapping (``bridge.codec``) for rollouts and streamed completions, the same
admission and result assembly (the engine server's core through
``bench.local_engine``), the same KV-event relay logic (``bridge.kv_view``),
and no gRPC hop.

    python -m bench.inprocess_engine <bridge flags without --engine> -- <engine server flags>
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import AsyncGenerator
from typing import Any

from dynamo._core import Context
from dynamo.common.backend.engine import (
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
)
from dynamo.common.backend.publisher import KvEventSource, PushSource
from dynamo.common.backend.run import run
from dynamo.common.backend.worker import WorkerConfig
from dynamo.common.utils.token_ids import normalize_request_token_ids

from bench.local_engine import LocalEngine
from bridge import codec, errors
from bridge.config import BridgeConfig, parse_args
from bridge.kv_view import RouterView
from bridge.logging import configure_bridge_logging
from bridge.rollout_text import RolloutText

log = logging.getLogger(__name__)


class InProcessEngine(LLMEngine):
    def __init__(self, config: BridgeConfig, engine_argv: list[str]) -> None:
        self.config = config
        self.local = LocalEngine(engine_argv)
        self._view: RouterView | None = None
        # Dynamo context id -> engine request id, for abort().
        self._inflight: dict[str, str] = {}
        self._text = RolloutText(config.model_path)

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[InProcessEngine, WorkerConfig]:
        argv = list(sys.argv[1:] if argv is None else argv)
        split = argv.index("--") if "--" in argv else len(argv)
        bridge_argv, engine_argv = argv[:split], argv[split + 1 :]
        bridge_config, worker_config = parse_args([*bridge_argv, "--engine", "in-process"])
        configure_bridge_logging(bridge_config.log_level)
        return cls(bridge_config, engine_argv), worker_config

    async def start(self, worker_id: int) -> EngineConfig:
        await self.local.start()
        info = self.local.info
        return EngineConfig(
            model=self.config.model_path,
            served_model_name=self.config.served_model_name or info.model_name,
            llm=LlmRegistration(
                context_length=info.context_length,
                kv_cache_block_size=info.kv_block_size,
                total_kv_blocks=info.total_kv_blocks,
                max_num_seqs=info.max_running_sequences,
                max_num_batched_tokens=info.max_batched_tokens,
            ),
        )

    async def kv_event_sources(self) -> list[KvEventSource]:
        if not self.config.kv_events:
            return []
        view = self._view = RouterView(self.local.info.kv_block_size)
        self.local.on_kv_batch(view.apply_batch)
        loop = asyncio.get_running_loop()

        def on_ready(publisher: Any) -> None:  # may come from a runtime thread
            loop.call_soon_threadsafe(view.set_publisher, publisher)

        return [PushSource(on_ready=on_ready, dp_rank=0)]

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        normalize_request_token_ids(request)
        try:
            spec = codec.parse_request_kind(request.get("annotations"))  # type: ignore[arg-type]
        except codec.RequestError as e:
            raise errors.to_dynamo(e) from e
        context_id = context.id()
        request_id = (spec.request_id if spec is not None else None) or context_id
        self._inflight[context_id] = request_id
        try:
            if spec is None:
                stream = self.local.generate(codec.build_generate_request(request_id, request))
                async with contextlib.aclosing(stream):
                    async for message in stream:
                        yield codec.generate_chunk(message)
                return
            response = await self.local.rollout(
                codec.build_rollout_request(request_id, request, spec)
            )
            chunk = codec.rollout_chunk(
                response, self._text.decode(response.token_ids) if spec.text else ""
            )
        except Exception as e:
            raise errors.to_dynamo(e) from e
        finally:
            self._inflight.pop(context_id, None)
        yield chunk

    async def abort(self, context: Context) -> None:
        request_id = self._inflight.get(context.id())
        if request_id is not None:
            await self.local.abort(request_id)

    async def cleanup(self) -> None:
        await self.local.shutdown()


def main() -> int:
    gc.collect()  # as the bridge does
    gc.freeze()
    run(InProcessEngine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
