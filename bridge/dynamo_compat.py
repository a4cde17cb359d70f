"""The bridge's one seam with Dynamo's Python API, for ai-dynamo 1.3.0.post1 and 1.6.1.

NeMo RL pins ai-dynamo 1.3.0.post1; the bridge is built against 1.6.1. Where the
two differ in what the bridge uses, this module asks the installed Dynamo what it
has (never its version number) and gives the rest of the bridge, and the harness
that starts Dynamo's programs, one call that works on either:

- ``normalize_request_token_ids``: 1.6.1's request plane may pack ``token_ids``
  as int32 bytes (``DYN_TOKEN_IDS_AS_BYTES``) and has a helper to unpack them;
  1.3.0.post1 has neither the packing nor the helper: its ids are always a list.
- ``run_worker``: 1.6.1's ``run`` takes an ``engine_factory``; 1.3.0.post1's
  only the engine class, so the worker is driven as its ``run`` would.
- ``rl_route_registry``: 1.6.1's ``RLRouteRegistry`` reports the weight world
  size in its ``routes`` answer; 1.3.0.post1's takes no ``world_size`` (nor
  does its dynamo.vllm report one).
- ``frontend_router_reset_flags``: NeMo RL always passes the frontend
  ``--router-reset-states`` or ``--no-router-reset-states``; 1.3.0.post1's
  frontend takes them, 1.6.1's refuses them and exits.
- ``publishes_cache_salt``: 1.6.1's ``KvEventPublisher.publish_stored`` takes
  a stored chain's ``cache_salt`` (its router keeps salted prefixes apart);
  1.3.0.post1's takes none, so the salt is left off there.
- ``token_in_token_out_runtime_data``: 1.6.1's frontend serves vLLM's
  ``POST /inference/v1/generate`` (with ``DYN_VLLM_ENABLE_INFERENCE_V1_GENERATE``)
  to workers whose card says ``runtime_data["vllm_inference_v1_generate"]``;
  1.3.0.post1 has no such route, so the card says nothing there.

Not here, because one value suits both: ``DYN_TCP_RESPONSE_STREAM_HOST`` is an
interface name in 1.3.0.post1 (an address fails every model with "Interface not
found") and an address or a name in 1.6.1, so one-machine stacks set ``lo``
(``harness.env.dynamo_env``).

Everything else the bridge imports from Dynamo (``LLMEngine``, ``EngineConfig``,
``LlmRegistration``, ``WorkerConfig``, ``Context``, the publisher, the health
check, ``dynamo.llm.exceptions``, the runtime arguments) has the same shape in
both for what the bridge uses, and is imported directly.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from dynamo.common.backend import run as _run
from dynamo.common.backend.engine import BaseEngine
from dynamo.common.backend.worker import Worker, WorkerConfig
from dynamo.common.rl.admin import RLRouteRegistry

_RequestT = TypeVar("_RequestT", bound=Mapping[str, Any])
EngineFactory = Callable[[list[str] | None], Awaitable[tuple[BaseEngine, WorkerConfig]]]


def _token_ids_normalizer() -> Callable[[Any], Any] | None:
    try:
        module = importlib.import_module("dynamo.common.utils.token_ids")
    except ImportError:  # 1.3.0.post1: token ids only ever arrive as a list
        return None
    normalizer: Callable[[Any], Any] = module.normalize_request_token_ids
    return normalizer


_normalize_token_ids = _token_ids_normalizer()


def normalize_request_token_ids(request: _RequestT) -> _RequestT:
    """The request with ``token_ids`` as a list, whatever the request plane carried."""
    if _normalize_token_ids is not None:
        _normalize_token_ids(request)
    return request


def _takes(fn: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(fn).parameters


def run_worker(
    engine_cls: type[BaseEngine], argv: list[str] | None, factory: EngineFactory
) -> None:
    """Serve the engine ``factory`` builds until Dynamo's worker ends (its signals,
    its shutdown). The factory, not ``engine_cls.from_args``, so the caller keeps
    hold of the engine it built (its exit code)."""
    if _takes(_run.run, "engine_factory"):
        _run.run(engine_cls, argv, engine_factory=factory)
        return
    import uvloop

    async def serve() -> None:
        engine, worker_config = await factory(argv)
        await Worker(engine, worker_config).run()

    uvloop.run(serve())


def rl_route_registry(runtime: Any, *, logger_: logging.Logger, world_size: int) -> RLRouteRegistry:
    """Dynamo's RL route registry; ``world_size`` reported where Dynamo reports one."""
    if _takes(RLRouteRegistry, "world_size"):
        return RLRouteRegistry(runtime, logger_=logger_, world_size=world_size)
    return RLRouteRegistry(runtime, logger_=logger_)


@functools.cache
def _frontend_flags() -> frozenset[str]:
    """The option strings of the installed ``python -m dynamo.frontend``."""
    from dynamo.frontend.frontend_args import FrontendArgGroup

    parser = argparse.ArgumentParser(add_help=False)
    FrontendArgGroup().add_arguments(parser)
    return frozenset(parser._option_string_actions)


def frontend_router_reset_flags(reset: bool) -> list[str]:
    """The frontend flag NeMo RL passes for ``router_reset_states``, or none where the
    installed frontend would refuse it (it has no such option)."""
    flag = "--router-reset-states" if reset else "--no-router-reset-states"
    return [flag] if flag in _frontend_flags() else []


# The model card entry (``runtime_data``) that puts a worker behind the frontend's
# ``/inference/v1/generate``: Rust's ``VLLM_INFERENCE_V1_GENERATE_CAPABILITY``,
# dynamo.vllm's ``engine_generate.VLLM_GENERATE_CAPABILITY``.
TOKEN_IN_TOKEN_OUT_CAPABILITY = "vllm_inference_v1_generate"


@functools.cache
def publishes_cache_salt() -> bool:
    """Whether the installed Dynamo's KV publisher takes a stored event's cache salt."""
    from dynamo._core import KvEventPublisher

    return _takes(KvEventPublisher.publish_stored, "cache_salt")


@functools.cache
def serves_token_in_token_out() -> bool:
    """Whether the installed Dynamo serves ``/inference/v1/generate``: its worker
    half (``dynamo.vllm.engine_generate``, which dynamo.vllm publishes the
    capability from) ships with the frontend route. Looked up, not imported: that
    module's helpers import vLLM."""
    try:
        return importlib.util.find_spec("dynamo.vllm.engine_generate") is not None
    except ImportError:
        return False


def token_in_token_out_runtime_data() -> dict[str, Any]:
    """The card's ``runtime_data`` entry that routes ``/inference/v1/generate`` to
    this worker, where the installed Dynamo has the route (else none)."""
    return {TOKEN_IN_TOKEN_OUT_CAPABILITY: True} if serves_token_in_token_out() else {}
