"""The one seam between the engine server and the vLLM versions it runs on (0.23 to 0.32).

NeMo RL pins vLLM 0.23; the project's own environment has 0.32. Every API that
differs between them is met here, decided by what the installed vLLM has (a
class, a method, a module), never by its version number, so a vLLM in between
gets whichever form it actually has. The rest of the engine server (the
backend, ``weight_transfer_gloo``, ``vllm_plugin``) calls these names only.

Beside ``vllm_plugin`` and ``weight_transfer_gloo``, not under
``backends/vllm``: those run in vLLM's processes and in trainers, where the
backend package (and what it imports) has no business; this module imports
vLLM and the standard library only.

What 0.23 lacks, and what the engine server answers there:

- weight versions (``AsyncLLM.update_weight_version``, ``get_weight_version``,
  ``CompletionOutput.weight_versions``): the backend keeps the label itself and
  the core stamps each rollout with the label serving it;
- ``AsyncLLM.shutdown_weight_transfer_engine``: "not supported" (the worker's
  next ``init`` replaces the group anyway);
- the trainer-side engines (``WeightTransferTrainerFactory``,
  ``TrainerWeightTransferEngine``, ``WeightSource``): a 0.23 trainer uses the
  worker engine's static ``trainer_init`` / ``trainer_send_weights`` instead.

0.23's worker runs a weight-transfer update itself and ends it with
``torch.accelerator.synchronize()``; on the CPU build its model runner has made
that a no-op in the engine's process, so updates over ``gloo`` complete there
(measured: a refit to another checkpoint serves that checkpoint's tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import vllm.exceptions
from vllm.distributed.weight_transfer import base as _transfer_base
from vllm.distributed.weight_transfer import factory as _transfer_factory

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

# -- requests ---------------------------------------------------------------------

# vLLM errors that mean "this request's parameters", not "the engine": 0.32 has a
# client-error root; 0.23's validation error is a ValueError and its not-found
# error stands alone.
_client_error = getattr(vllm.exceptions, "VLLMClientError", None)
REQUEST_ERRORS: tuple[type[BaseException], ...] = (
    (_client_error, ValueError)
    if _client_error is not None
    else (ValueError, vllm.exceptions.VLLMNotFoundError)
)


def unfinished_requests(engine: AsyncLLM) -> int:
    """Requests the front end holds (0.23 has no ``get_num_unfinished_requests``
    on ``AsyncLLM``: its output processor counts them)."""
    count = getattr(engine, "get_num_unfinished_requests", None)
    if count is not None:
        return int(count())
    return int(engine.output_processor.get_num_unfinished_requests())


def kv_event_sources(engine: AsyncLLM) -> dict[int, Any]:
    """Resolved KV-event publisher configs by DP rank; empty where vLLM does not
    report them (0.23): the caller falls back to ``kv_events_config``."""
    sources = getattr(engine, "get_kv_event_sources", None)
    return dict(sources()) if sources is not None else {}


def returns_routed_experts(vllm_config: Any) -> bool:
    """The routed-experts switch: in ``aux_output_config`` (0.32), else on the
    model config (0.23)."""
    aux = getattr(vllm_config, "aux_output_config", None)
    holder = aux if aux is not None else vllm_config.model_config
    return bool(getattr(holder, "enable_return_routed_experts", False))


def output_weight_versions(completion: Any) -> list[tuple[str, int, int]] | None:
    """vLLM's own weight-version spans over a finished output (None: it keeps none)."""
    spans = getattr(completion, "weight_versions", None)
    if spans is None:
        return None
    return [(str(s.version), int(s.start), int(s.end)) for s in spans]


def woke_fully(answer: Any) -> bool:
    """``wake_up``'s answer: 0.32 says whether every tag is awake, 0.23 says
    nothing (returns once the tags asked for are)."""
    return True if answer is None else bool(answer)


# -- weight versions and the weight-transfer engine's lifecycle -----------------------


def has_weight_versions(engine: AsyncLLM) -> bool:
    """Whether vLLM keeps the weights' label itself (0.32; not 0.23)."""
    return hasattr(engine, "update_weight_version") and hasattr(engine, "get_weight_version")


def has_transfer_shutdown(engine: AsyncLLM) -> bool:
    """Whether vLLM can release the trainer's group without stopping (0.32; not 0.23)."""
    return hasattr(engine, "shutdown_weight_transfer_engine")


# 0.32's worker engines run the update themselves (``start_weight_update``,
# ``update_weights``, ``finish_weight_update`` on the engine); 0.23's worker runs
# it and hands the engine a loader (``receive_weights(info, load_weights)``).
ENGINE_RUNS_UPDATE = hasattr(_transfer_base.WeightTransferEngine, "update_weights")


# -- trainer-side engines ----------------------------------------------------------------

HAS_TRAINER_ENGINES = hasattr(_transfer_factory, "WeightTransferTrainerFactory")


def weight_transfer_factories() -> list[Any]:
    """vLLM's registries of weight-transfer engines: the workers' and, where it
    has one (0.32), the trainers'."""
    found = [_transfer_factory.WeightTransferEngineFactory]
    if HAS_TRAINER_ENGINES:
        found.append(_transfer_factory.WeightTransferTrainerFactory)
    return found


def mtp_check_disabled() -> contextlib.AbstractContextManager[Any]:
    """vLLM's ``disable_mtp_completeness_check`` (an update that names only some
    of a model's MTP weights is fine), where it has one (0.32; 0.23 checks nothing)."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        return contextlib.nullcontext()
    check: Callable[[], contextlib.AbstractContextManager[Any]] = disable_mtp_completeness_check
    return check()


def stateless_gloo_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: timedelta,
    connected: Callable[[], object] | None = None,
) -> Any:
    """A gloo group outside torch.distributed's default one, whose rendezvous and
    collectives time out after ``timeout``: the steps of vLLM's
    ``stateless_init_torch_distributed_process_group``, run here on every vLLM
    (0.32's takes the timeout, 0.23's reads it from the current vLLM config: none
    in a trainer, or on the worker's RPC thread). ``connected`` is called once the
    TCP store is joined (rank 0: every rank connected to it), before the gloo
    group forms: ``weight_transfer_gloo`` bounds the two steps apart."""
    from torch.distributed import PrefixStore, rendezvous
    from vllm.distributed import utils

    init_method = utils.get_tcp_uri(host, port)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    if connected is not None:
        connected()
    return utils.init_gloo_process_group(PrefixStore(init_method, store), rank, world_size, timeout)
