"""The admin token of the worker's system port: who may drive the RL routes.

Dynamo serves ``/engine/*`` with no authentication (dynamo.vllm too): whoever
reaches the port can pause the worker, put it to sleep, relabel its weights or
have it load a checkpoint. With a token set, every request but the probes
(``/health``, ``/live``, ``/metrics``) must carry ``Authorization: Bearer
<token>``; others get HTTP 401. The token comes from a file or the environment,
never from a flag value (which ``ps`` shows to every user), is compared in
constant time, and is never logged (``AdminToken``'s repr hides it).

The token itself (``AdminToken``: read, compared, never shown) is
``rl_client.admin_token``, which trainers (``rl_client.refit``) use too; this
module is the server side: the middleware and the start-up warning.
"""

from __future__ import annotations

import ipaddress
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from rl_client.admin_token import TOKEN_ENV, TOKEN_FILE_ENV, AdminToken

log = logging.getLogger(__name__)

# Open without a token: the probes of orchestrators and Prometheus.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})
_REALM = 'Bearer realm="worker-admin"'
# At most one log line per this many seconds about refused requests (a flood of
# them must not flood the log).
_REFUSAL_LOG_INTERVAL_S = 10.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address the port binds) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost, "" or 0.0.0.0-like: assume beyond


def exposure_warning(host: str, port: int, token: AdminToken | None) -> str | None:
    """The start-up warning when anyone on the network can drive the routes."""
    if token is not None or is_loopback(host):
        return None
    shown = host or "0.0.0.0"
    return (
        f"the RL admin routes (/engine/*) listen on {shown}:{port} with no admin token: "
        "anyone who can reach this port can pause this worker, put it to sleep, relabel "
        "its weights or make it load any checkpoint its engine server can read. Set a "
        f"token with --admin-token-file PATH (or {TOKEN_FILE_ENV}, or {TOKEN_ENV}); "
        "trainers then send 'Authorization: Bearer <token>' (rl_client.refit.RefitClient "
        f"reads {TOKEN_ENV} / {TOKEN_FILE_ENV}). Or listen on loopback only: "
        "DYN_SYSTEM_HOST=127.0.0.1"
    )


def unauthorized(message: str, *, wrong: bool) -> web.Response:
    """HTTP 401 with the routes' error shape and the Bearer challenge."""
    challenge = f'{_REALM}, error="invalid_token"' if wrong else _REALM
    return web.json_response(
        {"status": "error", "message": message},
        status=401,
        headers={"WWW-Authenticate": challenge},
    )


def auth_middleware(token: AdminToken) -> Middleware:
    """Every path but the probes needs the token (deny by default: no path spelling
    reaches a route, ours or one proxied to Dynamo's server, without it)."""
    last_logged = float("-inf")
    refused = 0  # since the last line about them

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal last_logged, refused
        if request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization")
        if token.matches(header):
            return await handler(request)
        what = "no" if header is None else "a wrong"
        refused += 1
        now = time.monotonic()
        if now - last_logged >= _REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "refused %s %r from %s: %s admin token (%d refused since the last such line)",
                request.method,
                request.path[:200],
                request.remote,
                what,
                refused,
            )
            last_logged, refused = now, 0
        return unauthorized(
            f"this worker's admin routes need its admin token: {what} token was sent "
            "(send 'Authorization: Bearer <token>')",
            wrong=header is not None,
        )

    return middleware
