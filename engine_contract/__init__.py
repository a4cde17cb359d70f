"""The engine-server contract: generated stubs (``engine_contract.v1``) and its revision.

Both processes import this one package, so the .proto is registered once in
protobuf's descriptor pool. Only ``v1/*_pb2*.py`` are generated (``make proto``);
this file and ``v1/__init__.py`` are written by hand.
"""

# Bump on every behavioural change to the contract. Supported: the last two
# revisions (docs/contract.md, "Supported revisions"). Servers accept clients from
# MINIMUM_CLIENT_REVISION on, clients servers from MINIMUM_SERVER_REVISION on; a
# peer outside that is refused at GetServerInfo, never served by a fallback. A
# bump moves both minimums to the revision before it, and the code kept for the
# revision that leaves the window goes (tests/unit/test_contract_window.py).
# Revision history (what each added; the notes on older peers are history):
#   1  first release.
#   2  Rollouts: many rollouts multiplexed over one bidirectional stream;
#      SubscribeKvEvents may pack several batches into one message.
#   3  GenerationDefaults carry the config's stop strings, ignore_eos and
#      bad_words; a rollout whose prompt fills the context generates nothing
#      instead of failing. Admission limits announced in ServerLimits, and a
#      capacity refusal names its limit (RolloutError.limit, the
#      engine-contract-limit trailer): retryable, unlike "message too big".
#      The refit cycle (pause/resume, weight updates from a path, streamed
#      tensors or a weight-transfer engine, weight versions, sleep/wake),
#      rl_capabilities and refit_state, weight_versions spans on every result.
#      Data-parallel ranks: a request may name its rank; data_parallel_start_rank.
#   4  Generates: ordinary completions multiplexed over one bidirectional
#      stream, their deltas packed (and merged per completion) under load.
#   5  RolloutStart and GenerateStart carry the request's W3C trace context
#      (trace_context: traceparent, tracestate), as a unary call's metadata
#      does; an entry over the bound (``engine_contract.trace``) is dropped,
#      never refused.
#   6  Paced Generates: a completion started with GenerateStart.paced gets its
#      next delta only after the client names it in GeneratesRequest.taken, so
#      the client's pace sets how coarse the deltas are (an older server ignores
#      both fields and sends deltas as they come).
#   7  InitWeightTransferEngineRequest.timeout_ms: the caller's deadline for the
#      init (Dynamo's DYN_RL_INIT_WEIGHTS_TIMEOUT_S), past which the server shuts
#      the transfer engine down and answers DEADLINE_EXCEEDED, serving its old
#      weights (an older server ignores it: only its refit deadline bounds the init).
#   8  Version-guarded requests: RolloutRequest and GenerateRequest may name the
#      weight version they require (required_weight_version). A server serving
#      another label refuses them with ABORTED (retryable) before generating;
#      one whose weights or label change under them ends them with finish reason
#      WEIGHT_VERSION_CHANGED and the tokens so far (an older server ignores the
#      field: clients sent it only to servers of revision 8 or later).
#   9  GetEngineMetrics: the engine's own Prometheus series (vLLM's ``vllm:``
#      and ``lmcache:`` families) as exposition text, so that a client can
#      publish them in its worker's /metrics as dynamo.vllm does (an older
#      server answers UNIMPLEMENTED: clients called it only on servers of
#      revision 9 or later).
#  10  Weight fencing: RefitState.weight_changes counts the weight and label
#      changes begun; loads (WeightUpdateOptions), StartWeightUpdate and
#      UpdateWeightVersion may carry expect_weight_changes and are refused
#      FAILED_PRECONDITION, nothing changed, when the counter moved on (another
#      writer came first). Clients send it only to servers of
#      revision 10 or later (an older server ignores it).
#  11  Cache salt: GenerateRequest.cache_salt puts a request's prompt blocks in
#      a prefix-cache namespace of their own (vLLM's cache_salt; outputs
#      unchanged), and BlockStored.cache_salt names the salted chain an event
#      extends, for the router. Clients send it only to servers of
#      revision 11 or later (an older server ignores it).
#  12  Weights part way: RefitState.weights_mixed (and GetWeightVersionResponse's)
#      says why the weights serving are not the ones their label names (a
#      weight-transfer update part way, or one ended unfinished without rollback),
#      and weight_update_open whether an update is open, so that a fleet's keeper
#      and a bridge's catch-up load whole weights on a worker whose label alone
#      looks current, and leave an open update to its writer (a revision-11
#      server leaves both unset: it said nothing of either). The server refuses
#      path and tensor updates while a weight-transfer update is open.
#  13  A tensor stream's end, said: TensorManifest.ends_with_marker announces an
#      `end` message after the last chunk (TensorStreamEnd). The server commits at
#      once on it, and loads nothing from a stream that ends without it (a client
#      that died between its last chunk and its half-close), where it otherwise
#      waits a moment at the stream's end for the cancellation a death brings.
#      Clients send both only to servers of revision 13 or later (an older server
#      refuses the `end` message): TENSOR_STREAM_END_REVISION.
CONTRACT_REVISION = 13
MINIMUM_CLIENT_REVISION = 12
MINIMUM_SERVER_REVISION = 12

# The first revision whose servers take a tensor stream's `end` message.
TENSOR_STREAM_END_REVISION = 13

SERVICE_NAME = "engine_contract.v1.EngineService"

__all__ = [
    "CONTRACT_REVISION",
    "MINIMUM_CLIENT_REVISION",
    "MINIMUM_SERVER_REVISION",
    "SERVICE_NAME",
    "TENSOR_STREAM_END_REVISION",
]
