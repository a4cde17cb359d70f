"""Free TCP ports on loopback, for programs that cannot report the port they bound.

Every draw goes through ``bridge.admin.port_claims``, which the bridges' own draws
of their internal port use too: no two test processes (xdist workers, the low
end's run beside the main one) or two workers of one test are handed one port
before it is bound (seen: two bridges of one run given one system port, the second
refused its bind).
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from bridge.admin import port_claims

# Where listening ports are drawn from: above Linux's default ephemeral range
# (32768-60999), from which every outgoing connection's source port and every
# OS-assigned listener (Dynamo's request plane, say) is taken. A port drawn there
# could be taken by any of them before its program binds it: a frontend once
# failed to start so, its port the source port of a connection somewhere else.
LISTEN_PORTS = range(61000, 65536)

# Workers' system ports, below 32768 (Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an
# i16) and apart from where bridges draw their internal one
# (``bridge.admin.system_server.INTERNAL_PORTS``).
SYSTEM_PORTS = range(10000, 20000)


def _ephemeral_ports() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):
        return range(32768, 61000)
    return range(int(low), int(high) + 1)


def free_port() -> int:
    """A loopback port free right now, above the ephemeral range where the machine
    leaves room (else an OS-assigned one): no other draw hands it out before you
    bind it."""
    ports = range(max(LISTEN_PORTS.start, _ephemeral_ports().stop), LISTEN_PORTS.stop)
    if ports:
        with contextlib.suppress(OSError):
            return port_claims.draw(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_system_port() -> int:
    """A port for a worker's system server, free right now."""
    from bridge.admin.system_server import INTERNAL_PORTS

    assert SYSTEM_PORTS.stop <= INTERNAL_PORTS.start
    return port_claims.draw(SYSTEM_PORTS)
