"""Real etcd and NATS servers for Dynamo's cluster mode, on free loopback ports with
their data in a folder of the test's, restartable on the same ports and data.

    etcd = Etcd.start(group, root / "etcd")
    nats = Nats.start(group, root / "nats")
    stack = Stack.new(root, group, model_dir, "tiny", cluster=cluster_env(etcd, nats))

Binaries: Debian's ``etcd-server`` and ``nats-server`` (``make cluster-deps``
installs them), or any ``etcd``/``nats-server`` on PATH (``ETCD_BIN``/``NATS_BIN``
name others).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from harness.ports import free_port
from harness.procs import Proc, ProcessGroup
from harness.waits import wait_until


def etcd_binary() -> str | None:
    return os.environ.get("ETCD_BIN") or shutil.which("etcd")


def nats_binary() -> str | None:
    return os.environ.get("NATS_BIN") or shutil.which("nats-server")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class _Server(ABC):
    """A server process of the cluster's, its data under ``data_dir``, restartable
    on the same ports and data: subclasses say how it is started (``argv``) and when
    it is up (``healthy``)."""

    group: ProcessGroup
    data_dir: Path
    name: str = ""
    proc: Proc | None = None
    # How the wait for ``healthy`` is described.
    up_as: ClassVar[str] = "healthy"

    @classmethod
    def start(cls, group: ProcessGroup, data_dir: Path) -> Self:
        """On free ports, running."""
        server = cls(group, data_dir)
        server.run()
        return server

    @abstractmethod
    def argv(self) -> list[str]:
        """The command line that starts it."""

    @abstractmethod
    def healthy(self) -> bool:
        """Whether it answers as up."""

    def run(self, timeout: float = 30.0) -> None:
        self.proc = self.group.spawn(self.name, self.argv())
        wait_until(self.healthy, timeout, f"{self.name} {self.up_as}", [self.proc])

    def stop(self) -> None:
        if self.proc is not None:
            self.group.stop(self.proc)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.run()


@dataclass
class Etcd(_Server):
    """One etcd member; ``restart()`` keeps its ports and data (a real outage, not a new
    cluster: the leases granted before it survive on disk)."""

    name: str = "etcd"
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd not found (make cluster-deps installs Debian's etcd-server)")
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{self.name}={peer}",
            "--logger",
            "zap",
        ]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=2) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """etcd's v3 JSON gateway (no etcdctl needed)."""
        req = urllib.request.Request(
            f"{self.endpoint}/v3/{path}",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
        return answer

    def keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` now ([] while etcd does not answer)."""
        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        try:
            answer = self._call(
                "kv/range", {"key": _b64(start), "range_end": _b64(end), "keys_only": True}
            )
        except (OSError, ValueError):
            return []
        return [base64.b64decode(kv["key"]).decode() for kv in answer.get("kvs", [])]

    def granted_ttls(self) -> list[int]:
        """The granted TTL of every lease, seconds."""
        leases = self._call("lease/leases", {}).get("leases", [])
        return [
            int(self._call("lease/timetolive", {"ID": lease["ID"]})["grantedTTL"])
            for lease in leases
        ]


@dataclass
class Nats(_Server):
    """One NATS server with JetStream, its store under ``data_dir``."""

    name: str = "nats"
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    up_as = "accepting"

    def argv(self) -> list[str]:
        binary = nats_binary()
        if binary is None:
            raise RuntimeError("nats-server not found (make cluster-deps installs it)")
        return [binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.data_dir)]

    def healthy(self) -> bool:
        """The server's INFO greeting arrives on a fresh connection."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                return s.recv(4).startswith(b"INFO")
        except OSError:
            return False


def cluster_env(
    etcd: Etcd, nats: Nats | None = None, lease_ttl_s: int | None = None
) -> dict[str, str]:
    """Dynamo processes in cluster mode: etcd discovery (``ETCD_ENDPOINTS``, the
    workers' lease TTL ``ETCD_LEASE_TTL``), and with ``nats`` the NATS request and
    event planes (``NATS_SERVER``)."""
    env = {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd.endpoint}
    if lease_ttl_s is not None:
        env["ETCD_LEASE_TTL"] = str(lease_ttl_s)
    if nats is not None:
        env |= {"NATS_SERVER": nats.url, "DYN_REQUEST_PLANE": "nats", "DYN_EVENT_PLANE": "nats"}
    return env
