"""The worker's admin HTTP server: its system port (``system_server``), the
admin token's middleware (``auth``), dynamo.vllm's RL admin routes (``rl_admin``)
and the ``<namespace>.<component>.rl`` endpoint (``rl_endpoint``)."""
