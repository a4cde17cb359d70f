"""A vLLM general plugin (entry point ``vllm.general_plugins``), run in every vLLM process.

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

Kept free of imports beyond the standard library until it runs: vLLM loads
plugins in every process it starts.
"""

from __future__ import annotations

import logging
import platform

log = logging.getLogger(__name__)


def request_amx_permission() -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    import torch

    if torch.version.cuda is not None:  # a CUDA build: vLLM's CPU kernels are not used
        return
    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        log.warning("the CPU reports AMX, but Linux refused the permission to use it")
