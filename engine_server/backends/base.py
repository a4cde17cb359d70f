"""The seam between the engine-server core and an inference engine.

The core owns the contract (validation, request registry, rollout semantics,
KV-event sequencing); a backend only runs requests on its engine, in engine-
neutral terms. Backends import their engine; this module imports neither an
engine nor gRPC, so the core and its tests run with no engine installed.
"""

from __future__ import annotations

import argparse
import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from engine_server.backends.refit import (
    PauseMode,
    RefitUnsupported,
    RlCapabilities,
    TensorSpec,
    WeightLoad,
    WeightWriter,
)

if TYPE_CHECKING:
    from engine_server.generation_config import GenerationConfig


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORTED = "aborted"
    ERROR = "error"


@dataclass(frozen=True)
class EngineInfo:
    """What the engine tells about itself once started."""

    model_name: str
    model_path: str
    context_length: int
    kv_block_size: int
    total_kv_blocks: int
    max_running_sequences: int
    max_batched_tokens: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    backend_name: str
    backend_version: str
    data_parallel_size: int = 1
    # The first rank's number in the deployment (Dynamo's data_parallel_start_rank).
    data_parallel_start_rank: int = 0
    # Whether finished outputs carry routed experts (MoE with the feature on).
    reports_routed_experts: bool = False


