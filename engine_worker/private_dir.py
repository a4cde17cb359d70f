"""The engine server's socket folder: private (0700), short enough for a unix
socket's path, and never left behind.

The launcher removes the folder when it ends. A launcher killed outright
(SIGKILL) runs no code of its own, and its children, which the kernel's
parent-death signal ends, know nothing of the folder; so a watcher process does
it: it waits for end-of-file on a pipe whose only write end the launcher holds,
which the kernel closes however the launcher ends, and then removes the folder.
The watcher is in a session of its own, so a ``killpg`` of the launcher's group
(NeMo RL's SIGTERM, then SIGKILL) does not reach it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("engine_worker")

SOCKET_NAME = "engine.sock"
# The longest unix socket path in bytes (sun_path is 108 bytes, with its NUL).
SUN_PATH_MAX = 107
# The watcher: a bare interpreter (-I), blocked on the pipe until the launcher is gone.
_WATCHER = (
    "import os, shutil, sys\n"
    "while os.read(0, 4096):\n"
    "    pass\n"
    "shutil.rmtree(sys.argv[1], ignore_errors=True)\n"
)


def _make_folder() -> Path:
    """A fresh 0700 folder in the temporary folder, or in /tmp where the socket's
    path would not fit there (counted in bytes: a non-ASCII TMPDIR takes more
    bytes than characters)."""
    folder = Path(tempfile.mkdtemp(prefix="engine-worker-"))
    if len(os.fsencode(folder / SOCKET_NAME)) > SUN_PATH_MAX:
        folder.rmdir()
        folder = Path(tempfile.mkdtemp(prefix="engine-worker-", dir="/tmp"))
    return folder


class PrivateDir:
    """The folder and its watcher; ``remove()`` when done."""

    def __init__(self) -> None:
        self.path = _make_folder()
        self._watcher: subprocess.Popen[bytes] | None = None
        try:
            self._watcher = subprocess.Popen(
                [sys.executable, "-I", "-c", _WATCHER, os.fspath(self.path)],
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

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        assert watcher.stdin is not None
        watcher.stdin.close()  # end-of-file: it finds the folder gone and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(5)
