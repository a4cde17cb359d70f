"""The trainer's two ways into the fleet refit: every worker on the new weights, or none.

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

Either finds its workers through Dynamo's discovery with ``from_discovery(namespace)``
(``rl_client.fleet_discovery``: the workers registered now), instead of a list;
that, ``async with`` and ``resume`` are ``rl_client.fleet_client``'s, the same for both.

Each only carries the calls: the cycle and its rules are ``rl_client.fleet_cycle``'s,
the same for both; its report (``RefitReport``, ``RefitError``) and ``Deadlines``
live in ``rl_client.refit_report``. vLLM's weight-sync clients are
``rl_client.weight_sync``'s, as is ``RouteError``, which ``RefitClient`` raises too.
No Dynamo import here: trainers install only the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Self

import aiohttp
import grpc
from grpc_health.v1 import health_pb2

from engine_contract import TENSOR_STREAM_END_REVISION
from engine_contract.refit_rules import UPDATE_WAYS_OUT, pause_mode
from engine_contract.tensors import DEFAULT_CHUNK_BYTES, Tensor, update_requests
from engine_contract.v1 import engine_pb2 as pb
from rl_client.admin_token import AdminToken
from rl_client.committed import (
    CheckpointSource,
    CommittedStore,
    CommittedWeights,
    PushedSource,
    WeightSource,
)
from rl_client.fleet_client import FleetClient
from rl_client.fleet_cycle import RollbackTarget, Unanswered
from rl_client.fleet_discovery import FleetWorker
from rl_client.refit_report import Deadlines, RefitReport, Served, WorkerHealth, error_text
from rl_client.refit_rpc import DEFAULT_MAX_MESSAGE_BYTES, RefitRpc
from rl_client.tls import TlsOptions
from rl_client.weight_sync import RouteError

__all__ = ["EngineRefitClient", "RefitClient"]


def _count(answer: dict[str, Any]) -> int | None:
    """The engine's count of weight changes in a route's answer (None: a bridge
    or engine server that keeps none)."""
    value = answer.get("weight_changes")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class RefitClient(FleetClient):
    """The cycle over Dynamo workers' RL admin routes (their system URLs).

    ``admin_token``: the workers' token; None (the default) reads it from the
    environment as a bridge does (``AdminToken.from_env``), and sends none when
    neither variable is set. The routes load checkpoints only, and cannot tell
    which one a worker started on: a failed refit goes back to ``committed``
    (the checkpoint the fleet serves), else the ``store``'s record, else this
    client's last committed refit; with none of them ``refit`` refuses before
    any call. ``deadlines``: per worker and step (``Deadlines``)."""

    address_field = "admin_url"

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float | None = None,
        admin_token: str | AdminToken | None = None,
        committed: CommittedWeights | None = None,
        store: CommittedStore | None = None,
        deadlines: Deadlines | None = None,
    ) -> None:
        super().__init__(worker_urls, "worker URLs", committed, store, deadlines)
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        if isinstance(admin_token, str):
            admin_token = AdminToken(admin_token, "the admin_token argument")
        elif admin_token is None:
            admin_token = AdminToken.from_env()
        self._headers = admin_token.header() if admin_token is not None else {}
        self._session = session
        self._own_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    @classmethod
    def _for_workers(cls, workers: list[FleetWorker], **options: Any) -> Self:
        return cls([str(w.admin_url) for w in workers], **options)

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, worker: str, route: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        if self._session is None:
            # No cap on connections: every worker is called at once (aiohttp's default
            # of 100 would queue a larger fleet's pause behind the first hundred).
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with self._session.post(
            f"{worker}/engine/{route}",
            json=body or {},
            timeout=self._timeout,
            headers=self._headers,
        ) as resp:
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, None

    async def call(
        self, worker: str, route: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One route of one worker; RouteError unless it answered ``status: ok``."""
        status, answer = await self._post(worker, route, body)
        if status != 200 or not isinstance(answer, dict):
            raise RouteError(f"{route}: HTTP {status}: {answer!r}")
        if answer.get("status") != "ok":
            raise RouteError(f"{route}: {answer.get('message', answer)}")
        return answer

    def _fleet(self) -> list[str]:
        return self.worker_urls

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        await self.call(worker, "pause_generation", {"mode": mode, "clear_cache": clear_cache})

    async def _resume(self, worker: str) -> None:
        await self.call(worker, "resume_generation")

    async def _load(self, worker: str, source: WeightSource, expect: int | None) -> int | None:
        if not isinstance(source, CheckpointSource):
            raise RouteError(
                "the RL routes load checkpoints only; stream tensors over the contract"
            )
        body: dict[str, Any] = {"model_path": source.path}
        if expect is not None:
            body["expect_weight_changes"] = expect
        return _count(await self.call(worker, "update_weights_from_disk", body))

    async def _label(self, worker: str, version: str, expect: int | None) -> int | None:
        body: dict[str, Any] = {"weight_version": version}
        if expect is not None:
            body["expect_weight_changes"] = expect
        return _count(await self.call(worker, "set_weight_version", body))

    async def _changes(self, worker: str) -> int | None:
        return _count(await self.call(worker, "get_weight_version"))

    async def _serving(self, worker: str) -> Served:
        answer = await self.call(worker, "get_weight_version")
        mixed = answer.get("weights_mixed")
        return Served(
            str(answer.get("serving", answer.get("version"))),
            mixed if isinstance(mixed, str) else "",
            answer.get("weight_update_open") is True,
        )

    async def _health(self, worker: str) -> WorkerHealth:
        """The bridge's own view (``liveness_probe``): its engine server serving."""
        try:
            status, answer = await self._post(worker, "liveness_probe", None)
        except (aiohttp.ClientError, OSError):
            return WorkerHealth.UNREACHABLE
        if status == 200 and isinstance(answer, dict):
            if answer.get("status") == "ok":
                return WorkerHealth.SERVING
            if answer.get("alive") is False:
                return WorkerHealth.NOT_SERVING
        raise RouteError(f"liveness_probe: HTTP {status}: {answer!r}")

    async def _sleep(self, worker: str) -> None:
        await self.call(worker, "control/sleep", {"level": 1})

    def _loads(self, source: WeightSource) -> bool:
        return isinstance(source, CheckpointSource)

    async def _start_state(self) -> dict[str, RollbackTarget]:
        raise ValueError(
            "RefitClient cannot undo a failed refit without knowing the checkpoint the "
            "fleet serves now: give committed=CommittedWeights(version, "
            "CheckpointSource(path)), or a store= holding the fleet's record"
        )

    async def refit(
        self, model_path: str, version: str, *, mode: str = "wait", clear_cache: bool = True
    ) -> RefitReport:
        """Pause every worker (``mode``: wait for rollouts in flight, abort them, or
        keep them frozen), load ``model_path`` on all, and label them ``version``
        and resume once all loaded; otherwise all go back (``RefitError``)."""
        return await self._run(version, CheckpointSource(model_path), mode, clear_cache)

    async def versions(self) -> dict[str, Any]:
        answers = await asyncio.gather(
            *(self.call(w, "get_weight_version") for w in self.worker_urls)
        )
        return {w: a.get("version") for w, a in zip(self.worker_urls, answers, strict=True)}