@dataclass(frozen=True)
class SamplingSpec:
    """A fully resolved request: every default already applied by the core.

    Backends map it one to one onto their engine's parameters and never add
    defaults of their own, so that what the core decided is what runs.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Words the engine must never generate (vLLM's bad_words); engines that
    # cannot honour them refuse the request.
    bad_words: tuple[str, ...] = ()
    # None: no logprobs; 0: the sampled token's; k: also the top k.
    logprobs: int | None = None
    return_routed_experts: bool = False
    # The data-parallel rank to run on (0-based, local); None: the engine picks.
    data_parallel_rank: int | None = None
    # The prefix cache's namespace (vLLM's cache_salt): blocks are shared only
    # with requests of the same salt. Never changes what is generated.
    cache_salt: str | None = None


@dataclass(frozen=True)
class RoutedExpertsArray:
    """Router choices as raw little-endian bytes, never as Python ints."""

    data: bytes
    dtype: str  # numpy name: "uint8", "int8", "uint16", "int16", "int32", "int64"
    shape: tuple[int, ...]  # [positions, moe_layers, top_k]


@dataclass
class EngineOutput:
    """What a request produced since the previous output (a delta).

    The last output of a request has ``finished`` set, a finish reason, and the
    usage counts; routed experts come only on that one.
    """

    token_ids: list[int]
    # Sampled token's logprob per token, when SamplingSpec.logprobs is not None.
    logprobs: list[float] | None = None
    # Per token, the top k (token id, logprob) pairs, when logprobs > 0.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    # The stop token id or stop string that ended the request (STOP only).
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    routed_experts: RoutedExpertsArray | None = None
    error: str | None = None
    # On the last output, when the engine tracks it: which weights generated
    # which output tokens, as (version, start, end) spans over all of them.
    weight_versions: list[tuple[str, int, int]] | None = None


@dataclass(frozen=True)
class BlockStored:
    """Full blocks newly cached; each the child of the previous one."""

    block_hashes: tuple[int, ...]  # unsigned 64-bit
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # block_size tokens per block, concatenated
    block_size: int
    lora_name: str = ""
    # The cache salt of the chain these blocks extend ("" none; contract revision 11).
    cache_salt: str = ""


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KvEventBatch:
    events: tuple[KvEvent, ...]
    timestamp_unix_nanos: int = 0
    data_parallel_rank: int = 0


# Called by the backend, on the server's event loop thread, once per engine
# batch, in engine order. Backends that read events on another thread hand
# them over with loop.call_soon_threadsafe.
KvEventSink = Callable[[KvEventBatch], None]


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


class EngineDeadError(RuntimeError):
    """The engine can serve nothing more; the server reports UNAVAILABLE."""


class EngineRequestError(ValueError):
    """The engine refused this request (bad parameters); INVALID_ARGUMENT."""


class EngineBackend(ABC):
    """An inference engine as the engine server sees it.

    Lifecycle: ``start()`` once (may take long: the server is already up and
    NOT_SERVING meanwhile), then any number of concurrent ``generate`` calls,
    then ``shutdown()``. All methods run on the server's event loop.
    """

    # Whether SamplingSpec.bad_words is honoured (else such requests are refused).
    supports_bad_words: ClassVar[bool] = False

    # -- command line (python -m engine_server --backend NAME) ---------------

    @classmethod  # noqa: B027 (an optional hook: a backend may have no flags)
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add this backend's own flags to the server's parser (none by default)."""

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineBackend:
        """Build the backend from parsed flags."""
        raise ValueError(f"{cls.__name__} has no command-line form; construct it in code")

    @classmethod
    def apply_generation_config(
        cls, config: GenerationConfig, args: argparse.Namespace
    ) -> list[str]:
        """Map a NeMo RL generation section's engine settings onto this backend's
        parsed flags, where the user gave none; return "key: why" for each
        setting it does not use (logged with the section's ignored keys)."""
        return [f"vllm_cfg.{k}: not used by {cls.__name__}" for k in config.engine] + [
            f"vllm_kwargs.{k}: not used by {cls.__name__}" for k in config.engine_kwargs
        ]

    @abstractmethod
    async def start(self, kv_event_sink: KvEventSink | None) -> EngineInfo:
        """Make the engine ready; from now on emit KV events into the sink."""

    @abstractmethod
    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], spec: SamplingSpec
    ) -> AsyncGenerator[EngineOutput, None]:
        """Run one request, yielding deltas; the last one has ``finished`` set.

        Closing the iterator early (the consumer was cancelled) must abort the
        engine request. An ``abort(request_id)`` must make the iterator yield a
        last output with finish reason ABORTED (the tokens so far) and end.
        Raises EngineRequestError for parameters the engine rejects and
        EngineDeadError when the engine is gone.
        """

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a running request; a no-op for unknown or finished ids."""

    @abstractmethod
    async def reset_prefix_cache(self, *, running: bool = False) -> bool:
        """Drop cached prefix blocks; True when the engine did. ``running``: also
        those of requests running now (they are recomputed). When it returns
        True, AllBlocksCleared has gone to the KV-event sink (the router must
        forget this worker's blocks now, not at the engine's next step)."""

    @abstractmethod
    def load(self) -> EngineLoad:
        """Requests the engine holds now; cheap, called by tests and GetLoad."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine can no longer serve."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and release its resources; safe to call twice."""

    # -- the refit cycle (see refit.py); not supported unless overridden --------

    def rl_capabilities(self) -> RlCapabilities:
        return RlCapabilities()

    def _unsupported(self, what: str) -> RefitUnsupported:
        return RefitUnsupported(f"{what} is not supported by the {type(self).__name__} engine")

    def check_sleep(self) -> None:
        """Raise RefitUnsupported, saying why, when this engine cannot sleep:
        checked before anything changes, so a refused sleep holds no request."""
        if not self.rl_capabilities().sleep:
            raise self._unsupported("sleep mode")

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Stop generating. ABORT: end every request with finish reason ABORTED
        now; WAIT: return once none runs; KEEP: freeze them until ``resume``."""
        raise self._unsupported("pausing generation")

    async def resume(self) -> None:
        raise self._unsupported("pausing generation")

    async def load_weights_from_path(self, path: str, *, allow_partial: bool) -> WeightLoad:
        """Load a checkpoint directory; WeightUpdateError (nothing loaded) when it
        does not fit the model."""
        raise self._unsupported("loading weights from a path")

    async def begin_tensor_update(
        self, tensors: Sequence[TensorSpec], *, allow_partial: bool
    ) -> WeightWriter:
        """Check the manifest against the model (WeightUpdateError) and get ready
        to receive the tensors' bytes."""
        raise self._unsupported("loading streamed tensors")

    async def weight_names(self) -> Collection[str] | None:
        """The served checkpoint's tensor names (None: not known). A streamed
        update names no more tensors than these (each one of them, once), so a
        longer manifest is refused before its tensors are read: reading 100,000
        costs some 35 MB, which the allocator keeps."""
        return None

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        raise self._unsupported("a weight-transfer engine")

    async def start_weight_update(self) -> None:
        raise self._unsupported("a weight-transfer engine")

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        raise self._unsupported("a weight-transfer engine")

    async def finish_weight_update(self) -> WeightLoad:
        raise self._unsupported("a weight-transfer engine")

    async def abort_weight_update(self, reason: str) -> None:
        """Roll back an update its trainer left part way (started, never finished),
        so that the old weights serve again; EngineFailed when what it loaded could
        not be put back. Unsupported engines keep the update in progress."""
        raise self._unsupported("rolling back a weight-transfer update")

    async def shutdown_weight_transfer(self) -> None:
        raise self._unsupported("a weight-transfer engine")

    async def weight_version(self) -> str:
        """The engine's own label of the weights serving now."""
        return "default"

    async def set_weight_version(self, version: str) -> None:
        raise self._unsupported("weight versions")

    async def sleep(self, level: int, mode: PauseMode) -> None:
        raise self._unsupported("sleep mode")

    async def wake_up(self, tags: Sequence[str]) -> bool:
        raise self._unsupported("sleep mode")
