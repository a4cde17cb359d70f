"""The admin token of a worker's system port, as a client sends it and a bridge
checks it: read from a file or the environment, never from a flag value (which
``ps`` shows to every user), compared in constant time, never logged
(``AdminToken``'s repr hides it).

The server side (the aiohttp middleware that answers 401, the start-up warning)
is the bridge's: ``bridge.admin.auth``. No Dynamo, no aiohttp import here:
trainers (``rl_client.refit``) read the token with the ``driver`` extra alone.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

# The token itself, for a trainer or a bridge that has no file (ours, not DYN_*).
TOKEN_ENV = "BRIDGE_ADMIN_TOKEN"
# A file holding it (the bridge's --admin-token-file; read by trainers too).
TOKEN_FILE_ENV = "BRIDGE_ADMIN_TOKEN_FILE"
# The longest token taken, in bytes. It travels as ``Authorization: Bearer
# <token>``, one header field, and servers refuse a field past their limit
# (aiohttp's, the system port's server: 8190 bytes, name and value): a longer
# token would have every request refused, so it is refused at start instead.
MAX_TOKEN_BYTES = 4096


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
    visible ASCII only, at most ``MAX_TOKEN_BYTES``. Never quotes the token."""
    if not secret:
        return "is empty"
    size = len(secret.encode("utf-8"))
    if size > MAX_TOKEN_BYTES:
        return (
            f"is {size} bytes long, over the limit of {MAX_TOKEN_BYTES}: it travels in "
            "one HTTP header ('Authorization: Bearer <token>'), which servers refuse past "
            "their header size limit"
        )
    for index, char in enumerate(secret):
        if not "!" <= char <= "~":
            return (
                f"holds a character that is not visible ASCII at index {index}: a token "
                "travels in an HTTP header"
            )
    return None
