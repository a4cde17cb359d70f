"""Free TCP ports on loopback, for programs that cannot report the port they bound."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free right now (another process may take it before you bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Workers' system ports, below 32768 (Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an
# i16) and apart from where bridges draw their internal one
# (``bridge.admin.system_server.INTERNAL_PORTS``), so that a bridge started first
# never draws the port a later worker of the same test is given.
SYSTEM_PORTS = range(10000, 20000)


def free_system_port() -> int:
    """A port for a worker's system server, free right now."""
    from bridge.admin.system_server import INTERNAL_PORTS, free_dynamo_port

    assert SYSTEM_PORTS.stop <= INTERNAL_PORTS.start
    return free_dynamo_port(SYSTEM_PORTS)
