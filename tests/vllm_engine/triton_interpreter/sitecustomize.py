"""Test-only: lets vLLM's CPU build run Model Runner V2 with Triton's interpreter.

Put this folder on ``PYTHONPATH`` with ``DYNAMO_RL_TRITON_INTERPRETER=1`` (and
``VLLM_USE_V2_MODEL_RUNNER=1``): every Python process started so, vLLM's spawned
EngineCore included, runs it at start. Why: routed-expert capture in vLLM 0.32
exists only in Model Runner V2, which refuses to run without Triton, and the
``triton`` wheel has no CPU backend, so the CPU build disables Triton
(``vllm/triton_utils/importing.py``). Here Triton's kernels run in its own
interpreter (``TRITON_INTERPRET=1``, slow but exact), and a stand-in ``cpu``
entry in ``triton.backends.backends`` (never compiled for, never active) makes
vLLM's check see one. vLLM's code is untouched. A diagnostic for tests on CPU
machines only: serving needs a GPU (or a real Triton CPU backend).
"""

from __future__ import annotations

import os

if os.environ.get("DYNAMO_RL_TRITON_INTERPRETER") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

    from typing import Any, NoReturn

    import triton.backends as _backends
    from triton.backends.driver import DriverBase

    def _interpreter_only(*_: Any) -> NoReturn:
        raise RuntimeError("Triton runs in its interpreter here: no CPU driver to call")

    class _InterpreterDriver(DriverBase):
        """Stands for a CPU driver that is never used (kernels are interpreted)."""

        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("cpu")

        get_current_target = _interpreter_only
        map_python_to_cpp_type = _interpreter_only
        get_benchmarker = _interpreter_only

    if "cpu" not in _backends.backends:
        _backends.backends["cpu"] = _backends.Backend(
            compiler=_backends.BaseBackend, driver=_InterpreterDriver
        )
