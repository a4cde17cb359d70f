"""Free TCP ports on loopback, for programs that cannot report the port they bound."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free right now (another process may take it before you bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_system_port() -> int:
    """A free port below 32768: Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an i16
    (the bridge picks its internal system port the same way)."""
    from bridge.admin.system_server import free_dynamo_port

    return free_dynamo_port()
