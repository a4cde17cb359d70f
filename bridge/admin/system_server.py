"""The worker's system port: the RL admin routes here, everything else Dynamo's own.

dynamo.vllm serves its RL routes as ``/engine/<name>`` on the runtime's system
server (``DYN_SYSTEM_PORT``) through ``DistributedRuntime.register_engine_route``.
A backend engine (``dynamo.common.backend``) never gets its runtime, so cannot.
So the bridge takes the user's system port itself: before the runtime starts,
its system server is moved to an internal loopback port (in the environment it
reads), and this server answers the RL routes and passes every other request
(``/health``, ``/live``, ``/metrics``, any other ``/engine/...``) to it, status,
headers and body unchanged, except ``GET /metrics``, which gets the engine's own
series (vLLM's ``vllm:``, ``bridge.engine_metrics``) after Dynamo's, where
dynamo.vllm would have published them.

The RL routes come in three spellings (``bridge.admin.surface``): dynamo.vllm's
names under ``/engine/`` (``routes``: a dict in, a dict out, HTTP 200), and
vLLM's and the Dynamo sidecar's whole paths (``http_routes``: each answers the
request itself, with its own status codes).

With an admin token (``bridge.admin.auth``) every path but ``/health``,
``/live`` and ``/metrics`` needs it, Dynamo's own ``/engine/...`` included.
Bodies and answers are strict JSON: ``NaN`` and ``Infinity`` are refused on the
way in and can never leave (``allow_nan=False``).

A request aiohttp cannot parse (a request line or header field over its limit,
or malformed) is answered here, not by aiohttp: its own answer quotes the
offending bytes back and its log line is a traceback carrying them, and a
header may hold a credential. Ours is HTTP 431 (over the limit) or 400, and at
most one log line a minute counts them, naming no bytes (``_Connection``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from bridge.admin import port_claims
from bridge.admin.auth import auth_middleware, exposure_warning
from bridge.admin.http_routes import HttpRoute
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

# aiohttp's own limit (its default for both), named: a request line, or a header
# field (name and value), longer than this is answered 431. The admin token's cap
# (rl_client.admin_token.MAX_TOKEN_BYTES) leaves its header well inside.
MAX_LINE_BYTES = 8190
# At most one log line per this many seconds about requests aiohttp could not
# parse (a flood of them must not flood the log).
_UNPARSABLE_LOG_INTERVAL_S = 60.0


def _refuse_constant(name: str) -> Any:
    """json.loads takes NaN, Infinity and -Infinity; JSON has no such values."""
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes | str) -> Any:
    """A request body as JSON, refusing the non-JSON constants json.loads allows."""
    return json.loads(raw, parse_constant=_refuse_constant)


async def engine_route_body(request: web.Request) -> Any:
    """An engine route's body as Dynamo's system server reads it, for every
    spelling served under ``/engine/``: a GET or an empty body is ``{}``, else
    strict JSON (ValueError, or RecursionError when nested too deep, for what
    is not; each spelling answers that in its own words)."""
    raw = await request.read()
    return strict_json(raw) if raw.strip() else {}


# How long start() gives Dynamo's system server to hold its internal port (it has
# bound it by the time the runtime hands the worker over; a margin, not a wait).
_INTERNAL_BIND_WAIT_S = 5.0
# Where the internal port is drawn from: below 32768, where Linux hands out none of
# its ephemeral ports. No other bridge on this host is handed it meanwhile
# (``port_claims``), but a process that picks its own ports (another worker's
# system port, say) can still bind it before Dynamo does: SystemServer.start()
# checks that Dynamo's server holds it.
INTERNAL_PORTS = range(20000, _MAX_DYNAMO_PORT + 1)


def free_dynamo_port(ports: range = INTERNAL_PORTS) -> int:
    """A loopback port in ``ports`` free right now, that Dynamo can take."""
    try:
        return port_claims.draw(ports)
    except OSError as e:
        raise OSError(f"{e} for Dynamo's system server") from None


def _listening_inodes(port: int) -> set[int] | None:
    """The socket inodes listening on loopback ``port`` (None: no /proc to read)."""
    wanted = f":{port:04X}"
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            return None
        for row in rows:
            fields = row.split()
            if fields[1].endswith(wanted) and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(int(fields[9]))
    return inodes


def _own_socket_inodes() -> set[int]:
    inodes: set[int] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def held_here(port: int) -> bool:
    """Whether this process listens on loopback ``port`` (True where /proc cannot
    tell: no check rather than a false alarm)."""
    listening = _listening_inodes(port)
    if listening is None:
        return True
    return bool(listening & _own_socket_inodes())


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


class _Unparsable:
    """The requests aiohttp could not parse, counted for a throttled log line."""

    def __init__(self) -> None:
        self.last_logged = float("-inf")
        self.unlogged = 0  # since the last line

    def answer(self, exc: BadHttpMessage, remote: str | None) -> web.Response:
        """The answer, and at most one log line per interval; neither carries the
        request's bytes (``exc``'s message quotes them: never used)."""
        if isinstance(exc, LineTooLong):
            status = 431
            what = f"a request line or header field over {MAX_LINE_BYTES} bytes"
        else:
            status, what = 400, f"a request aiohttp could not parse ({type(exc).__name__})"
        self.unlogged += 1
        now = time.monotonic()
        if now - self.last_logged >= _UNPARSABLE_LOG_INTERVAL_S:
            log.warning(
                "answered %d to %s from %s (%d such since the last line about them)",
                status,
                what,
                remote,
                self.unlogged,
            )
            self.last_logged, self.unlogged = now, 0
        response = web.json_response({"status": "error", "message": what}, status=status)
        response.force_close()  # where the next request starts is unknown
        return response


class _Connection(RequestHandler):
    """aiohttp's connection, but a request it cannot parse is answered by
    ``_Unparsable`` instead of aiohttp's ``handle_error`` (a traceback in the log
    and the bytes quoted back, both carrying the header)."""

    __slots__ = ("_unparsable",)

    def __init__(self, manager: _Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._unparsable = manager.unparsable

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, BadHttpMessage) and request.writer.output_size == 0:
            return self._unparsable.answer(exc, request.remote)
        return super().handle_error(request, status, exc, message)


class _Server(web.Server):
    """aiohttp's server, making ``_Connection``s (aiohttp has no setting for it)."""

    def __init__(self, *args: Any, unparsable: _Unparsable, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unparsable = unparsable

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    """aiohttp's app runner, serving through a ``_Server``."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.unparsable = _Unparsable()

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # the app started and frozen, as ever
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            unparsable=self.unparsable,
            **made._kwargs,
        )


class SystemServer:
    """Serves ``routes`` as ``/engine/<name>`` and ``http_routes`` at their paths;
    proxies the rest to Dynamo's server."""

    def __init__(
        self,
        address: SystemPort,
        routes: Mapping[str, Route],
        admin_token: AdminToken | None = None,
        extra_metrics: ExtraMetrics | None = None,
        http_routes: Mapping[str, HttpRoute] | None = None,
    ) -> None:
        self.address = address
        self._routes = dict(routes)
        self._http_routes = dict(http_routes or {})
        self._token = admin_token
        self._extra_metrics = extra_metrics
        self._runner: _Runner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def check_internal_port(self) -> None:
        """Once Dynamo's runtime (and so its system server) has started: RuntimeError
        when Dynamo's server did not get the internal port. Another process holds it
        then, and every request passed there would reach that process (a worker
        started again draws another port)."""
        internal = self.address.internal_port
        for _ in range(int(_INTERNAL_BIND_WAIT_S / 0.05)):
            if held_here(internal):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(
            f"Dynamo's system server could not take its internal port 127.0.0.1:{internal} "
            "(another process listens there, or nothing does); this worker's /health, "
            "/live and /metrics would not be its own: start it again"
        )

    async def start(self) -> None:
        middlewares = [auth_middleware(self._token)] if self._token is not None else []
        app = web.Application(client_max_size=16 << 20, middlewares=middlewares)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = _Runner(
            app, access_log=None, max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES
        )
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
        http_route = self._http_routes.get(path)
        if http_route is not None:
            return await http_route.handle(request)
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
        try:
            body = await engine_route_body(request)
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
