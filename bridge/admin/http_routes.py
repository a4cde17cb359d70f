"""What the other two spellings of the RL routes share: a path served on the
worker's system port, and the JSON answers they write.

dynamo.vllm's spelling is a name under ``/engine/`` whose handler takes a dict
and answers a dict, always HTTP 200 (``bridge.admin.system_server``). vLLM's own
routes (``bridge.admin.vllm_routes``) and the Dynamo sidecar's
(``bridge.admin.sidecar_routes``) read query parameters, check the method, and
answer with status codes of their own, so each of their paths is an
``HttpRoute``: the whole request in, the whole answer out, over the same
handlers (``RlAdmin.operations()``). Answers are strict JSON, as everywhere on
the port: a non-finite number can never leave.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from bridge.admin.answers import Body

# One handler of RlAdmin.operations(): a dynamo.vllm-shaped body in, its answer out.
Operation = Callable[[Any], Awaitable[Body]]
Operations = Mapping[str, Operation]
Handle = Callable[[web.Request], Awaitable[web.StreamResponse]]

_dumps = functools.partial(json.dumps, allow_nan=False)


@dataclass(frozen=True)
class HttpRoute:
    """One path of a spelling. ``listed``: its name in the ``rl`` endpoint's
    ``routes`` answer (a name under ``/engine/``, or a path from the root: vLLM's)."""

    path: str
    listed: str
    handle: Handle


def require(ops: Operations, needs: Iterable[str], spelling: str) -> Operations:
    """``ops``, checked to hold every handler ``spelling``'s paths call: a missing
    one is a programming error, raised when the routes are built rather than
    met by the first request to that path."""
    missing = sorted(set(needs) - set(ops))
    if missing:
        raise ValueError(f"{spelling} RL routes need the handlers {missing}")
    return ops


def fence(body: Body) -> Body:
    """The writer's fence of a body (``expect_weight_changes``), passed on to the
    handler as it came: both spellings take it as an extra key of vLLM's body."""
    return {k: body[k] for k in ("expect_weight_changes",) if k in body}


def json_answer(
    body: Mapping[str, Any], status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A JSON answer, refusing what JSON cannot carry (``NaN``, ``Infinity``)."""
    return web.json_response(dict(body), status=status, headers=headers, dumps=_dumps)


def refuse_overlap(*tables: Mapping[str, HttpRoute]) -> dict[str, HttpRoute]:
    """The tables merged; two spellings claiming one path is a programming error."""
    merged: dict[str, HttpRoute] = {}
    for table in tables:
        for path, route in table.items():
            if path in merged:
                raise ValueError(f"two RL routes claim {path}")
            merged[path] = route
    return merged
