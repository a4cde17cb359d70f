"""Cheap deterministic 64-bit integer mixing.

Everything the simulated engine derives (block hashes, candidate tokens,
sampling draws, routed experts) comes from these functions, so results are the
same across runs, processes and machines. Python's ``hash()`` is salted per
process for ``str`` and ``hashlib`` is too slow per token, hence splitmix64.
"""

from __future__ import annotations

from collections.abc import Iterable

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15

# Rolling hash of an empty context: the root every block-hash chain starts from.
ROOT_HASH = 0x2545F4914F6CDD1D


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with good avalanche."""
    z = (x + GOLDEN64) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def extend_hash(h: int, token_ids: Iterable[int]) -> int:
    """Fold tokens into a rolling context hash, one mix per token."""
    for t in token_ids:
        h = mix64(h ^ t)
    return h


def str_key(text: str) -> int:
    """Stable 64-bit key of a string (FNV-1a, then mixed)."""
    h = 0xCBF29CE484222325
    for b in text.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & MASK64
    return mix64(h)


def unit_float(x: int) -> float:
    """The top 53 bits of a 64-bit value as a float in [0, 1)."""
    return (x >> 11) * (1.0 / (1 << 53))
