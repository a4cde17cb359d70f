"""Environments for child processes (Dynamo on one machine, imports made to fail,
the worker's /health), and what this process can import."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from harness import ROOT

# Holds the sitecustomize.py that fails the imports named in BLOCKED_IMPORTS.
BLOCKERS_DIR = Path(__file__).resolve().parent / "blockers"

# Dynamo on one machine in a worker's flags: the planes dynamo_env sets (file
# discovery, TCP requests, ZMQ events).
ONE_MACHINE_FLAGS = (
    "--discovery-backend",
    "file",
    "--request-plane",
    "tcp",
    "--event-plane",
    "zmq",
)


def dynamo_env(kv_dir: Path, **extra: str) -> dict[str, str]:
    """Dynamo processes on one machine: file discovery in ``kv_dir``, TCP requests,
    ZMQ events, loopback only, offline, no grace period at shutdown (``extra`` wins)."""
    return {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(kv_dir),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        # An interface name: ai-dynamo 1.3.0.post1 takes only that here (an address
        # fails every model: "Interface not found"), 1.6.1 an address or a name.
        "DYN_TCP_RESPONSE_STREAM_HOST": "lo",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "NO_COLOR": "1",
        **extra,
    }


def dynamo_version() -> tuple[int, ...]:
    """The installed ai-dynamo's release numbers (``1.3.0.post1`` -> ``(1, 3, 0)``)."""
    release = importlib.metadata.version("ai-dynamo").split(".post")[0]
    return tuple(int(part) for part in release.split(".")[:3])


def frontend_maps_worker_errors() -> bool:
    """Whether the installed Dynamo frontend answers a worker's failure with its own
    status (1.6: 503 for an engine that could not finish, 400 for a refused request).
    1.3.0.post1's answers a non-streamed request that failed at the worker with HTTP
    500 "Failed to fold completions stream", whatever the worker raised: still
    retryable, never a result that looks whole. Tests say which they expect."""
    return dynamo_version() >= (1, 6)


def token_in_token_out_env() -> dict[str, str]:
    """A frontend serving vLLM's ``POST /inference/v1/generate`` (off by default in
    Dynamo 1.6.1, absent from 1.3.0.post1, which ignores the variable)."""
    return {"DYN_VLLM_ENABLE_INFERENCE_V1_GENERATE": "1"}


def blocking_env(*packages: str) -> dict[str, str]:
    """A Python that fails to import ``packages`` (and their submodules): the
    dependency rule, enforced at runtime."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(BLOCKERS_DIR), str(ROOT), path) if p),
        "BLOCKED_IMPORTS": ",".join(packages),
    }


def health_env(system_port: int, canary_wait_s: int = 1) -> dict[str, str]:
    """A worker serving Dynamo's ``/health`` on ``system_port``, with the runtime's
    canary probing the bridge's endpoint after ``canary_wait_s`` idle."""
    return {
        "DYN_SYSTEM_PORT": str(system_port),
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "DYN_CANARY_WAIT_TIME": str(canary_wait_s),
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1",
    }


def importable(package: str) -> bool:
    """Whether ``package`` can be imported here (False also where ``blocking_env``
    blocks it: the blocker raises ImportError from ``find_spec``)."""
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:
        return False
