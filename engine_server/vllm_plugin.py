"""vLLM general plugins (entry points ``vllm.general_plugins``), run in every vLLM process.

``end_with_engine_server``: vLLM's EngineCore process has no way to notice that
the process that started it died: an engine server killed with SIGKILL (an OOM
kill, a crashed host, a test) left its EngineCore running for nobody, holding
the model's memory (on a GPU, the memory the restarted server then lacks). An
engine server names itself in ``ENGINE_SERVER_PID`` before it starts vLLM; a
direct child that finds that variable watches its parent and ends itself
within half a second of its death (its own workers follow: vLLM's death pipe);
one whose engine server died before the plugin ran (killed while vLLM started)
ends at once.

``freeze_heap_at_exit``: a vLLM process started under an engine server (its
EngineCore, its workers) ends with a clean ``sys.exit``, and the interpreter's
finalization then scans the whole heap (torch, vLLM, transformers, the model's
objects) for cycles: on this project's CPU machines an EngineCore took about 3 s
to exit after its shutdown had finished, and an engine server's stop waited for
it (5-6 s from SIGTERM to exit, about 2 s without that scan). The plugin freezes the
heap as the last exit handler, as vLLM itself does on ROCm after a clean
shutdown: its own handlers have run, and what is left is freed by the process's
end. Objects are still freed by reference counting; only cycles the collector
would have broken at exit are left to the OS.

``request_amx_permission``:

vLLM's CPU kernels use Intel AMX tiles for bfloat16 (its CPU attention picks
the "amx" ISA whenever the CPU reports AMX), but never ask Linux for the
per-process permission AMX needs since 5.16 (``arch_prctl(ARCH_REQ_XCOMP_PERM)``):
unless something else in the process asked first (oneDNN does, for its own
kernels), the first bfloat16 forward pass dies with SIGILL. vLLM's default dtype
for a float32 checkpoint on CPU is bfloat16, so a bare
``python -m engine_server --backend vllm --model DIR`` crashed on its first
request on AMX machines. The plugin asks for the permission (through torch's
own helper) in each vLLM process, the EngineCore included, before any kernel
runs. It does nothing elsewhere (CUDA builds, CPUs without AMX).

``register_gloo_weight_transfer``: registers ``gloo``
(``engine_server.weight_transfer_gloo``), a weight-transfer backend over
torch.distributed gloo, in vLLM's worker and trainer factories, so that
``--weight-transfer-config '{"backend": "gloo"}'`` works in the engine's
workers and a trainer that calls ``vllm.plugins.load_general_plugins()`` can
send with it (vLLM 0.32; 0.23 has no trainers' factory, see
``engine_server.vllm_compat``). Lazily: the module is imported only when an engine is created.

Kept free of imports beyond the standard library until it runs: vLLM loads
plugins in every process it starts.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import platform
import signal
import threading
import time

log = logging.getLogger(__name__)

# Set by the engine server, to its process id, before it starts vLLM.
OWNER_ENV = "ENGINE_SERVER_PID"
_WATCH_INTERVAL_S = 0.5


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: it answered the signal


def _engine_server_pid() -> int | None:
    """The engine server this process was started under; None outside one, and in
    the engine server itself."""
    owner = os.environ.get(OWNER_ENV, "")
    if not owner.isdigit() or int(owner) == os.getpid():
        return None
    return int(owner)


def end_with_engine_server() -> None:
    owner = _engine_server_pid()
    if owner is None:
        return
    if os.getppid() != owner:
        if _alive(owner):
            return  # a grandchild, or a process the engine server did not start
        # Its engine server died while vLLM was starting this process (an actor
        # killed mid start-up): nobody would ever end it.
        log.error("engine server (pid %s) was gone before this vLLM process started", owner)
        os.kill(os.getpid(), signal.SIGKILL)

    def watch(owner: int) -> None:
        while os.getppid() == owner:
            time.sleep(_WATCH_INTERVAL_S)
        log.error("engine server (pid %d) is gone: ending this vLLM process", owner)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(
        target=watch, args=(owner,), name="end-with-engine-server", daemon=True
    ).start()


def freeze_heap_at_exit() -> None:
    if _engine_server_pid() is None:
        return
    # Registered now, it runs after every handler registered later (LIFO).
    atexit.register(gc.freeze)


def request_amx_permission() -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    import torch

    if torch.version.cuda is not None:  # a CUDA build: vLLM's CPU kernels are not used
        return
    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        log.warning("the CPU reports AMX, but Linux refused the permission to use it")


GLOO_BACKEND = "gloo"
_GLOO_MODULE = "engine_server.weight_transfer_gloo"


def register_gloo_weight_transfer() -> None:
    from engine_server.vllm_compat import weight_transfer_factories

    # The workers' factory, and the trainers' where vLLM has one (0.32, not 0.23).
    class_names = ("GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine")
    for factory, class_name in zip(weight_transfer_factories(), class_names, strict=False):
        try:
            factory.register_engine(GLOO_BACKEND, _GLOO_MODULE, class_name)
        except ValueError:  # already there: registered before in this process
            log.debug("%s already has a %r engine", factory.__name__, GLOO_BACKEND)
