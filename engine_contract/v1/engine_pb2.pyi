from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutedExpertsMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTED_EXPERTS_MODE_UNSPECIFIED: _ClassVar[RoutedExpertsMode]
    ROUTED_EXPERTS_MODE_OMIT: _ClassVar[RoutedExpertsMode]
    ROUTED_EXPERTS_MODE_REQUIRE: _ClassVar[RoutedExpertsMode]

class TensorDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_DTYPE_UNSPECIFIED: _ClassVar[TensorDtype]
    TENSOR_DTYPE_UINT8: _ClassVar[TensorDtype]
    TENSOR_DTYPE_INT8: _ClassVar[TensorDtype]
    TENSOR_DTYPE_UINT16: _ClassVar[TensorDtype]
    TENSOR_DTYPE_INT16: _ClassVar[TensorDtype]
    TENSOR_DTYPE_INT32: _ClassVar[TensorDtype]
    TENSOR_DTYPE_INT64: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT16: _ClassVar[TensorDtype]
    TENSOR_DTYPE_BFLOAT16: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT32: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT64: _ClassVar[TensorDtype]
    TENSOR_DTYPE_BOOL: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT8_E4M3FN: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT8_E5M2: _ClassVar[TensorDtype]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_WEIGHT_VERSION_CHANGED: _ClassVar[FinishReason]

class AbortOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ABORT_OUTCOME_UNSPECIFIED: _ClassVar[AbortOutcome]
    ABORT_OUTCOME_ABORTED: _ClassVar[AbortOutcome]
    ABORT_OUTCOME_ALREADY_FINISHED: _ClassVar[AbortOutcome]
    ABORT_OUTCOME_NOT_FOUND: _ClassVar[AbortOutcome]

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]
ROUTED_EXPERTS_MODE_UNSPECIFIED: RoutedExpertsMode
ROUTED_EXPERTS_MODE_OMIT: RoutedExpertsMode
ROUTED_EXPERTS_MODE_REQUIRE: RoutedExpertsMode
TENSOR_DTYPE_UNSPECIFIED: TensorDtype
TENSOR_DTYPE_UINT8: TensorDtype
TENSOR_DTYPE_INT8: TensorDtype
TENSOR_DTYPE_UINT16: TensorDtype
TENSOR_DTYPE_INT16: TensorDtype
TENSOR_DTYPE_INT32: TensorDtype
TENSOR_DTYPE_INT64: TensorDtype
TENSOR_DTYPE_FLOAT16: TensorDtype
TENSOR_DTYPE_BFLOAT16: TensorDtype
TENSOR_DTYPE_FLOAT32: TensorDtype
TENSOR_DTYPE_FLOAT64: TensorDtype
TENSOR_DTYPE_BOOL: TensorDtype
TENSOR_DTYPE_FLOAT8_E4M3FN: TensorDtype
TENSOR_DTYPE_FLOAT8_E5M2: TensorDtype
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_WEIGHT_VERSION_CHANGED: FinishReason
ABORT_OUTCOME_UNSPECIFIED: AbortOutcome
ABORT_OUTCOME_ABORTED: AbortOutcome
ABORT_OUTCOME_ALREADY_FINISHED: AbortOutcome
ABORT_OUTCOME_NOT_FOUND: AbortOutcome
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode

