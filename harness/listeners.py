"""The sockets a process tree listens on, read from ``/proc`` (Linux): which
addresses a program opened to the network, without ``ss`` or root."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

_TCP_LISTEN = "0A"
_UDP_UNCONNECTED = "07"


@dataclass(frozen=True)
class Listener:
    pid: int
    protocol: str  # tcp or udp
    host: str
    port: int

    @property
    def wildcard(self) -> bool:
        """Bound to every interface (0.0.0.0, ::), so reachable beyond this machine."""
        address = ipaddress.ip_address(self.host)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            return address.ipv4_mapped.is_unspecified
        return address.is_unspecified

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.protocol} {host}:{self.port} (pid {self.pid})"


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process descended from it, now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces; the fields after ")" do not.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [pid]
    while todo:
        current = todo.pop()
        tree.add(current)
        todo.extend(children.get(current, []))
    return tree


def _address(hex_address: str) -> tuple[str, int]:
    """``/proc/net/tcp``'s ``0100007F:1F90`` (each 32-bit word in host order) -> (host, port)."""
    hex_host, hex_port = hex_address.split(":")
    raw = bytes.fromhex(hex_host)
    host = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(host)), int(hex_port, 16)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return set()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listeners(pids: set[int]) -> list[Listener]:
    """Every TCP socket in LISTEN and every unconnected UDP socket the processes hold."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    if not owner:
        return []
    found: set[Listener] = set()
    netns = next(iter(pids))
    for table, protocol, state in (
        ("tcp", "tcp", _TCP_LISTEN),
        ("tcp6", "tcp", _TCP_LISTEN),
        ("udp", "udp", _UDP_UNCONNECTED),
        ("udp6", "udp", _UDP_UNCONNECTED),
    ):
        try:
            lines = Path(f"/proc/{netns}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != state or fields[9] not in owner:
                continue
            host, port = _address(fields[1])
            found.add(Listener(owner[fields[9]], protocol, host, port))
    return sorted(found, key=lambda s: (s.protocol, s.port))
