"""``make bench``: what the gRPC hop between the bridge and the engine server costs.

``python -m bench`` (``__main__``: options, the parts in order, bench.md and
bench.json). One module per part, each returning a typed result that renders
its own table:

- ``frontend_rollouts``  1. rollouts through Dynamo's frontend, one process vs two
- ``hop``                2. the gRPC hop alone, vs the same engine code in-process
- ``large_rollout``      3. one 16k-token rollout with routed experts: bytes and time
- ``kv_events``          4. KV events through the relay: sustained rate, latency
- ``vllm_stack``         5. the vLLM engine server through the stack vs AsyncLLM
- ``refit``              6. the refit cycle: streamed, gloo and disk updates' MB/s
- ``streaming``          7. streamed completions through Dynamo's frontend
- ``aiperf_compare``     8. parts 1 and 7 measured by aiperf
- ``fleet``              9. N sim workers: fleet refit (disk, streamed), registration, memory

Shared: ``context`` (options, model, prompts, processes), ``measure``
(interleaved repetitions, CPU time by process role), ``stats`` (closed-loop
load, medians), ``report`` (markdown). Programs the parts start:
``inprocess_engine`` (the one-process worker, on ``local_engine``),
``kv_source`` / ``kv_worker`` (part 4), ``vllm_direct`` (part 5),
``gloo_trainer`` (part 6's trainer; its checkpoints from ``refit_checkpoints``).
"""
