"""The Dynamo bridge: a Dynamo ``LLMEngine`` that forwards to one engine server.

Kept import-free: the compatibility modules ``rl_client.driver``, ``rl_client.batch``
and ``rl_client.refit`` (now ``rl_client``) must load without Dynamo, and nothing
here may pull in vllm or torch.
"""
