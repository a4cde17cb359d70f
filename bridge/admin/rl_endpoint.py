"""The ``<namespace>.<component>.rl`` request-plane endpoint (``--enable-rl``).

dynamo.vllm describes its RL admin routes there (method ``routes``: their
names, the worker's system URL, the weight world size), so that a trainer can
find every worker's admin address through Dynamo's discovery: a frontend run
with ``DYN_ENABLE_RL`` lists every such endpoint at ``GET /v1/rl/workers`` (on
``DYN_RL_PORT``), each with what this answer says and the model its instance
serves. The names are all three spellings' (``bridge.admin.surface``): a name
under ``/engine/`` (dynamo.vllm's, the sidecar's ``control/...`` and
``update/...``), or a path from the system URL's root (vLLM's, ``/pause``...).

A backend engine never gets the worker's runtime, so the bridge starts a second,
small runtime (the carrier) in the same process for this one endpoint, without a
system server of its own (the worker's system port is the bridge's already), and
answers with Dynamo's own ``RLRouteRegistry``. The carrier registers under a
component and an endpoint name of its own (``<component>_rl.carrier``: not
``rl``, so that a frontend listing ``rl`` endpoints lists each worker once);
``bridge.admin.instance_alias`` then lists it as ``<namespace>.<component>.rl``
under the worker's own instance id, one id for ``generate`` and ``rl`` as
dynamo.vllm has (NeMo RL's readiness rule).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from dynamo.runtime import DistributedRuntime

from bridge.admin.instance_alias import (
    CARRIER_ENDPOINT,
    InstanceAlias,
    alias_store,
    carrier_component,
)
from bridge.admin.rl_admin import Route
from bridge.config import BridgeConfig
from bridge.dynamo_compat import rl_route_registry
from bridge.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class _SystemUrl:
    """What RLRouteRegistry asks the runtime for: the public system URL."""

    def __init__(self, url: str | None) -> None:
        self._url = url

    def system_status_server_url(self) -> str | None:
        return self._url


class RlEndpoint:
    def __init__(
        self,
        config: BridgeConfig,
        routes: Mapping[str, Route],
        system_url: str | None,
        worker_id: int,
        world_size: int = 1,
    ) -> None:
        self._config = config
        self._worker_id = worker_id
        # The worker's ranks in a trainer's weight-transfer group, as vLLM's
        # /get_world_size answers them (bridge.admin.rl_admin.weight_world_size).
        self.registry = rl_route_registry(
            _SystemUrl(system_url), logger_=log, world_size=world_size
        )
        self.registry.add_routes(routes)
        self._runtime: Any = None
        self._serving: asyncio.Future[Any] | None = None
        self._alias: InstanceAlias | None = None
        # The carrier's own record, once started: its lease is the alias's too.
        self.carrier_key = ""

    async def start(self) -> None:
        cfg = self._config
        # Read by the runtime when it starts: without it, no second system server.
        saved = os.environ.pop("DYN_SYSTEM_PORT", None)
        try:
            self._runtime = DistributedRuntime(
                asyncio.get_running_loop(),
                cfg.discovery_backend,
                cfg.request_plane,
                event_plane=cfg.event_plane,
            )
        finally:
            if saved is not None:
                os.environ["DYN_SYSTEM_PORT"] = saved
        carrier = self._runtime.endpoint(
            f"{cfg.namespace}.{carrier_component(cfg.component)}.{CARRIER_ENDPOINT}"
        )
        self._serving = asyncio.ensure_future(carrier.serve_endpoint(self._dispatch))
        self._alias = InstanceAlias(
            alias_store(cfg.discovery_backend),
            namespace=cfg.namespace,
            component=cfg.component,
            endpoint="rl",
            worker_id=self._worker_id,
            carrier_id=carrier.connection_id(),
        )
        self.carrier_key = self._alias.carrier_key
        await self._alias.publish()
        log.info(
            "RL admin routes described on the request plane at dyn://%s.%s.rl (instance %x)",
            cfg.namespace,
            cfg.component,
            self._worker_id,
        )

    async def _dispatch(self, request: Any = None, context: Any = None) -> Any:
        async for answer in self.registry.dispatch_stream(request):
            yield answer

    async def stop(self) -> None:
        alias, self._alias = self._alias, None
        if alias is not None:
            await alias.withdraw()
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.shutdown()
        serving, self._serving = self._serving, None
        await cancel_and_wait(serving)
