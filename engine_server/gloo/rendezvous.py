"""A gloo group opened with the trainer, bounded whatever the peer does.

``open_group``'s ``timeout_s`` bounds the rendezvous, whatever the peer does: a
master nobody listens at fails within ``timeout_s`` (``PeerUnreachable``), one
that accepts the connection and never answers within ``timeout_s`` and a grace
(``PeerSilent``: torch alone would wait for good, and every later call to the
worker behind it), a group that does not form within about twice ``timeout_s``.
Apart from the engines because it is plain sockets and threads, and the one
place that knows how torch's store client blocks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from engine_server.gloo.protocol import PeerSilent, PeerUnreachable, RendezvousStuck, first_line
from engine_server.vllm_compat import stateless_gloo_group

DEFAULT_TIMEOUT_S = 30.0

Group = Any  # torch.distributed.ProcessGroup (torch is not type-checked here)


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Group:
    """A gloo group outside torch.distributed's default one (the engine's worker has
    its own). Rank 0 hosts the TCP store. Each of the rendezvous's two steps
    (joining the store, forming the group) gets ``timeout_s`` plus
    ``RENDEZVOUS_GRACE_S``, so a rank fails within about twice ``timeout_s``
    whatever its peer does: never answers (``PeerSilent``), refuses or cannot be
    reached (``PeerUnreachable``). Refused at once (``RendezvousStuck``) while an
    earlier rendezvous of this process could not be cut."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    _refuse_if_stuck()
    return _Rendezvous(host, port, rank, world_size, timeout_s).open()


# How long past ``timeout_s`` a rendezvous step may run before it is cut (torch's
# own timeout, where it has one, comes first), and how long a cut step then gets
# to end.
RENDEZVOUS_GRACE_S = 1.0
CUT_WAIT_S = 2.0

_stuck_lock = threading.Lock()
_stuck: list[_Rendezvous] = []


def _refuse_if_stuck() -> None:
    with _stuck_lock:
        _stuck[:] = [r for r in _stuck if r.thread.is_alive()]
        if not _stuck:
            return
        first = _stuck[0]
    raise RendezvousStuck(
        f"the rendezvous with {first.address}, given up on after "
        f"{time.monotonic() - first.started:.0f} s, has not ended (its connection could "
        "not be shut): no new group opens until that peer closes the connection"
    )


