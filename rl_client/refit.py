"""The trainer's side of the refit cycle: pause every worker, update, resume.

Two ways in, the same cycle and the same report:

- ``RefitClient(worker_urls)``: over each Dynamo worker's RL admin routes (its
  system port, ``/engine/pause_generation`` ...), exactly as a trainer drives
  ``dynamo.vllm --enable-rl``; the new weights come from a checkpoint folder
  every worker can read. It sends the workers' admin token (``rl_client.admin_token``:
  given, or read as a bridge reads it, ``$BRIDGE_ADMIN_TOKEN_FILE`` or
  ``$BRIDGE_ADMIN_TOKEN``) as ``Authorization: Bearer``.
- ``EngineRefitClient(engine_addresses)``: over the engine servers' contract
  (gRPC, ``rl_client.refit_rpc``; TLS as the bridge's with ``tls=``); the new
  weights come from a folder or are streamed from the trainer's memory
  (``engine_contract.tensors``), no shared filesystem needed.

For vLLM's trainer-side weight-transfer engines (NCCL; ``gloo`` on CPUs), two
``VLLMWeightSyncClient``s: ``ContractWeightSyncClient`` (the contract's phases,
gRPC) and ``DynamoWeightSyncClient`` (a worker's RL routes, called as NeMo RL
calls them).

A step pauses all workers (concurrently), updates all, and resumes those whose
update succeeded. A worker whose update failed stays paused on its old weights
(resuming it would serve the old policy as if new): ``RefitError`` says which
and why; ``resume()`` lets it serve again once the trainer decides. No Dynamo
import here: trainers install only the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import grpc

from engine_contract.refit_rules import pause_mode
from engine_contract.tensors import DEFAULT_CHUNK_BYTES, Tensor, update_requests
from engine_contract.v1 import engine_pb2 as pb
from rl_client.admin_token import AdminToken
from rl_client.refit_rpc import DEFAULT_MAX_MESSAGE_BYTES, RefitRpc
from rl_client.tls import TlsOptions

T = TypeVar("T")


@dataclass
class WorkerRefit:
    """What one worker did in one refit step."""

    worker: str
    version: str | None = None
    paused_s: float = 0.0
    update_s: float = 0.0
    resumed: bool = False
    error: str | None = None
    # Where it failed: "pause" (not paused, old weights), "update" (paused on its
    # old weights), or "resume" (the new weights loaded, not serving yet).
    stage: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class RefitReport:
    version: str
    workers: list[WorkerRefit] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(w.ok for w in self.workers)

    @property
    def failed(self) -> list[WorkerRefit]:
        return [w for w in self.workers if not w.ok]


class RefitError(RuntimeError):
    """Some workers did not take the new weights (they stay paused); ``report``
    has every worker's outcome."""

    def __init__(self, report: RefitReport) -> None:
        lines = "; ".join(f"{w.worker} ({w.stage}): {w.error}" for w in report.failed)
        super().__init__(
            f"refit to {report.version!r} failed on {len(report.failed)} of "
            f"{len(report.workers)} workers: {lines}"
        )
        self.report = report


class _Cycle:
    """The step's choreography, whatever carries the calls."""

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        raise NotImplementedError

    async def _resume(self, worker: str) -> None:
        raise NotImplementedError

    async def _run(
        self,
        workers: Sequence[str],
        version: str,
        mode: str,
        clear_cache: bool,
        update: Callable[[str], Awaitable[str | None]],
    ) -> RefitReport:
        pause_mode(mode)  # ValueError naming the modes, before any call
        started = time.monotonic()
        report = RefitReport(version, [WorkerRefit(w) for w in workers])

        async def pause(entry: WorkerRefit) -> None:
            t0 = time.monotonic()
            await self._pause(entry.worker, mode, clear_cache)
            entry.paused_s = time.monotonic() - t0

        async def load(entry: WorkerRefit) -> None:
            t0 = time.monotonic()
            entry.version = await update(entry.worker)
            entry.update_s = time.monotonic() - t0

        await _each(report.workers, pause, "pause")
        await _each([w for w in report.workers if w.ok], load, "update")
        ready = [w for w in report.workers if w.ok]

        async def resume(entry: WorkerRefit) -> None:
            await self._resume(entry.worker)
            entry.resumed = True

        await _each(ready, resume, "resume")
        report.seconds = time.monotonic() - started
        if not report.ok:
            raise RefitError(report)
        return report


