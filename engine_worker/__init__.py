"""``python -m engine_worker``: the worker command NeMo RL launches, split in two.

It takes the command line NeMo RL builds for ``python -m dynamo.vllm`` and runs
an engine server (``python -m engine_server``) and a bridge (``python -m
bridge``) as two supervised child processes, joined by a unix socket in a
private folder. It imports neither vLLM nor Dynamo: each side's parser is asked,
in a child process, which flags it knows (``engine_worker.flags``), and every
argument goes to the side that knows it (see ``engine_worker.split``); the
engine side's child then serves as the engine server (``engine_worker.listing``).
"""
