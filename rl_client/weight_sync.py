"""vLLM's ``VLLMWeightSyncClient``, for its trainer-side weight-transfer engines
(NCCL; ``gloo`` on CPUs), two ways: ``ContractWeightSyncClient`` (the contract's
phases, gRPC) and ``DynamoWeightSyncClient`` (a worker's RL routes, called as
NeMo RL calls them).

Apart from the fleet refit (``rl_client.refit``) because vLLM's engine drives
the phases, one worker at a time, from its own threads: blocking calls, no
cycle, no rollback. ``RouteError`` lives here, the lowest module that raises
it; ``RefitClient`` raises it too. No Dynamo import here: trainers install only
the ``driver`` extra.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Awaitable
from typing import Any, TypeVar

from engine_contract.v1 import engine_pb2 as pb
from rl_client.admin_token import AdminToken
from rl_client.refit_rpc import RefitRpc
from rl_client.tls import TlsOptions

__all__ = ["ContractWeightSyncClient", "DynamoWeightSyncClient", "RouteError"]

T = TypeVar("T")


class RouteError(RuntimeError):
    """A route answered ``{"status": "error"}`` (or not JSON, or not 200)."""


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