class _Rendezvous:
    """One ``stateless_gloo_group`` on a daemon thread of its own, watched. torch
    bounds neither of its steps against a peer that accepts the connection and
    never answers (its store client waits for the handshake's reply for good, and
    a later call into the same process would queue behind it), so a step past its
    time has this process's new connections to the master shut, which ends it."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float):
        self.host, self.port, self.rank = host, port, rank
        self.world_size, self.timeout_s = world_size, timeout_s
        self.address = f"{host}:{port}"
        self.started = time.monotonic()
        self._changed = threading.Condition()
        self._joined = self._done = self._abandoned = False
        self._group: Group | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"gloo-rendezvous-{self.address}", daemon=True
        )

    def _joined_store(self) -> None:
        with self._changed:
            self._joined = True
            self._changed.notify_all()

    def _run(self) -> None:
        group: Group | None = None
        error: BaseException | None = None
        try:
            group = stateless_gloo_group(
                self.host,
                self.port,
                self.rank,
                self.world_size,
                timedelta(seconds=self.timeout_s),
                self._joined_store,
            )
        except BaseException as e:  # handed to the caller
            error = e
        with self._changed:
            if self._abandoned and group is not None:  # formed after all, too late
                with contextlib.suppress(Exception):
                    group.shutdown()
                group = None
            self._group, self._error, self._done = group, error, True
            self._changed.notify_all()

    def _wait(self, ready: Callable[[], bool], limit: float) -> bool:
        with self._changed:
            return self._changed.wait_for(ready, limit)

    def open(self) -> Group:
        if self.rank != 0:  # rank 0 hosts the store
            self._await_listener()
        peers = _addresses(self.host, self.port)
        before = _connections(peers, self.port)
        self.thread.start()
        limit = self.timeout_s + RENDEZVOUS_GRACE_S
        joined = self._wait(lambda: self._joined or self._done, limit)
        if not joined and not _connections(peers, self.port).keys() - before.keys():
            # Not connected at all (torch retries a connection refused once more):
            # torch's own time, cut only past it.
            joined = self._wait(lambda: self._joined or self._done, self.timeout_s)
        if not (joined and self._wait(lambda: self._done, limit)):
            self._cut(peers, before)
        with self._changed:
            group, error = self._group, self._error
        if error is not None:
            raise self._failure(error) from error
        assert group is not None
        return group

    def _await_listener(self) -> None:
        """Wait, up to ``timeout_s`` and the grace, until something accepts a
        connection at the master (the trainer may open its rank 0 after asking the
        workers to join): a master that never listens is told apart then, where
        torch's store client, retrying, takes up to about twice ``timeout_s`` (the
        probe's connection, closed unused, is nothing to the store). The grace
        leaves a caller whose deadline is ``timeout_s`` (the engine server's, the
        bridge's) to give up first, as it did."""
        deadline = time.monotonic() + self.timeout_s + RENDEZVOUS_GRACE_S
        while True:
            left = deadline - time.monotonic()
            try:
                with socket.create_connection((self.host, self.port), max(0.05, min(left, 1))):
                    return
            except ConnectionRefusedError:
                why = "connection refused: nothing listens there"
            except OSError as e:
                why = e.strerror or str(e) or type(e).__name__
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerUnreachable(
                    f"nothing at {self.address} accepted a connection within timeout_s "
                    f"{self.timeout_s:g} s (+{RENDEZVOUS_GRACE_S:g} s) ({why}): is the "
                    "trainer's rank 0 listening there (its master_address and master_port)?"
                )
            time.sleep(min(0.1, left))

    def _cut(self, peers: frozenset[str], before: dict[int, int]) -> None:
        """Past a step's time: returns if the rendezvous ended meanwhile, else raises."""
        with self._changed:
            if self._done:
                return
            self._abandoned = True
            joined = self._joined
        shut = _shut_new_connections(peers, self.port, before)
        self.thread.join(CUT_WAIT_S)
        with self._changed:
            error = self._error if self._done else None
        if error is not None and not shut:  # it ended by itself, just late: its own error
            raise self._failure(error) from error
        within = f"within timeout_s {self.timeout_s:g} s (+{RENDEZVOUS_GRACE_S:g} s)"
        if joined:
            what = (
                f"the gloo group with the trainer's rank 0 at {self.address} did not form "
                f"{within} of joining its TCP store: a rank stopped answering"
            )
        elif self.rank == 0:
            what = f"not every rank joined the TCP store at {self.address} {within}"
        else:
            what = (
                f"{self.address} accepted the connection but did not answer the TCP "
                f"store's handshake {within}: is it the trainer's rank 0 (its "
                "master_address and master_port)?"
            )
        if self.thread.is_alive():
            with _stuck_lock:
                _stuck.append(self)
            what += (
                "; its thread could not be unblocked (it waits until that peer closes the "
                "connection, or torch gives up): new inits are refused until then"
            )
        raise PeerSilent(what)

    def _failure(self, error: BaseException) -> BaseException:
        """torch's error, as what it means for the trainer's group."""
        torch_says = first_line(error)
        timed_out = "timed out" in torch_says.lower() or "timeout" in torch_says.lower()
        if self.rank == 0:  # the trainer's own side: torch's words are clear enough
            return error
        within = f"within timeout_s {self.timeout_s:g} s"
        with self._changed:
            joined = self._joined
        if not joined:
            return PeerUnreachable(
                f"could not join the trainer's TCP store at {self.address} {within} "
                f"({_probe(self.host, self.port)}); torch: {torch_says}"
            )
        if timed_out:
            return PeerSilent(
                f"the gloo group with the trainer's rank 0 at {self.address} did not form "
                f"{within} of joining its TCP store; torch: {torch_says}"
            )
        return PeerUnreachable(
            f"the trainer's group at {self.address} went away while it formed; torch: {torch_says}"
        )


def _probe(host: str, port: int) -> str:
    """Why a connection to ``host:port`` fails now, in words."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return "it accepts connections now, but did not complete the store's handshake"
    except ConnectionRefusedError:
        return "connection refused: nothing listens there"
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def _plain(ip: str) -> str:
    return ip.removeprefix("::ffff:")  # IPv4 as an IPv6 socket names it


def _addresses(host: str, port: int) -> frozenset[str]:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    return frozenset(_plain(str(info[4][0])) for info in found)


def _connections(peers: frozenset[str], port: int) -> dict[int, int]:
    """This process's TCP connections to ``peers`` at ``port``: file descriptor to
    socket inode (Linux's /proc; none found elsewhere, and nothing is cut there)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            fd = int(name)
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:["):
                continue
            with _duplicate(fd) as sock:
                peer = sock.getpeername()
        except (ValueError, OSError):
            continue
        if isinstance(peer, tuple) and peer[1] == port and _plain(str(peer[0])) in peers:
            found[fd] = int(link[len("socket:[") : -1])
    return found


def _duplicate(fd: int) -> socket.socket:
    """A socket object on a duplicate of ``fd`` (closing it leaves ``fd`` open)."""
    copy = os.dup(fd)
    try:
        return socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        raise


def _shut_new_connections(peers: frozenset[str], port: int, before: dict[int, int]) -> int:
    """Shut (both ways) this process's connections to the master made since
    ``before``: a thread blocked reading one wakes with an error. How many."""
    shut = 0
    for fd, inode in _connections(peers, port).items():
        if before.get(fd) == inode:
            continue
        try:
            with _duplicate(fd) as sock:
                if os.fstat(sock.fileno()).st_ino == inode:  # not a reused descriptor
                    sock.shutdown(socket.SHUT_RDWR)
                    shut += 1
        except OSError:
            continue
    return shut
