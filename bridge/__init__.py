"""The Dynamo bridge: a Dynamo ``LLMEngine`` that forwards to one engine server.

Kept import-free, so that importing one module (``bridge.client``, ``bridge.codec``)
loads only what that module needs; nothing here may pull in vllm or torch (the
bridge runs where they cannot be imported).
"""
