"""The ``gloo`` weight transfer's parts, each for one job; the engines vLLM
registers, composed of them, are ``engine_server.weight_transfer_gloo``."""
