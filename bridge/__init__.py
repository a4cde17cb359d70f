"""The Dynamo bridge: a Dynamo ``LLMEngine`` that forwards to one engine server.

Kept import-free: ``bridge.driver`` and ``bridge.wire`` must load without
Dynamo, and nothing here may pull in vllm or torch.
"""
