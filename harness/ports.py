"""Free TCP ports on loopback, for programs that cannot report the port they bound."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

# Where listening ports are drawn from: above Linux's default ephemeral range
# (32768-60999), from which every outgoing connection's source port and every
# OS-assigned listener (Dynamo's request plane, say) is taken. A port drawn there
# could be taken by any of them before its program binds it: a frontend once
# failed to start so, its port the source port of a connection somewhere else.
LISTEN_PORTS = range(61000, 65536)


def _ephemeral_ports() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):
        return range(32768, 61000)
    return range(int(low), int(high) + 1)


def free_port() -> int:
    """A loopback port free right now, above the ephemeral range where the machine
    leaves room (else an OS-assigned one): only another draw can take it before
    you bind it."""
    from bridge.admin.system_server import free_dynamo_port

    ports = range(max(LISTEN_PORTS.start, _ephemeral_ports().stop), LISTEN_PORTS.stop)
    if ports:
        with contextlib.suppress(OSError):
            return free_dynamo_port(ports)
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