class GetServerInfoRequest(_message.Message):
    __slots__ = ("client_revision",)
    CLIENT_REVISION_FIELD_NUMBER: _ClassVar[int]
    client_revision: int
    def __init__(self, client_revision: _Optional[int] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("contract_revision", "minimum_client_revision", "instance_id", "model_name", "model_path", "engine_config", "eos_token_ids", "vocab_size", "generation_defaults", "backend_name", "backend_version", "limits", "start_time_unix_nanos", "routed_experts_available", "rl_capabilities", "refit_state")
    CONTRACT_REVISION_FIELD_NUMBER: _ClassVar[int]
    MINIMUM_CLIENT_REVISION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    START_TIME_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    RL_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    REFIT_STATE_FIELD_NUMBER: _ClassVar[int]
    contract_revision: int
    minimum_client_revision: int
    instance_id: str
    model_name: str
    model_path: str
    engine_config: EngineConfig
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    generation_defaults: GenerationDefaults
    backend_name: str
    backend_version: str
    limits: ServerLimits
    start_time_unix_nanos: int
    routed_experts_available: bool
    rl_capabilities: RlCapabilities
    refit_state: RefitState
    def __init__(self, contract_revision: _Optional[int] = ..., minimum_client_revision: _Optional[int] = ..., instance_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_path: _Optional[str] = ..., engine_config: _Optional[_Union[EngineConfig, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., generation_defaults: _Optional[_Union[GenerationDefaults, _Mapping]] = ..., backend_name: _Optional[str] = ..., backend_version: _Optional[str] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., start_time_unix_nanos: _Optional[int] = ..., routed_experts_available: _Optional[bool] = ..., rl_capabilities: _Optional[_Union[RlCapabilities, _Mapping]] = ..., refit_state: _Optional[_Union[RefitState, _Mapping]] = ...) -> None: ...

class RlCapabilities(_message.Message):
    __slots__ = ("pause", "update_from_path", "update_from_tensors", "weight_transfer_backend", "sleep")
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FROM_PATH_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FROM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SLEEP_FIELD_NUMBER: _ClassVar[int]
    pause: bool
    update_from_path: bool
    update_from_tensors: bool
    weight_transfer_backend: str
    sleep: bool
    def __init__(self, pause: _Optional[bool] = ..., update_from_path: _Optional[bool] = ..., update_from_tensors: _Optional[bool] = ..., weight_transfer_backend: _Optional[str] = ..., sleep: _Optional[bool] = ...) -> None: ...

class RefitState(_message.Message):
    __slots__ = ("paused", "pause_mode", "sleeping", "weight_version", "weight_version_declared", "weight_changes", "weights_mixed", "weight_update_open")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_DECLARED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_MIXED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATE_OPEN_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    pause_mode: PauseMode
    sleeping: bool
    weight_version: str
    weight_version_declared: bool
    weight_changes: int
    weights_mixed: str
    weight_update_open: bool
    def __init__(self, paused: _Optional[bool] = ..., pause_mode: _Optional[_Union[PauseMode, str]] = ..., sleeping: _Optional[bool] = ..., weight_version: _Optional[str] = ..., weight_version_declared: _Optional[bool] = ..., weight_changes: _Optional[int] = ..., weights_mixed: _Optional[str] = ..., weight_update_open: _Optional[bool] = ...) -> None: ...

class EngineConfig(_message.Message):
    __slots__ = ("context_length", "kv_block_size", "total_kv_blocks", "max_running_sequences", "max_batched_tokens", "data_parallel_size", "data_parallel_start_rank")
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_START_RANK_FIELD_NUMBER: _ClassVar[int]
    context_length: int
    kv_block_size: int
    total_kv_blocks: int
    max_running_sequences: int
    max_batched_tokens: int
    data_parallel_size: int
    data_parallel_start_rank: int
    def __init__(self, context_length: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., max_running_sequences: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., data_parallel_size: _Optional[int] = ..., data_parallel_start_rank: _Optional[int] = ...) -> None: ...

class GenerationDefaults(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop_strings", "ignore_eos", "bad_words")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_stop_strings", "max_stop_string_length", "max_request_id_length", "max_message_bytes", "max_top_logprobs", "max_requests_in_flight", "max_rollouts_per_stream", "max_starts_per_message", "max_waiting_requests", "max_kv_subscribers")
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_ID_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLOUTS_PER_STREAM_FIELD_NUMBER: _ClassVar[int]
    MAX_STARTS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    max_stop_strings: int
    max_stop_string_length: int
    max_request_id_length: int
    max_message_bytes: int
    max_top_logprobs: int
    max_requests_in_flight: int
    max_rollouts_per_stream: int
    max_starts_per_message: int
    max_waiting_requests: int
    max_kv_subscribers: int
    def __init__(self, max_stop_strings: _Optional[int] = ..., max_stop_string_length: _Optional[int] = ..., max_request_id_length: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., max_requests_in_flight: _Optional[int] = ..., max_rollouts_per_stream: _Optional[int] = ..., max_starts_per_message: _Optional[int] = ..., max_waiting_requests: _Optional[int] = ..., max_kv_subscribers: _Optional[int] = ...) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "greedy", "stop_strings", "max_new_tokens", "routed_experts", "data_parallel_rank", "required_weight_version", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    greedy: bool
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    max_new_tokens: int
    routed_experts: RoutedExpertsMode
    data_parallel_rank: int
    required_weight_version: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., greedy: _Optional[bool] = ..., stop_strings: _Optional[_Iterable[str]] = ..., max_new_tokens: _Optional[int] = ..., routed_experts: _Optional[_Union[RoutedExpertsMode, str]] = ..., data_parallel_rank: _Optional[int] = ..., required_weight_version: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class RolloutResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "matched_stop", "truncated", "usage", "routed_experts", "r3_stats", "instance_id", "weight_versions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    R3_STATS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    matched_stop: StopMatch
    truncated: bool
    usage: Usage
    routed_experts: RoutedExperts
    r3_stats: R3Stats
    instance_id: str
    weight_versions: _containers.RepeatedCompositeFieldContainer[WeightVersionSpan]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., matched_stop: _Optional[_Union[StopMatch, _Mapping]] = ..., truncated: _Optional[bool] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., r3_stats: _Optional[_Union[R3Stats, _Mapping]] = ..., instance_id: _Optional[str] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ...) -> None: ...

class WeightVersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: str
    start: int
    end: int
    def __init__(self, version: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class RolloutsRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedCompositeFieldContainer[RolloutStart]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Iterable[_Union[RolloutStart, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class RolloutStart(_message.Message):
    __slots__ = ("tag", "rollout", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAG_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    rollout: RolloutRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, tag: _Optional[int] = ..., rollout: _Optional[_Union[RolloutRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RolloutsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RolloutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RolloutResult, _Mapping]]] = ...) -> None: ...

class RolloutResult(_message.Message):
    __slots__ = ("tag", "response", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    response: RolloutResponse
    error: RolloutError
    def __init__(self, tag: _Optional[int] = ..., response: _Optional[_Union[RolloutResponse, _Mapping]] = ..., error: _Optional[_Union[RolloutError, _Mapping]] = ...) -> None: ...

class RolloutError(_message.Message):
    __slots__ = ("code", "message", "limit")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    limit: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., limit: _Optional[str] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: TensorDtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[_Union[TensorDtype, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class R3Stats(_message.Message):
    __slots__ = ("actual_routes", "expected_routes", "missing_routes", "surplus_routes")
    ACTUAL_ROUTES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ROUTES_FIELD_NUMBER: _ClassVar[int]
    MISSING_ROUTES_FIELD_NUMBER: _ClassVar[int]
    SURPLUS_ROUTES_FIELD_NUMBER: _ClassVar[int]
    actual_routes: int
    expected_routes: int
    missing_routes: int
    surplus_routes: int
    def __init__(self, actual_routes: _Optional[int] = ..., expected_routes: _Optional[int] = ..., missing_routes: _Optional[int] = ..., surplus_routes: _Optional[int] = ...) -> None: ...

class StopMatch(_message.Message):
    __slots__ = ("token_id", "stop_string")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    stop_string: str
    def __init__(self, token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stop", "output", "data_parallel_rank", "required_weight_version", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stop: StopConditions
    output: OutputOptions
    data_parallel_rank: int
    required_weight_version: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopConditions, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., data_parallel_rank: _Optional[int] = ..., required_weight_version: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop_strings", "stop_token_ids", "ignore_eos", "include_stop_str_in_output")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("logprobs", "routed_experts")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    logprobs: int
    routed_experts: RoutedExpertsMode
    def __init__(self, logprobs: _Optional[int] = ..., routed_experts: _Optional[_Union[RoutedExpertsMode, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_logprobs", "finished")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    finished: GenerateFinished
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., finished: _Optional[_Union[GenerateFinished, _Mapping]] = ...) -> None: ...

class GeneratesRequest(_message.Message):
    __slots__ = ("start", "cancel", "taken")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedCompositeFieldContainer[GenerateStart]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    taken: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Iterable[_Union[GenerateStart, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ..., taken: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateStart(_message.Message):
    __slots__ = ("tag", "generate", "trace_context", "paced")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAG_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PACED_FIELD_NUMBER: _ClassVar[int]
    tag: int
    generate: GenerateRequest
    trace_context: _containers.ScalarMap[str, str]
    paced: bool
    def __init__(self, tag: _Optional[int] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., paced: _Optional[bool] = ...) -> None: ...

class GeneratesResponse(_message.Message):
    __slots__ = ("deltas",)
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[GenerateDelta]
    def __init__(self, deltas: _Optional[_Iterable[_Union[GenerateDelta, _Mapping]]] = ...) -> None: ...

class GenerateDelta(_message.Message):
    __slots__ = ("tag", "response", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    response: GenerateResponse
    error: RolloutError
    def __init__(self, tag: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error: _Optional[_Union[RolloutError, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateFinished(_message.Message):
    __slots__ = ("finish_reason", "matched_stop", "usage", "routed_experts", "instance_id", "weight_versions")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    matched_stop: StopMatch
    usage: Usage
    routed_experts: RoutedExperts
    instance_id: str
    weight_versions: _containers.RepeatedCompositeFieldContainer[WeightVersionSpan]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., matched_stop: _Optional[_Union[StopMatch, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., instance_id: _Optional[str] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "all", "instance_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    all: bool
    instance_id: str
    def __init__(self, request_id: _Optional[str] = ..., all: _Optional[bool] = ..., instance_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("outcome", "aborted_count")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ABORTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    outcome: AbortOutcome
    aborted_count: int
    def __init__(self, outcome: _Optional[_Union[AbortOutcome, str]] = ..., aborted_count: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("start_sequence_number", "include_snapshot", "snapshot_if_unavailable", "expected_instance_id", "max_batches_per_message", "max_delay_ms")
    START_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_IF_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    start_sequence_number: int
    include_snapshot: bool
    snapshot_if_unavailable: bool
    expected_instance_id: str
    max_batches_per_message: int
    max_delay_ms: int
    def __init__(self, start_sequence_number: _Optional[int] = ..., include_snapshot: _Optional[bool] = ..., snapshot_if_unavailable: _Optional[bool] = ..., expected_instance_id: _Optional[str] = ..., max_batches_per_message: _Optional[int] = ..., max_delay_ms: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsResponse(_message.Message):
    __slots__ = ("batch", "batches")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batch: KvEventBatch
    batches: _containers.RepeatedCompositeFieldContainer[KvEventBatch]
    def __init__(self, batch: _Optional[_Union[KvEventBatch, _Mapping]] = ..., batches: _Optional[_Iterable[_Union[KvEventBatch, _Mapping]]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("instance_id", "sequence_number", "events", "timestamp_unix_nanos", "data_parallel_rank", "snapshot")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    sequence_number: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    timestamp_unix_nanos: int
    data_parallel_rank: int
    snapshot: SnapshotPart
    def __init__(self, instance_id: _Optional[str] = ..., sequence_number: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., timestamp_unix_nanos: _Optional[int] = ..., data_parallel_rank: _Optional[int] = ..., snapshot: _Optional[_Union[SnapshotPart, _Mapping]] = ...) -> None: ...

class SnapshotPart(_message.Message):
    __slots__ = ("index", "last")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    index: int
    last: bool
    def __init__(self, index: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "cache_salt")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    cache_salt: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset",)
    RESET_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    def __init__(self, reset: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_blocks_used", "kv_blocks_total", "registered_requests", "refit_state")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REFIT_STATE_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    registered_requests: int
    refit_state: RefitState
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., registered_requests: _Optional[int] = ..., refit_state: _Optional[_Union[RefitState, _Mapping]] = ...) -> None: ...

class GetEngineMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEngineMetricsResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode", "clear_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    clear_cache: bool
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ..., clear_cache: _Optional[bool] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("aborted_count", "cache_cleared")
    ABORTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    CACHE_CLEARED_FIELD_NUMBER: _ClassVar[int]
    aborted_count: int
    cache_cleared: bool
    def __init__(self, aborted_count: _Optional[int] = ..., cache_cleared: _Optional[bool] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ("resumed",)
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    resumed: bool
    def __init__(self, resumed: _Optional[bool] = ...) -> None: ...

class IsPausedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class WeightUpdateOptions(_message.Message):
    __slots__ = ("weight_version", "reset_prefix_cache", "allow_unpaused", "allow_partial", "expect_weight_changes")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_UNPAUSED_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    EXPECT_WEIGHT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    reset_prefix_cache: bool
    allow_unpaused: bool
    allow_partial: bool
    expect_weight_changes: int
    def __init__(self, weight_version: _Optional[str] = ..., reset_prefix_cache: _Optional[bool] = ..., allow_unpaused: _Optional[bool] = ..., allow_partial: _Optional[bool] = ..., expect_weight_changes: _Optional[int] = ...) -> None: ...

class WeightUpdateResult(_message.Message):
    __slots__ = ("weight_version", "cache_cleared", "tensors", "bytes", "load_ms", "weight_changes")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_CLEARED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    cache_cleared: bool
    tensors: int
    bytes: int
    load_ms: int
    weight_changes: int
    def __init__(self, weight_version: _Optional[str] = ..., cache_cleared: _Optional[bool] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., load_ms: _Optional[int] = ..., weight_changes: _Optional[int] = ...) -> None: ...

class UpdateWeightsFromPathRequest(_message.Message):
    __slots__ = ("path", "options")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    path: str
    options: WeightUpdateOptions
    def __init__(self, path: _Optional[str] = ..., options: _Optional[_Union[WeightUpdateOptions, _Mapping]] = ...) -> None: ...

class UpdateWeightsFromPathResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: WeightUpdateResult
    def __init__(self, result: _Optional[_Union[WeightUpdateResult, _Mapping]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: TensorDtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[TensorDtype, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorManifest(_message.Message):
    __slots__ = ("tensors", "options", "ends_with_marker")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ENDS_WITH_MARKER_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    options: WeightUpdateOptions
    ends_with_marker: bool
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., options: _Optional[_Union[WeightUpdateOptions, _Mapping]] = ..., ends_with_marker: _Optional[bool] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tensor", "offset", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    offset: int
    data: bytes
    def __init__(self, tensor: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorStreamEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsFromTensorsRequest(_message.Message):
    __slots__ = ("manifest", "chunk", "end")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    manifest: TensorManifest
    chunk: TensorChunk
    end: TensorStreamEnd
    def __init__(self, manifest: _Optional[_Union[TensorManifest, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., end: _Optional[_Union[TensorStreamEnd, _Mapping]] = ...) -> None: ...

class UpdateWeightsFromTensorsResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: WeightUpdateResult
    def __init__(self, result: _Optional[_Union[WeightUpdateResult, _Mapping]] = ...) -> None: ...

class InitWeightTransferEngineRequest(_message.Message):
    __slots__ = ("init_info_json", "timeout_ms")
    INIT_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    init_info_json: bytes
    timeout_ms: int
    def __init__(self, init_info_json: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class InitWeightTransferEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartWeightUpdateRequest(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: WeightUpdateOptions
    def __init__(self, options: _Optional[_Union[WeightUpdateOptions, _Mapping]] = ...) -> None: ...

class StartWeightUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("update_info_json",)
    UPDATE_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    update_info_json: bytes
    def __init__(self, update_info_json: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishWeightUpdateRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...

class FinishWeightUpdateResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: WeightUpdateResult
    def __init__(self, result: _Optional[_Union[WeightUpdateResult, _Mapping]] = ...) -> None: ...

class ShutdownWeightTransferEngineRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownWeightTransferEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWeightVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWeightVersionResponse(_message.Message):
    __slots__ = ("weight_version", "declared", "weight_changes", "weights_mixed", "weight_update_open")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DECLARED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_MIXED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATE_OPEN_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    declared: bool
    weight_changes: int
    weights_mixed: str
    weight_update_open: bool
    def __init__(self, weight_version: _Optional[str] = ..., declared: _Optional[bool] = ..., weight_changes: _Optional[int] = ..., weights_mixed: _Optional[str] = ..., weight_update_open: _Optional[bool] = ...) -> None: ...

class UpdateWeightVersionRequest(_message.Message):
    __slots__ = ("weight_version", "expect_weight_changes")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECT_WEIGHT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    expect_weight_changes: int
    def __init__(self, weight_version: _Optional[str] = ..., expect_weight_changes: _Optional[int] = ...) -> None: ...

class UpdateWeightVersionResponse(_message.Message):
    __slots__ = ("weight_version", "weight_changes")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    weight_changes: int
    def __init__(self, weight_version: _Optional[str] = ..., weight_changes: _Optional[int] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level", "mode")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    level: int
    mode: PauseMode
    def __init__(self, level: _Optional[int] = ..., mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("awake",)
    AWAKE_FIELD_NUMBER: _ClassVar[int]
    awake: bool
    def __init__(self, awake: _Optional[bool] = ...) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("sleeping",)
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    sleeping: bool
    def __init__(self, sleeping: _Optional[bool] = ...) -> None: ...
