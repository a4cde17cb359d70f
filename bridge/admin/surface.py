"""A worker's RL admin surface: one implementation, three spellings.

Trainers drive a generation worker in three spellings of the same operations:

- dynamo.vllm's (``dynamo.vllm --enable-rl``; NeMo RL): ``POST /engine/<name>``,
  a JSON body, always HTTP 200 with ``"status": "ok"|"error"``;
- vLLM 0.32's own (``VLLM_SERVER_DEV_MODE=1``; SkyRL): root-level paths such as
  ``POST /pause?mode=keep``, ``GET /is_paused``, vLLM's answers and status codes
  (``bridge.admin.vllm_routes``);
- newer Dynamo's vLLM sidecar (Prime-RL): ``POST /engine/control/<name>`` and
  ``/engine/update/<name>`` (``bridge.admin.sidecar_routes``).

Every one of them is a mapping onto the same handlers (``RlAdmin.operations()``),
so the admin token (the system port's middleware), the refit rules, the
writer's fence and the error messages are one; only the request's and answer's
shape and the status codes differ. ``listed()`` names every route of all three
for the ``rl`` endpoint's ``routes`` answer (Dynamo's ``/v1/rl/workers``).
"""

from __future__ import annotations

from bridge.admin import sidecar_routes, vllm_routes
from bridge.admin.http_routes import HttpRoute, refuse_overlap
from bridge.admin.rl_admin import RlAdmin, Route


class AdminSurface:
    """The routes of one worker's ``RlAdmin`` in all three spellings."""

    def __init__(self, admin: RlAdmin) -> None:
        # dynamo.vllm's: a name under /engine/, served by the system server.
        self.engine_routes: dict[str, Route] = admin.routes()
        ops = admin.operations()
        # The other two: whole paths, each with its own request and answer shape.
        self.http_routes: dict[str, HttpRoute] = refuse_overlap(
            vllm_routes.routes(ops), sidecar_routes.routes(ops)
        )
        shared = {f"/engine/{name}" for name in self.engine_routes} & set(self.http_routes)
        if shared:
            raise ValueError(f"RL routes served in two spellings: {sorted(shared)}")

    def listed(self) -> dict[str, Route]:
        """Every route by its listed name (a name under ``/engine/``, or vLLM's
        path from the root), for ``RLRouteRegistry``, which lists the names."""
        listed = dict(self.engine_routes)
        for route in self.http_routes.values():
            listed[route.listed] = _described_only
        return listed


async def _described_only(body: object) -> dict[str, object]:
    """The request plane describes the routes; it never calls one (dynamo.vllm's
    ``rl`` endpoint answers only ``routes``)."""
    return {"status": "error", "message": "served over HTTP on the worker's system port"}