async def _each(
    entries: Iterable[WorkerRefit], step: Callable[[WorkerRefit], Awaitable[None]], stage: str
) -> None:
    """Run ``step`` on every entry at once; a failure is written into the entry."""

    async def guarded(entry: WorkerRefit) -> None:
        try:
            await step(entry)
        except grpc.aio.AioRpcError as e:
            entry.error, entry.stage = f"{e.code().name}: {e.details()}", stage
        except Exception as e:
            entry.error, entry.stage = str(e) or type(e).__name__, stage

    await asyncio.gather(*(guarded(e) for e in entries))


class RouteError(RuntimeError):
    """A route answered ``{"status": "error"}`` (or not JSON, or not 200)."""


class RefitClient(_Cycle):
    """The cycle over Dynamo workers' RL admin routes (their system URLs).

    ``admin_token``: the workers' token; None (the default) reads it from the
    environment as a bridge does (``AdminToken.from_env``), and sends none when
    neither variable is set."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float | None = None,
        admin_token: str | AdminToken | None = None,
    ) -> None:
        if not worker_urls:
            raise ValueError("no worker URLs")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        if isinstance(admin_token, str):
            admin_token = AdminToken(admin_token, "the admin_token argument")
        elif admin_token is None:
            admin_token = AdminToken.from_env()
        self._headers = admin_token.header() if admin_token is not None else {}
        self._session = session
        self._own_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __aenter__(self) -> RefitClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def call(
        self, worker: str, route: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One route of one worker; RouteError unless it answered ``status: ok``."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._session.post(
            f"{worker}/engine/{route}",
            json=body or {},
            timeout=self._timeout,
            headers=self._headers,
        ) as resp:
            try:
                answer = await resp.json(content_type=None)
            except ValueError:
                answer = None
            if resp.status != 200 or not isinstance(answer, dict):
                raise RouteError(f"{route}: HTTP {resp.status}: {answer!r}")
            if answer.get("status") != "ok":
                raise RouteError(f"{route}: {answer.get('message', answer)}")
            return answer

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        await self.call(worker, "pause_generation", {"mode": mode, "clear_cache": clear_cache})

    async def _resume(self, worker: str) -> None:
        await self.call(worker, "resume_generation")

    async def refit(
        self, model_path: str, version: str, *, mode: str = "wait", clear_cache: bool = True
    ) -> RefitReport:
        """Pause (``mode``: wait for rollouts in flight, abort them, or keep them
        frozen), load ``model_path`` as ``version``, resume."""

        async def update(worker: str) -> str | None:
            answer = await self.call(
                worker,
                "update_weights_from_disk",
                {"model_path": model_path, "weight_version": version},
            )
            return answer.get("version")

        return await self._run(self.worker_urls, version, mode, clear_cache, update)

    async def resume(self, workers: Sequence[str] | None = None) -> None:
        await asyncio.gather(*(self._resume(w) for w in workers or self.worker_urls))

    async def versions(self) -> dict[str, Any]:
        answers = await asyncio.gather(
            *(self.call(w, "get_weight_version") for w in self.worker_urls)
        )
        return {w: a.get("version") for w, a in zip(self.worker_urls, answers, strict=True)}


class EngineRefitClient(_Cycle):
    """The cycle over engine servers' contract (gRPC), weights streamed or from a folder.

    ``tls``: TLS to the engine servers, as the bridge's ``--engine-tls-*`` options
    (a CA, and a client certificate and key for an mTLS engine server); None:
    plaintext. Open it inside the event loop that uses it."""

    def __init__(
        self,
        engine_addresses: Sequence[str],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: TlsOptions | None = None,
    ) -> None:
        if not engine_addresses:
            raise ValueError("no engine server addresses")
        self._engines = {
            a: RefitRpc.connect(a, tls=tls, max_message_bytes=max_message_bytes)
            for a in engine_addresses
        }
        self._chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_message_bytes // 2)

    async def __aenter__(self) -> EngineRefitClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(engine.close() for engine in self._engines.values()))

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        await self._engines[worker].pause_generation(
            pb.PauseGenerationRequest(mode=pause_mode(mode), clear_cache=clear_cache)
        )

    async def _resume(self, worker: str) -> None:
        await self._engines[worker].resume_generation()

    async def refit(
        self,
        version: str,
        *,
        tensors: Sequence[Tensor] | None = None,
        path: str | None = None,
        mode: str = "wait",
        clear_cache: bool = True,
    ) -> RefitReport:
        """Pause, load ``tensors`` (streamed to every server) or ``path`` as
        ``version``, resume."""
        if (tensors is None) == (path is None):
            raise ValueError("give either tensors or path")

        async def update(worker: str) -> str | None:
            engine = self._engines[worker]
            if tensors is not None:
                requests = update_requests(
                    tensors, weight_version=version, chunk_bytes=self._chunk_bytes
                )
                streamed = await engine.update_weights_from_tensors(requests)
                return str(streamed.result.weight_version)
            loaded = await engine.update_weights_from_path(
                pb.UpdateWeightsFromPathRequest(
                    path=path, options=pb.WeightUpdateOptions(weight_version=version)
                )
            )
            return str(loaded.result.weight_version)

        return await self._run(list(self._engines), version, mode, clear_cache, update)

    async def resume(self, workers: Sequence[str] | None = None) -> None:
        await asyncio.gather(*(self._resume(w) for w in workers or list(self._engines)))


class ContractWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` (its four methods) over the contract, so that
    vLLM's trainer-side weight-transfer engines (``NCCLTrainerWeightTransferEngine``
    and the like) drive an engine server directly:

        client = ContractWeightSyncClient("10.0.0.5:50051", weight_version="42")
        engine = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client,
                                                              source=ModuleSource(model))
        ... PauseGeneration ...; engine.send_weights(); ... ResumeGeneration ...

    The engine server refuses the update unless generation is paused (or
    ``allow_unpaused``); ``weight_version`` is set when the update finishes.
    ``tls``: as ``EngineRefitClient``'s. Blocking calls, as vLLM's trainer engines
    make them (from their threads): each runs the typed ``RefitRpc`` on an event
    loop of the client's own (a thread), so calls from several threads overlap.
    """

    def __init__(
        self,
        address: str,
        *,
        weight_version: str | None = None,
        allow_unpaused: bool = False,
        timeout_s: float | None = None,
        tls: TlsOptions | None = None,
    ) -> None:
        self.weight_version = weight_version
        self.allow_unpaused = allow_unpaused
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="contract-weight-sync", daemon=True
        )
        self._thread.start()

        async def connect() -> RefitRpc:  # the channel belongs to the client's loop
            return RefitRpc.connect(address, tls=tls, timeout_s=timeout_s)

        self._rpc = self._call(connect())

    def _call(self, call: Awaitable[T]) -> T:
        async def run() -> T:
            return await call

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._rpc.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(
            self._rpc.init_weight_transfer_engine(
                pb.InitWeightTransferEngineRequest(init_info_json=json.dumps(init_info).encode())
            )
        )

    def start_weight_update(self) -> None:
        options = pb.WeightUpdateOptions(allow_unpaused=self.allow_unpaused)
        self._call(self._rpc.start_weight_update(pb.StartWeightUpdateRequest(options=options)))

    def update_weights(self, update_info: Any) -> None:
        self._call(
            self._rpc.update_weights(
                pb.UpdateWeightsRequest(update_info_json=json.dumps(update_info).encode())
            )
        )

    def finish_weight_update(self) -> None:
        request = pb.FinishWeightUpdateRequest()
        if self.weight_version is not None:
            request.weight_version = self.weight_version
        self._call(self._rpc.finish_weight_update(request))

    def shutdown_weight_transfer_engine(self) -> None:
        self._call(self._rpc.shutdown_weight_transfer_engine())


class DynamoWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` (its four methods) over a Dynamo worker's RL
    admin routes, calling them exactly as NeMo RL's Dynamo backend does, so that
    vLLM's trainer-side weight-transfer engines drive a worker through its system
    port (``dynamo.vllm --enable-rl``, or this bridge):

        client = DynamoWeightSyncClient("http://worker-0:9090", weight_version="42")
        engine = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client,
                                                              source=ModuleSource(model))
        engine.send_weights()  # start, update (while broadcasting), finish

    - ``init_weight_transfer_engine(info)``: ``POST /engine/init_weights_update_group``
      ``{"engine_rpc": "init_weight_transfer_engine", "init_info": info}``;
    - ``start_weight_update()``, ``update_weights(info)``, ``finish_weight_update()``:
      ``POST /engine/update_weights_from_distributed`` with that ``engine_rpc``
      (``is_checkpoint_format``, ``update_info``), each with NeMo RL's
      ``allow_unpaused: true, reset_prefix_cache: false`` (the constructor's
      ``allow_unpaused``/``reset_prefix_cache`` change them), and ``weight_version``
      on the finish when one is given (here or to ``finish_weight_update``);
    - ``shutdown_weight_transfer_engine()``: ``POST /engine/destroy_weights_update_group``.

    Blocking calls (plain ``urllib``, one request each, so calls from several
    threads overlap), as vLLM's trainer engines make them. ``admin_token``: as
    ``RefitClient``'s (None reads it as a bridge does). An answer other than
    ``status: ok`` raises ``RouteError`` with its message. ``call(route, body)``
    reaches any other route (``pause_generation``, ``resume_generation``, ...).
    """

    def __init__(
        self,
        worker_url: str,
        *,
        weight_version: str | None = None,
        allow_unpaused: bool = True,
        reset_prefix_cache: bool = False,
        timeout_s: float | None = 300.0,
        admin_token: str | AdminToken | None = None,
    ) -> None:
        self.worker_url = worker_url.rstrip("/")
        self.weight_version = weight_version
        self.flags = {"allow_unpaused": allow_unpaused, "reset_prefix_cache": reset_prefix_cache}
        self.timeout_s = timeout_s
        if isinstance(admin_token, str):
            admin_token = AdminToken(admin_token, "the admin_token argument")
        elif admin_token is None:
            admin_token = AdminToken.from_env()
        self._headers = {
            "Content-Type": "application/json",
            **(admin_token.header() if admin_token is not None else {}),
        }

    def call(self, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /engine/<route>``; the answer, or RouteError unless ``status: ok``."""
        request = urllib.request.Request(
            f"{self.worker_url}/engine/{route}",
            data=json.dumps(body or {}, allow_nan=False).encode(),
            headers=self._headers,
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if status != 200 or not isinstance(answer, dict):
            raise RouteError(f"{route}: HTTP {status}: {answer!r}")
        if answer.get("status") != "ok":
            raise RouteError(f"{route}: {answer.get('message', answer)}")
        return answer

    def _phase(self, engine_rpc: str, **kwargs: Any) -> dict[str, Any]:
        return self.call(
            "update_weights_from_distributed", {"engine_rpc": engine_rpc, **kwargs, **self.flags}
        )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call(
            "init_weights_update_group",
            {"engine_rpc": "init_weight_transfer_engine", "init_info": init_info},
        )

    def start_weight_update(self) -> None:
        self._phase("start_weight_update", is_checkpoint_format=True)

    def update_weights(self, update_info: Any) -> None:
        self._phase("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.weight_version
        if version is None:
            self._phase("finish_weight_update")
        else:
            self._phase("finish_weight_update", weight_version=version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("destroy_weights_update_group", {"engine_rpc": "shutdown_weight_transfer_engine"})
