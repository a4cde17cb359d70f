"""The simulated engine backend: a deterministic stand-in for a GPU engine.

Modules: ``config`` (SimConfig, CLI flags), ``hashing`` (splitmix64 mixing),
``tokenizer`` (vocab, EOS, detokenization), ``sampler`` (logits, sampling,
logprobs), ``prefix_cache`` (paged blocks, LRU, KV events), ``request``
(per-request state and stop rules), ``scheduler`` (what runs each step),
``engine`` (the timed step loop), ``routed_experts`` and ``backend``
(SimBackend).
"""

from engine_server.backends.sim.backend import SimBackend
from engine_server.backends.sim.config import SimConfig
from engine_server.backends.sim.routed_experts import RoutedExpertsConfig

__all__ = ["RoutedExpertsConfig", "SimBackend", "SimConfig"]
