"""What a process does around a vLLM engine it owns: before creating it, so
that the engine's processes and files end with it; and at the end, its shutdown.

- ``ENGINE_SERVER_PID`` (``vllm_plugin.OWNER_ENV``): its EngineCore ends itself
  when this process dies (see ``engine_server.vllm_plugin``).
- ``VLLM_RPC_BASE_PATH``: vLLM binds its ZMQ sockets (the EngineCore's input,
  output and handshake; a tensor-parallel group's broadcasts) as ``ipc://`` files
  named by a fresh uuid in the temporary folder, and removes none of them: three
  files in /tmp for each engine started, stopped cleanly or killed, which a host
  restarting engines for weeks piles up. They go in a private folder instead, one
  for this process's life, which its watcher removes however the process ends
  (``launch.private_dir``). A folder the user named is kept as given; one that
  an engine-owning parent made for itself (a Ray driver's, a test run's: its
  children inherit the variable) is not: killed, a child would leave its files
  there until that parent ends.

``shut_down``: ``AsyncLLM.shutdown`` blocks for seconds, so it runs off the event
loop, where vLLM's own server runs it on the loop. Its output handler, a task on
the loop, then sees the EngineCore gone before ``shutdown`` cancels it, and logs
"AsyncLLM output_handler failed" with a traceback and an ERROR at every clean
stop. With no request left waiting on it, the handler is cancelled first; with
requests left, it stays, to end them with the engine's error.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from engine_server.vllm_plugin import OWNER_ENV
from launch.private_dir import PrivateDir

RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
# The folder a process made for itself, named alike: a child that finds both
# variables equal inherited them.
OWN_IPC_ENV = "ENGINE_SERVER_IPC_DIR"
IPC_PREFIX = "vllm-ipc-"

# This process's folder for vLLM's sockets: made once, gone with the process.
_ipc_dir: PrivateDir | None = None


def before_engine_start() -> None:
    """Call right before creating the engine, in the process that will own it."""
    global _ipc_dir
    os.environ[OWNER_ENV] = str(os.getpid())
    if _ipc_dir is not None:
        return
    given = os.environ.get(RPC_BASE_ENV)
    if given is not None and given != os.environ.get(OWN_IPC_ENV):
        return  # the user's
    _ipc_dir = PrivateDir(IPC_PREFIX, longest_name=str(uuid.uuid4()))
    os.environ[RPC_BASE_ENV] = os.environ[OWN_IPC_ENV] = os.fspath(_ipc_dir.path)


async def shut_down(engine: Any) -> None:
    """Shut down a vLLM ``AsyncLLM`` this process owns, off the loop; call on its loop."""
    from engine_server.vllm_compat import unfinished_requests

    handler = getattr(engine, "output_handler", None)
    if isinstance(handler, asyncio.Task) and unfinished_requests(engine) == 0:
        handler.cancel()
    await asyncio.to_thread(engine.shutdown)
