"""The worker's admin HTTP server: its system port (``system_server``), the
admin token's middleware (``auth``), the RL admin routes (``rl_admin``, with
``weight_transfer`` and ``answers``) in three spellings (``surface``: dynamo.vllm's,
``vllm_routes``, ``sidecar_routes``, over ``http_routes``) and the
``<namespace>.<component>.rl`` endpoint (``rl_endpoint``, ``instance_alias``)."""
