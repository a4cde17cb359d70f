"""The admin token of the worker's system port: who may drive the RL routes.

Dynamo serves ``/engine/*`` with no authentication (dynamo.vllm too): whoever
reaches the port can pause the worker, put it to sleep, relabel its weights or
have it load a checkpoint. With a token set, every request but the probes
(``/health``, ``/live``, ``/metrics``) must carry ``Authorization: Bearer
<token>``; others get HTTP 401. The token comes from a file or the environment,
never from a flag value (which ``ps`` shows to every user), is compared in
constant time, and is never logged (``AdminToken``'s repr hides it).

No Dynamo import: trainers (``bridge.refit``) read the token here too.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

log = logging.getLogger(__name__)

# The token itself, for a trainer or a bridge that has no file (ours, not DYN_*).
TOKEN_ENV = "BRIDGE_ADMIN_TOKEN"
# A file holding it (the bridge's --admin-token-file; read by trainers too).
TOKEN_FILE_ENV = "BRIDGE_ADMIN_TOKEN_FILE"
# Open without a token: the probes of orchestrators and Prometheus.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})
_REALM = 'Bearer realm="worker-admin"'
# At most one log line per this many seconds about refused requests (a flood of
# them must not flood the log).
_REFUSAL_LOG_INTERVAL_S = 10.0


class AdminToken:
    """A bearer token; compared in constant time, never shown."""

    __slots__ = ("_secret", "source")

    def __init__(self, secret: str, source: str) -> None:
        problem = token_problem(secret)
        if problem is not None:
            raise ValueError(f"the admin token from {source} {problem}")
        self._secret = secret.encode("ascii")
        # Where it came from, for messages ("file /run/secrets/x", "$BRIDGE_ADMIN_TOKEN").
        self.source = source

    def __repr__(self) -> str:
        return f"AdminToken(from {self.source}, hidden)"

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AdminToken:
        """The file's content without surrounding whitespace (a trailing newline);
        ValueError naming the file when it cannot be read or holds nothing."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the admin token file {os.fspath(path)}: {e}") from None
        return cls(text.strip(), f"file {os.fspath(path)}")

    @classmethod
    def resolve(
        cls, path: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None
    ) -> AdminToken | None:
        """The token a bridge or a trainer uses: from ``path`` if given, else from
        ``$BRIDGE_ADMIN_TOKEN``; None when neither is set. A set but empty
        variable is refused (fail closed: it was meant to hold a token)."""
        if path:
            return cls.from_file(path)
        env = os.environ if environ is None else environ
        value = env.get(TOKEN_ENV)
        if value is None:
            return None
        return cls(value.strip(), f"${TOKEN_ENV}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AdminToken | None:
        """As a bridge started in this environment reads it: the file named by
        ``$BRIDGE_ADMIN_TOKEN_FILE``, else ``$BRIDGE_ADMIN_TOKEN``."""
        env = os.environ if environ is None else environ
        return cls.resolve(env.get(TOKEN_FILE_ENV) or None, env)

    def header(self) -> dict[str, str]:
        """The request header that carries it."""
        return {"Authorization": f"Bearer {self._secret.decode('ascii')}"}

    def matches(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries this token."""
        if not authorization:
            return False
        scheme, _, presented = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        try:
            candidate = presented.strip().encode("ascii")
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(candidate, self._secret)


def token_problem(secret: str) -> str | None:
    """Why ``secret`` cannot be a token, or None. It travels in an HTTP header:
    visible ASCII only. Never quotes the token."""
    if not secret:
        return "is empty"
    for index, char in enumerate(secret):
        if not "!" <= char <= "~":
            return (
                f"holds a character that is not visible ASCII at index {index}: a token "
                "travels in an HTTP header"
            )
    return None


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
        "trainers then send 'Authorization: Bearer <token>' (bridge.refit.RefitClient "
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
