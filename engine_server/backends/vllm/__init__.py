"""The vLLM backend: serves a vLLM V1 ``AsyncLLM`` (CUDA or CPU build).

Importing this package sets the CPU build's environment defaults (see
``_env.py``) before it imports vLLM; nothing else in ``engine_server`` imports
vLLM or torch, so the registry imports this package only when ``--backend
vllm`` is chosen.

Modules: ``args`` (CLI, engine-argument defaults), ``sampling`` (SamplingSpec ->
SamplingParams), ``outputs`` (RequestOutput -> EngineOutput), ``kv_events``
(ZMQ relay), ``info`` (EngineInfo from vLLM's config), ``refit`` (VllmRefit: the
refit half), ``weights``, ``transfer_packing``, ``backend`` (VllmBackend).
"""

from engine_server.backends.vllm._env import apply_env_defaults

apply_env_defaults()

from engine_server.backends.vllm.backend import VllmBackend  # noqa: E402

__all__ = ["VllmBackend"]
