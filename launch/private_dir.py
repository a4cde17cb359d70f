"""The engine server's socket folder: private (0700), short enough for a unix
socket's path, and never left behind. Used wherever we start an engine server on a
unix socket of our choosing: the launcher (``engine_worker``), a host's own engine
(``engine_server.host``) and a Ray actor's (``engine_server.ray_worker``); and for
vLLM's own sockets, in a process that starts a vLLM engine
(``engine_server.vllm_processes``).

The refit RPCs carry no credentials of their own: the folder keeps every other
user off the socket. Its owner removes it when it ends. A process killed outright
(SIGKILL: a launcher, a host OOM-killed, ``ray.kill``) runs no code of its own,
and its children, which the kernel's parent-death signal ends, know nothing of
the folder; so a watcher process does it: it waits for end-of-file on a pipe
whose write end the owner holds, which the kernel closes however the owner ends
(or, where a child forked without exec holds it too, for the owner to stop being
its parent), and then removes the folder. The watcher is in a session of its own,
so a ``killpg`` of the owner's group (NeMo RL's SIGTERM, then SIGKILL) does not
reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "engine-server-"
SOCKET_NAME = "engine.sock"
# The longest unix socket path in bytes (sun_path is 108 bytes, with its NUL).
SUN_PATH_MAX = 107
# The watcher: a bare interpreter (-I) waiting for the pipe's end-of-file, or for its
# owner (its parent, named by pid: it may be gone before the watcher starts) to be
# gone: a child the owner forked without exec (a fork-started multiprocessing
# worker) inherits the pipe's write end and would hold it open.
_WATCHER = (
    "import os, select, shutil, sys\n"
    "owner = int(sys.argv[2])\n"
    "while os.getppid() == owner:\n"
    "    if select.select([0], [], [], 1.0)[0] and not os.read(0, 4096):\n"
    "        break\n"
    "shutil.rmtree(sys.argv[1], ignore_errors=True)\n"
)


def _make_folder(prefix: str, longest_name: str) -> Path:
    """A fresh 0700 folder in the temporary folder, or in /tmp where a socket named
    ``longest_name`` would not fit there (counted in bytes: a non-ASCII TMPDIR takes
    more bytes than characters)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    if len(os.fsencode(folder / longest_name)) > SUN_PATH_MAX:
        folder.rmdir()
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    return folder


class PrivateDir:
    """The folder and its watcher; ``remove()`` when done. ``prefix`` and
    ``longest_name``: its name's start, and the longest socket name it will hold."""

    def __init__(self, prefix: str = PREFIX, longest_name: str = SOCKET_NAME) -> None:
        self.path = _make_folder(prefix, longest_name)
        self._watcher: subprocess.Popen[bytes] | None = None
        try:
            self._watcher = subprocess.Popen(
                [sys.executable, "-I", "-c", _WATCHER, os.fspath(self.path), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            log.warning("no watcher for %s (%s): a killed worker leaves it behind", self.path, e)

    @property
    def socket(self) -> Path:
        return self.path / SOCKET_NAME

    @property
    def address(self) -> str:
        """The socket as the engine server's ``--listen`` takes it."""
        return f"unix:{self.socket}"

    async def remove_async(self) -> None:
        """``remove`` off the event loop (it waits for the watcher to exit)."""
        await asyncio.to_thread(self.remove)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        assert watcher.stdin is not None
        watcher.stdin.close()  # end-of-file: it finds the folder gone and exits
        try:
            watcher.wait(1)
        except subprocess.TimeoutExpired:  # still starting, or a forked child holds the pipe
            watcher.kill()  # the folder is gone: nothing left for it to do
            with contextlib.suppress(subprocess.TimeoutExpired):
                watcher.wait(5)
