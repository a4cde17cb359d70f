"""VllmBackend: the engine server's EngineBackend on a vLLM V1 ``AsyncLLM``.

Two ways to get one:

- ``VllmBackend(engine_args)`` / ``from_cli_args``: the backend creates the
  engine in ``start()`` and shuts it down in ``shutdown()``.
- ``VllmBackend.from_engine(async_llm)``: library form for a host (an RL
  worker) that created its engine and keeps it. ``shutdown()`` then leaves the
  engine running; KV events are relayed from the engine's own publisher.

The engine is created in a worker thread (``from_engine_args`` blocks for the
whole start-up, 15-25 s on small CPUs) so the server's event loop keeps
answering health checks meanwhile; the same for ``AsyncLLM.shutdown``.

This module is the serving half: construction, lifecycle, requests, load and the
KV-event relay. The refit half (pause, weights, transfer engines, versions,
sleep) is its base class, ``refit.VllmRefit``; what the engine is, read from its
config, is ``info``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Collection, Sequence
from typing import TYPE_CHECKING, Any

from vllm.config import KVEventsConfig, VllmConfig
from vllm.distributed.kv_events import ZmqEventPublisher
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
from vllm.v1.engine.exceptions import EngineGenerateError
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from engine_server import vllm_compat as compat
from engine_server.backends import base
from engine_server.backends.base import (
    AllBlocksCleared,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    KvEventBatch,
    KvEventSink,
    SamplingSpec,
)
from engine_server.backends.vllm import args as cli
from engine_server.backends.vllm.info import engine_info
from engine_server.backends.vllm.kv_events import KvEventSubscriber
from engine_server.backends.vllm.outputs import OutputConverter
from engine_server.backends.vllm.refit import VllmRefit
from engine_server.backends.vllm.sampling import to_sampling_params
from engine_server.backends.vllm.weights import VllmWeights
from engine_server.tracing import trace_headers
from engine_server.vllm_processes import before_engine_start, shut_down

if TYPE_CHECKING:
    from engine_server.generation_config import GenerationConfig

log = logging.getLogger(__name__)

# vLLM errors that mean "this request's parameters", not "the engine". Not
# TypeError: that is a bug (ours or vLLM's), and blaming the client for it would
# hide it; it reaches the caller as INTERNAL.
_REQUEST_ERRORS = compat.REQUEST_ERRORS


@dataclasses.dataclass
class _SchedulerView:
    """Latest scheduler counters, fed by a stat logger (owned engines only)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def _stat_logger_factory(view: _SchedulerView) -> Any:
    class _LoadStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                view.running = scheduler_stats.num_running_reqs
                view.waiting = scheduler_stats.num_waiting_reqs
                view.kv_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    return _LoadStatLogger


