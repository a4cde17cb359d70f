"""Synthetic MoE router choices, for testing router replay ("R3") end to end.

Like vLLM, a finished request reports one row per position whose KV was
computed: the prompt and every generated token except the last one, which was
sampled but never fed back through the model.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from engine_server.backends.base import RoutedExpertsArray
from engine_server.backends.sim.hashing import MASK64, mix64

# Row shapes per expert count (bounds the tables: 64 x 2E entries).
_MAX_STRIDES = 64


@dataclass(frozen=True)
class RoutedExpertsConfig:
    """Shape of the simulated MoE: layers, experts chosen per token, experts."""

    num_layers: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"routed experts: layers must be >= 1, got {self.num_layers}")
        if not 1 <= self.num_experts <= 65536:
            raise ValueError(
                f"routed experts: num_experts must be in 1..65536, got {self.num_experts}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"routed experts: top_k must be in 1..num_experts ({self.num_experts}), "
                f"got {self.top_k}"
            )

    @classmethod
    def parse(cls, text: str) -> RoutedExpertsConfig:
        """Parse ``LAYERS,TOPK,NUM_EXPERTS``, as given to ``--routed-experts``."""
        parts = [p.strip() for p in text.split(",")]
        try:
            layers, top_k, experts = (int(p) for p in parts)
        except ValueError:
            raise ValueError(
                f"routed experts: expected LAYERS,TOPK,NUM_EXPERTS (three integers), got {text!r}"
            ) from None
        return cls(num_layers=layers, top_k=top_k, num_experts=experts)

    @property
    def dtype(self) -> str:
        # Expert ids fit in the smallest unsigned type, as engines report them.
        return "uint8" if self.num_experts <= 256 else "uint16"


class RoutedExpertsGenerator:
    """Derives top-k distinct expert ids from (token, position, layer) and a seed."""

    def __init__(self, config: RoutedExpertsConfig, seed: int) -> None:
        self.config = config
        self._key = mix64((seed & MASK64) ^ 0x52334558504552)
        e = config.num_experts
        # Strides coprime with E make base + i*stride (mod E) distinct for i < E,
        # so one hash per (position, layer) gives a whole row of distinct experts.
        strides = [s for s in range(1, e) if math.gcd(s, e) == 1][:_MAX_STRIDES] or [1]
        self._strides = strides
        # base + i*s = (j + i)*s (mod E) with j = base * s^-1: a row is a slice of
        # the multiples of s (listed twice, so that no slice wraps), copied at C
        # speed rather than computed element by element.
        self._inverses = [pow(s, -1, e) if e > 1 else 0 for s in strides]
        self._tables: dict[int, array[int]] = {}
        self._typecode = "B" if config.dtype == "uint8" else "H"

    def _table(self, k: int) -> array[int]:
        table = self._tables.get(k)
        if table is None:
            e, stride = self.config.num_experts, self._strides[k]
            table = self._tables[k] = array(
                self._typecode, [(i * stride) % e for i in range(e)] * 2
            )
        return table

    def build(self, token_ids: Sequence[int], num_rows: int) -> RoutedExpertsArray:
        """Rows for positions ``0 .. num_rows - 1`` of ``token_ids``."""
        cfg = self.config
        e, top_k, layers = cfg.num_experts, cfg.top_k, cfg.num_layers
        n_strides, key, inverses, table = len(self._strides), self._key, self._inverses, self._table
        data = array(self._typecode)
        extend = data.extend
        for pos in range(num_rows):
            hp = mix64(key ^ mix64(token_ids[pos] | (pos << 32)))
            for layer in range(layers):
                h = mix64(hp + layer)
                k = (h >> 32) % n_strides
                j = (h % e) * inverses[k] % e
                extend(table(k)[j : j + top_k])
        if sys.byteorder == "big":
            data.byteswap()
        return RoutedExpertsArray(
            data=data.tobytes(), dtype=cfg.dtype, shape=(num_rows, layers, top_k)
        )
