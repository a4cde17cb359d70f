"""The worker's system port: the RL admin routes here, everything else Dynamo's own.

dynamo.vllm serves its RL routes as ``/engine/<name>`` on the runtime's system
server (``DYN_SYSTEM_PORT``) through ``DistributedRuntime.register_engine_route``.
A backend engine (``dynamo.common.backend``) never gets its runtime, so cannot.
So the bridge takes the user's system port itself: before the runtime starts,
its system server is moved to an internal loopback port (in the environment it
reads), and this server answers the RL routes and passes every other request
(``/health``, ``/live``, ``/metrics``, ``/engine/control/...``) to it, status,
headers and body unchanged, except ``GET /metrics``, which gets the engine's own
series (vLLM's ``vllm:``, ``bridge.engine_metrics``) after Dynamo's, where
dynamo.vllm would have published them.

With an admin token (``bridge.admin.auth``) every path but ``/health``,
``/live`` and ``/metrics`` needs it, Dynamo's own ``/engine/...`` included.
Bodies and answers are strict JSON: ``NaN`` and ``Infinity`` are refused on the
way in and can never leave (``allow_nan=False``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from bridge.admin.auth import auth_middleware, exposure_warning
from rl_client.admin_token import AdminToken

log = logging.getLogger(__name__)

Route = Callable[[Any], Awaitable[dict[str, Any]]]
# () -> exposition text to add to /metrics ("" for none); never raises.
ExtraMetrics = Callable[[], Awaitable[str]]

# Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit number.
_MAX_DYNAMO_PORT = 32767
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


_dumps = functools.partial(json.dumps, allow_nan=False)


def _refuse_constant(name: str) -> Any:
    """json.loads takes NaN, Infinity and -Infinity; JSON has no such values."""
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes | str) -> Any:
    """A request body as JSON, refusing the non-JSON constants json.loads allows."""
    return json.loads(raw, parse_constant=_refuse_constant)


def free_dynamo_port() -> int:
    """A free loopback port Dynamo can take (below 32768, where Linux hands out
    none of its ephemeral ports, so a collision is unlikely until Dynamo binds)."""
    for _ in range(200):
        port = random.randint(20000, _MAX_DYNAMO_PORT)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free port below 32768 for Dynamo's system server")


@dataclass
class SystemPort:
    """The user's system address (served here) and Dynamo's, moved inside."""

    host: str
    port: int
    internal_port: int

    @classmethod
    def claim(cls, environ: MutableMapping[str, str] | None = None) -> SystemPort | None:
        """Take over ``DYN_SYSTEM_PORT`` (before Dynamo's runtime starts); None when
        the worker has no system server."""
        env = os.environ if environ is None else environ
        raw = env.get("DYN_SYSTEM_PORT", "")
        enabled = env.get("DYN_SYSTEM_ENABLED", "true").strip().lower()
        if not raw or enabled in ("0", "false", "no", "off"):
            return None
        try:
            port = int(raw)
        except ValueError:
            raise ValueError(f"DYN_SYSTEM_PORT must be a port number, got {raw!r}") from None
        if port <= 0:
            return None
        internal = free_dynamo_port()
        claimed = cls(env.get("DYN_SYSTEM_HOST", "0.0.0.0"), port, internal)
        env["DYN_SYSTEM_PORT"] = str(internal)
        env["DYN_SYSTEM_HOST"] = "127.0.0.1"
        return claimed

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


class SystemServer:
    """Serves ``routes`` as ``/engine/<name>``; proxies the rest to Dynamo's server."""

    def __init__(
        self,
        address: SystemPort,
        routes: Mapping[str, Route],
        admin_token: AdminToken | None = None,
        extra_metrics: ExtraMetrics | None = None,
    ) -> None:
        self.address = address
        self._routes = dict(routes)
        self._token = admin_token
        self._extra_metrics = extra_metrics
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        middlewares = [auth_middleware(self._token)] if self._token is not None else []
        app = web.Application(client_max_size=16 << 20, middlewares=middlewares)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.address.host, self.address.port)
        await site.start()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), auto_decompress=False
        )
        log.info(
            "system port %s: RL admin routes here, the rest passed to Dynamo's system server "
            "on 127.0.0.1:%d",
            self.address.url,
            self.address.internal_port,
        )
        if self._token is not None:
            log.info(
                "system port: every path but /health, /live, /metrics needs the admin "
                "token (from %s)",
                self._token.source,
            )
        warning = exposure_warning(self.address.host, self.address.port, self._token)
        if warning is not None:
            log.warning(warning)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path.startswith("/engine/") and path[len("/engine/") :] in self._routes:
            return await self._route(path[len("/engine/") :], request)
        if path == "/metrics" and request.method == "GET" and self._extra_metrics is not None:
            return await self._metrics(request, self._extra_metrics)
        return await self._proxy(request)

    async def _metrics(self, request: web.Request, extra: ExtraMetrics) -> web.StreamResponse:
        """Dynamo's /metrics with ``extra`` after it, both asked at once (``extra``
        bounds its own wait). Asked uncompressed, so that text can be added; an
        answer that is not plain Prometheus text passes unchanged."""
        answer, more = await asyncio.gather(self._proxy(request, plain=True), extra())
        if (
            more
            and isinstance(answer, web.Response)
            and answer.status == 200
            and answer.content_type == "text/plain"
            and "Content-Encoding" not in answer.headers
            and isinstance(answer.body, bytes)
        ):
            body = answer.body
            if body and not body.endswith(b"\n"):
                body += b"\n"
            answer.body = body + more.encode()
        return answer

    async def _route(self, name: str, request: web.Request) -> web.Response:
        """As Dynamo's own engine routes: GET or an empty body is ``{}``; invalid
        JSON is HTTP 400; the handler's dict is the answer."""
        raw = await request.read()
        body: Any = {}
        if raw.strip():
            try:
                body = strict_json(raw)
            except (ValueError, RecursionError) as e:
                return web.json_response(
                    {"error": "Invalid JSON", "message": f"request body is not JSON: {e!s:.200}"},
                    status=400,
                )
        answer = await self._routes[name](body)
        try:
            return web.json_response(answer, dumps=_dumps)
        except (TypeError, ValueError) as e:
            log.error("RL route %s answered what JSON cannot carry: %s", name, e)
            return web.json_response(
                {"status": "error", "message": f"the answer is not JSON: {e!s:.200}"}, status=500
            )

    async def _proxy(self, request: web.Request, plain: bool = False) -> web.StreamResponse:
        """Dynamo's answer to ``request``; ``plain``: asked without compression."""
        session = self._session
        if session is None:
            return web.Response(status=503, text="starting")
        target = f"http://127.0.0.1:{self.address.internal_port}{request.path_qs}"
        # The admin token stays here: Dynamo's server has no use for it.
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP_BY_HOP and k.lower() != "authorization"
        }
        if plain:  # aiohttp would ask for gzip itself
            headers = {k: v for k, v in headers.items() if k.lower() != "accept-encoding"}
            headers["Accept-Encoding"] = "identity"
        try:
            async with session.request(
                request.method, target, headers=headers, data=await request.read()
            ) as upstream:
                data = await upstream.read()
                out_headers = {
                    k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP
                }
                return web.Response(status=upstream.status, headers=out_headers, body=data)
        except aiohttp.ClientError as e:
            return web.json_response(
                {"error": "Unavailable", "message": f"Dynamo's system server: {e}"}, status=503
            )