class VllmBackend(VllmRefit):
    """Runs requests on a vLLM ``AsyncLLM``; see the package docs for defaults."""

    supports_bad_words = True

    def __init__(
        self,
        engine_args: AsyncEngineArgs | None = None,
        *,
        engine: AsyncLLM | None = None,
        chosen: Collection[str] | None = None,
        kv_events_endpoint: str | Sequence[str] | None = None,
    ) -> None:
        """Exactly one of ``engine_args`` (the backend creates and owns the engine;
        ``chosen``: the arguments the user set, see ``apply_engine_defaults``) and
        ``engine`` (the host's; see ``from_engine``)."""
        if (engine_args is None) == (engine is None):
            raise ValueError("give VllmBackend either engine_args or an engine, not both")
        super().__init__(engine)
        self._engine_args = engine_args
        self.defaults_applied: dict[str, Any] = {}
        if engine_args is not None:
            self.defaults_applied = cli.apply_engine_defaults(engine_args, chosen)
            if self.defaults_applied:
                log.info("vLLM engine defaults, where none were given: %s", self.defaults_applied)
        self._owns_engine = engine is None
        if isinstance(kv_events_endpoint, str):
            kv_events_endpoint = [kv_events_endpoint]
        self._kv_endpoints = None if kv_events_endpoint is None else list(kv_events_endpoint)
        self._kv: KvEventSubscriber | None = None
        self._view = _SchedulerView()
        self._info: EngineInfo | None = None
        self._sink: KvEventSink | None = None
        self._closed = False
        # Requests in generate(), by id: True once abort() was asked for.
        self._live: dict[str, bool] = {}

    # -- construction --------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        cli.add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> VllmBackend:
        return cls(cli.engine_args_from_namespace(args), chosen=cli.chosen_engine_args(args))

    @classmethod
    def apply_generation_config(
        cls, config: GenerationConfig, args: argparse.Namespace
    ) -> list[str]:
        """The section's vllm_cfg and vllm_kwargs become engine arguments, except
        where the command line set the same argument (the flag wins)."""
        chosen = cli.chosen_engine_args(args)
        notes = []
        for field, value in cli.generation_engine_args(config.engine, config.engine_kwargs).items():
            if field in chosen:
                notes.append(
                    f"engine argument {field}: the command line's value wins over {value!r}"
                )
            else:
                setattr(args, cli.DEST_PREFIX + field, value)
        return notes

    @classmethod
    def from_engine(
        cls, engine: AsyncLLM, *, kv_events_endpoint: str | Sequence[str] | None = None
    ) -> VllmBackend:
        """Serve an engine the host created and keeps (never shut down here).

        ``kv_events_endpoint``: the publisher endpoint(s) to relay, one per DP
        rank; by default those the engine reports (``get_kv_event_sources``),
        else its configured ``kv_events_config``. No events when it has none.
        """
        return cls(engine=engine, kv_events_endpoint=kv_events_endpoint)

    @property
    def scheduler_counts(self) -> tuple[int, int]:
        """(running, waiting) as vLLM's scheduler last reported (owned engines)."""
        return self._view.running, self._view.waiting

    @property
    def kv_subscriber(self) -> KvEventSubscriber | None:
        return self._kv

    # -- lifecycle -------------------------------------------------------------
    async def start(self, kv_event_sink: KvEventSink | None) -> EngineInfo:
        if self._info is not None:
            return self._info
        self._sink = kv_event_sink
        if kv_event_sink is not None:
            kv_event_sink = self._local_ranks(kv_event_sink)
        loop = asyncio.get_running_loop()
        if self._owns_engine:
            await self._start_owned(kv_event_sink, loop)
        elif kv_event_sink is not None:
            self._start_relay(kv_event_sink, loop)
        engine = self.engine
        # Created off-loop, the engine has not started its output handler yet;
        # start it now so that an engine failure is noticed before any request.
        run_handler = getattr(engine, "_run_output_handler", None)
        if run_handler is not None:
            run_handler()
        self._info = engine_info(engine)
        self._weights = VllmWeights(engine, self._info.model_path)
        return self._info

    async def _start_owned(self, sink: KvEventSink | None, loop: asyncio.AbstractEventLoop) -> None:
        ea = self._engine_args
        assert ea is not None
        dp = max(1, int(ea.data_parallel_size or 1))
        if sink is not None:
            kvc = ea.kv_events_config
            if kvc is None:
                self._kv = KvEventSubscriber(sink, loop, expect_from_zero=True)
                port = self._kv.bind_loopback_ports(dp)
                ea.kv_events_config = KVEventsConfig(
                    enable_kv_cache_events=True,
                    publisher="zmq",
                    endpoint=f"tcp://127.0.0.1:{port}",
                    replay_endpoint=None,
                    topic="",
                )
            elif kvc.enable_kv_cache_events and kvc.publisher == "zmq":
                self._kv = KvEventSubscriber(sink, loop, topic=kvc.topic, expect_from_zero=True)
                if not kvc.endpoint.endswith(":0"):  # port 0: attach once resolved
                    self._kv.attach(
                        [ZmqEventPublisher.offset_endpoint_port(kvc.endpoint, r) for r in range(dp)]
                    )
            else:
                log.warning("KV events are off in the given kv_events_config; none relayed")
            if self._kv is not None:
                self._kv.start()
        before_engine_start()
        try:
            engine = await asyncio.to_thread(
                AsyncLLM.from_engine_args, ea, stat_loggers=[_stat_logger_factory(self._view)]
            )
        except BaseException:
            if self._kv is not None:
                await self._kv.stop(drain_s=0)
                self._kv = None
            raise
        if self._closed:  # shutdown() came while the engine was starting
            await shut_down(engine)
            raise base.EngineDeadError("shut down while starting")
        self._engine = engine
        if self._kv is not None and not self._kv.endpoints:
            self._kv.attach(_publisher_endpoints(engine))

    def _start_relay(self, sink: KvEventSink, loop: asyncio.AbstractEventLoop) -> None:
        endpoints = self._kv_endpoints or _publisher_endpoints(self.engine)
        if not endpoints:
            log.warning("the vLLM engine publishes no KV events; none relayed")
            return
        topic = ""
        kvc = self.engine.vllm_config.kv_events_config
        if kvc is not None:
            topic = kvc.topic
        self._kv = KvEventSubscriber(sink, loop, topic=topic, expect_from_zero=False)
        self._kv.attach(endpoints)
        self._kv.start()

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        engine, self._engine = self._engine, None
        if engine is not None and self._owns_engine:
            await shut_down(engine)
        if self._kv is not None:
            await self._kv.stop()

    # -- requests --------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], spec: SamplingSpec
    ) -> AsyncGenerator[EngineOutput, None]:
        engine = self.engine
        if spec.stop_strings and engine.tokenizer is None:
            # vLLM would silently never match them (no detokenizer).
            raise base.EngineRequestError(
                "stop strings need the tokenizer; this engine runs with skip_tokenizer_init"
            )
        try:
            params = to_sampling_params(spec)
        except _REQUEST_ERRORS as e:
            raise base.EngineRequestError(str(e)) from e
        conv = OutputConverter(spec, len(prompt_token_ids))
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        if spec.cache_salt is not None:
            prompt["cache_salt"] = spec.cache_salt
        rank = spec.data_parallel_rank
        if rank is not None and self._info is not None:
            rank += self._info.data_parallel_start_rank  # vLLM numbers ranks globally
        stream = engine.generate(
            prompt, params, request_id, data_parallel_rank=rank, trace_headers=trace_headers()
        )
        self._live[request_id] = False
        reaborted = False
        try:
            async for out in stream:
                if self._live.get(request_id) and not out.finished and not reaborted:
                    # abort() came while vLLM was still registering the request
                    # (its abort of an unknown id is a no-op): repeat it now.
                    reaborted = True
                    await engine.abort(request_id)
                yield conv.convert(out)
        except VllmEngineDeadError as e:
            raise base.EngineDeadError(str(e)) from e
        except _REQUEST_ERRORS as e:
            raise base.EngineRequestError(str(e)) from e
        except EngineGenerateError as e:
            if isinstance(e.__cause__, _REQUEST_ERRORS):
                raise base.EngineRequestError(str(e.__cause__)) from e
            if engine.errored:
                raise base.EngineDeadError(str(e)) from e
            raise
        finally:
            self._live.pop(request_id, None)
            # Closing vLLM's stream aborts its request (it handles GeneratorExit);
            # the explicit abort covers every other way out before the end.
            await stream.aclose()
            if not conv.finished and not engine.errored:
                with contextlib.suppress(Exception):
                    await engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort in vLLM; an abort that races the request's registration in vLLM
        is repeated by ``generate`` as soon as the request's first output comes."""
        if request_id in self._live:
            self._live[request_id] = True
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def reset_prefix_cache(self, *, running: bool = False) -> bool:
        """True when vLLM dropped its cached blocks (False while some are in use,
        unless ``running``: those requests are then recomputed)."""
        done = bool(await self.engine.reset_prefix_cache(reset_running_requests=running))
        if done:
            self._cleared()
        return done

    def _local_ranks(self, sink: KvEventSink) -> KvEventSink:
        """vLLM stamps KV batches with its global data-parallel rank; the contract
        carries this server's own (0-based) ones."""

        def local(batch: KvEventBatch) -> None:
            start = self._info.data_parallel_start_rank if self._info is not None else 0
            if start:
                batch = dataclasses.replace(
                    batch, data_parallel_rank=batch.data_parallel_rank - start
                )
            sink(batch)

        return local

    def _cleared(self) -> None:
        """Tell the router now: vLLM's own AllBlocksCleared waits for its next step,
        that is for the next request, and a router would meanwhile send requests
        here for blocks that are gone (or were computed with the old weights)."""
        if self._sink is None or self._info is None:
            return
        for rank in range(self._info.data_parallel_size):
            self._sink(KvEventBatch((AllBlocksCleared(),), data_parallel_rank=rank))

    def load(self) -> EngineLoad:
        """Requests vLLM's front end holds, split by the scheduler's last count.

        The total is exact at every moment (an abort removes the request at
        once); the waiting share comes from the scheduler's latest stats and
        is clamped to the total (0 for engines the host created).
        """
        engine = self._engine
        if engine is None:
            return EngineLoad(running=0, waiting=0)
        total = compat.unfinished_requests(engine)
        waiting = min(self._view.waiting, total)
        blocks = engine.vllm_config.cache_config.num_gpu_blocks or 0
        return EngineLoad(
            running=total - waiting,
            waiting=waiting,
            kv_blocks_used=round(self._view.kv_usage * blocks),
            kv_blocks_total=blocks,
        )

    async def check_health(self) -> None:
        engine = self.engine
        try:
            await engine.check_health()
        except Exception as e:
            raise base.EngineDeadError(f"vLLM engine is dead: {e}") from e


def _publisher_endpoints(engine: AsyncLLM) -> list[str]:
    """The engine's resolved KV-event publisher endpoints, by DP rank."""
    sources = compat.kv_event_sources(engine)
    if sources:
        return [
            cfg.endpoint
            for _, cfg in sorted(sources.items())
            if cfg.enable_kv_cache_events and cfg.publisher == "zmq"
        ]
    kvc = engine.vllm_config.kv_events_config
    if kvc is None or not kvc.enable_kv_cache_events or kvc.publisher != "zmq":
        return []
    dp = engine.vllm_config.parallel_config.data_parallel_size
    return [
        ZmqEventPublisher.offset_endpoint_port(kvc.endpoint, r) or kvc.endpoint for r in range(dp)
    ]