class EngineRefitClient(FleetClient):
    """The cycle over engine servers' contract (gRPC), weights streamed or from a folder.

    ``tls``: TLS to the engine servers, as the bridge's ``--engine-tls-*`` options
    (a CA, and a client certificate and key for an mTLS engine server); None:
    plaintext. Open it inside the event loop that uses it. A failed refit goes
    back to ``committed``, else the ``store``'s record, else this client's last
    committed refit (streamed weights: it keeps the tensors, which must stay
    unchanged), else the checkpoint each engine server started on when none has
    had a version set since. ``deadlines``: per worker and step."""

    # The engine server's address as the worker's bridge dials it.
    address_field = "engine_address"

    def __init__(
        self,
        engine_addresses: Sequence[str],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: TlsOptions | None = None,
        committed: CommittedWeights | None = None,
        store: CommittedStore | None = None,
        deadlines: Deadlines | None = None,
    ) -> None:
        super().__init__(engine_addresses, "engine server addresses", committed, store, deadlines)
        self._engines = {
            a: RefitRpc.connect(a, tls=tls, max_message_bytes=max_message_bytes)
            for a in engine_addresses
        }
        self._chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_message_bytes // 2)

    @classmethod
    def _for_workers(
        cls, workers: list[FleetWorker], *, tls: TlsOptions | None = None, **options: Any
    ) -> Self:
        """ValueError when a worker's bridge reaches its engine over TLS and no
        ``tls`` is given."""
        over_tls = [w for w in workers if w.engine_tls]
        if over_tls and tls is None:
            raise ValueError(
                f"the engine servers {[w.engine_address for w in over_tls]} are reached over "
                "TLS: give tls= (as the bridges' --engine-tls-* options)"
            )
        return cls([str(w.engine_address) for w in workers], tls=tls, **options)

    async def close(self) -> None:
        await asyncio.gather(*(engine.close() for engine in self._engines.values()))

    def _fleet(self) -> list[str]:
        return list(self._engines)

    async def _pause(self, worker: str, mode: str, clear_cache: bool) -> None:
        await self._engines[worker].pause_generation(
            pb.PauseGenerationRequest(mode=pause_mode(mode), clear_cache=clear_cache)
        )

    async def _resume(self, worker: str) -> None:
        await self._engines[worker].resume_generation()

    async def _load(self, worker: str, source: WeightSource, expect: int | None) -> int | None:
        engine = self._engines[worker]
        if isinstance(source, CheckpointSource):
            options = pb.WeightUpdateOptions()
            if expect is not None:
                options.expect_weight_changes = expect
            answer = await engine.update_weights_from_path(
                pb.UpdateWeightsFromPathRequest(path=source.path, options=options)
            )
            return answer.result.weight_changes
        if source.tensors is not None:
            revision = (await engine.server_info()).contract_revision
            requests = update_requests(
                source.tensors,
                chunk_bytes=self._chunk_bytes,
                expect_weight_changes=expect,
                end_marker=revision >= TENSOR_STREAM_END_REVISION,
            )
            return (await engine.update_weights_from_tensors(requests)).result.weight_changes
        raise ValueError("weights pushed by a trainer, with no copy of the tensors")

    async def _label(self, worker: str, version: str, expect: int | None) -> int | None:
        request = pb.UpdateWeightVersionRequest(weight_version=version)
        if expect is not None:
            request.expect_weight_changes = expect
        return (await self._engines[worker].update_weight_version(request)).weight_changes

    async def _changes(self, worker: str) -> int | None:
        return (await self._engines[worker].server_info()).refit_state.weight_changes

    async def _serving(self, worker: str) -> Served:
        answer = await self._engines[worker].get_weight_version()
        return Served(answer.weight_version, answer.weights_mixed, answer.weight_update_open)

    async def _health(self, worker: str) -> WorkerHealth:
        try:
            status = await self._engines[worker].health()
        except grpc.aio.AioRpcError:
            return WorkerHealth.UNREACHABLE
        return (
            WorkerHealth.SERVING
            if status == health_pb2.HealthCheckResponse.SERVING
            else (WorkerHealth.NOT_SERVING)
        )

    async def _sleep(self, worker: str) -> None:
        await self._engines[worker].sleep(pb.SleepRequest(level=1, mode=pb.PAUSE_MODE_ABORT))

    def _loads(self, source: WeightSource) -> bool:
        return True

    async def _start_state(self) -> dict[str, RollbackTarget]:
        limit = self.deadlines.control_s

        async def one(worker: str) -> RollbackTarget:
            try:
                async with asyncio.timeout(limit):
                    info = await self._engines[worker].server_info()
            except TimeoutError:
                raise Unanswered({worker: f"did not answer within {limit:g} s"}) from None
            except grpc.aio.AioRpcError as e:
                raise Unanswered({worker: error_text(e)}) from None
            state = info.refit_state
            why = (
                f"serves version {state.weight_version!r} set by a refit this client did not make"
                if state.weight_version_declared
                else "names no checkpoint it started on"
                if not info.model_path
                else ""
            )
            if why:
                raise ValueError(
                    f"engine server {worker} {why}, so a failed refit could not be undone: "
                    "give committed=CommittedWeights(version, source), or a store= holding "
                    "the fleet's record"
                )
            return RollbackTarget(state.weight_version, CheckpointSource(info.model_path))

        workers = self._fleet()
        states = await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
        unanswered: dict[str, str] = {}
        for state in states:
            if isinstance(state, ValueError):
                raise state
            if isinstance(state, Unanswered):
                unanswered |= state.errors
            elif isinstance(state, BaseException):
                raise state
        if unanswered:
            raise Unanswered(unanswered)
        return {w: s for w, s in zip(workers, states, strict=True) if isinstance(s, RollbackTarget)}

    async def refit(
        self,
        version: str,
        *,
        tensors: Sequence[Tensor] | None = None,
        path: str | None = None,
        mode: str = "wait",
        clear_cache: bool = True,
    ) -> RefitReport:
        """Pause every engine server, load ``tensors`` (streamed to each) or
        ``path`` on all, and label them ``version`` and resume once all loaded;
        otherwise all go back (``RefitError``). Streamed tensors are kept (not
        copied) as what the next failed refit goes back to."""
        if (tensors is None) == (path is None):
            raise ValueError("give either tensors or path")
        source: WeightSource = CheckpointSource(path) if path is not None else PushedSource(tensors)
        return await self._run(version, source, mode, clear_cache)

    @property
    def engines(self) -> list[str]:
        """The engine servers' addresses, as given."""
        return list(self._engines)

    async def restore(self, worker: str, *, mode: str = "abort") -> bool:
        """Put one engine server that lags the fleet (restarted: it serves its start
        weights; or left part old, part new by an update that ended unfinished:
        ``weights_mixed``, contract revision 12) back on the committed weights:
        pause (``mode``: what it runs now runs on other weights), load, label,
        resume. Under the lock every refit of this client takes and the fleet's
        lease (with a store), so it never interleaves with a refit of this trainer
        or another, and checked again there: False when the engine serves the
        committed version already, whole (a refit brought it there meanwhile).
        ValueError when nothing is committed, the committed weights cannot be sent
        again (``CommittedWeights.resendable``), or a weight-transfer update is open
        on the engine (the engine refuses a load under it, which would land between
        its writer's rounds, and would not resume: its writer ends it)."""
        async with self._one_at_a_time, self._leased():  # one writer per fleet
            committed = self.committed
            if committed is None or not committed.resendable:
                raise ValueError(
                    f"no committed weights this client can send again ({committed}): "
                    "refit first, or give committed= with the tensors or a checkpoint"
                )
            engine, limits = self._engines[worker], self.deadlines
            async with asyncio.timeout(limits.control_s):
                serving = await engine.get_weight_version()
            current = serving.declared and serving.weight_version == committed.version
            if current and not serving.weights_mixed:
                return False
            if serving.weight_update_open:
                raise ValueError(
                    f"engine server {worker} has a weight-transfer update open "
                    f"({serving.weights_mixed or 'no UpdateWeights round sent yet'}): "
                    "the engine refuses a load under it (it would land between its writer's "
                    f"rounds); {UPDATE_WAYS_OUT}"
                )
            async with asyncio.timeout(limits.pause_s):
                await self._pause(worker, mode, clear_cache=True)
            try:
                async with asyncio.timeout(limits.control_s):
                    changes = await self._changes(worker)
                async with asyncio.timeout(limits.update_s):
                    changes = await self._load(worker, committed.source, changes)
                async with asyncio.timeout(limits.control_s):
                    await self._label(worker, committed.version, changes)
            finally:  # paused here: resumed however the restore ends
                async with asyncio.timeout(limits.control_s):
                    await self._resume(worker)
            return True
