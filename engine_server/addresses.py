"""Listen addresses: parsing, and the loopback-only default."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class ListenAddress:
    """A parsed listen address: TCP host and port, or a unix socket path."""

    host: str | None
    port: int | None
    unix_path: str | None

    @property
    def is_unix(self) -> bool:
        return self.unix_path is not None

    def grpc_target(self, port: int | None = None) -> str:
        """The string grpc binds or dials (``port`` replaces a bound port 0)."""
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{host}:{self.port if port is None else port}"

    def is_loopback(self) -> bool:
        if self.unix_path is not None:
            return True
        assert self.host is not None
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name other than localhost may resolve anywhere


def parse_listen_address(text: str) -> ListenAddress:
    """Parse ``HOST:PORT``, ``[V6]:PORT`` or ``unix:PATH``; raise ValueError naming the problem."""
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError(f"listen address {text!r}: empty unix socket path")
        return ListenAddress(host=None, port=None, unix_path=path)
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"listen address {text!r}: expected [IPV6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"listen address {text!r}: expected HOST:PORT or unix:PATH")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"listen address {text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"listen address {text!r}: port {port} out of range 0..65535")
    return ListenAddress(host=host, port=port, unix_path=None)
