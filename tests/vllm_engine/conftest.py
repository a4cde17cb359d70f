"""The vLLM-level tests: the backend against vLLM's own types and a real engine.

Each test module starts one engine (15-25 s on two cores) in a module-scoped
fixture on a module-scoped event loop, and its tests share it. Each module
skips itself where vLLM is not installed (``pytest.importorskip``). This folder
is not called ``vllm``: as a namespace package on pytest's path, such a folder
answered ``find_spec("vllm")`` where vLLM was missing.
"""

from __future__ import annotations

from harness.env import importable

if importable("vllm"):
    from engine_server.backends.vllm._env import apply_env_defaults

    # Before any test module imports vLLM (and with it torch): the CPU build's
    # environment defaults, exactly as `--backend vllm` gets them.
    apply_env_defaults()
