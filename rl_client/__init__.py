"""The RL side's clients: what a driver and a trainer import, no Dynamo in sight.

- ``rl_client.driver``: ``RolloutClient``, rollouts through a Dynamo frontend
  (aiohttp); ``rl_client.annotation``: the ``rollout:`` annotation, which the
  driver writes and the bridge reads; ``rl_client.wire``: a rollout's JSON in
  ``engine_data``, which the bridge writes and the driver reads.
- ``rl_client.batch``: a batch of rollouts as NeMo RL's ``GenerationOutputSpec``
  (numpy).
- ``rl_client.refit``: the trainer's fleet refit (``RefitClient`` over the
  workers' admin routes, ``EngineRefitClient`` over the contract), the cycle
  itself in ``rl_client.fleet_cycle``, its report in ``rl_client.refit_report``;
  ``rl_client.weight_sync``: vLLM's ``VLLMWeightSyncClient`` over the contract
  or the admin routes;
  ``rl_client.refit_rpc``: the contract's refit RPCs, one typed method each;
  ``rl_client.tls``: TLS options for the contract, the bridge's own;
  ``rl_client.admin_token``: the workers' admin token.

Kept import-free, and importable with the ``driver`` extra alone: no module
here imports dynamo, vllm, torch, ``bridge`` or ``engine_server`` (tests keep it
so). The bridge imports from here, never the other way.
"""
