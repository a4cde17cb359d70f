"""The simulated engine's "weights": a checkpoint whose bytes decide its outputs.

The sim has no network to load tensors into, but an RL test must tell old
weights from new ones. So the sim keeps, per tensor, the name, dtype, shape and
a digest of the bytes; the digests together make a fingerprint, and the
sampler's key follows the fingerprint: new weights give new (deterministic)
tokens and logprobs, and loading the original checkpoint back gives the
original outputs again. The schema (names, dtypes, shapes) is the model's:
updates are checked against it exactly as a real engine would refuse tensors
that do not fit. Initial weights: the model folder's ``*.safetensors`` when
there is one, else a one-tensor synthetic checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

from engine_server.backends.checkpoint import check_update, checkpoint_files, read_safetensors
from engine_server.backends.refit import (
    OffLoop,
    TensorSpec,
    WeightLoad,
    WeightUpdateError,
    WeightWriter,
)

SYNTHETIC = "sim.seed"


class SimWeights:
    def __init__(
        self, specs: dict[str, TensorSpec], digests: dict[str, bytes], *, synthetic: bool
    ) -> None:
        self.specs = specs
        self.digests = digests
        # A real checkpoint decides the outputs by its bytes alone, so that the sim
        # refit to checkpoint B answers as a sim started on B; the synthetic one
        # keeps key 0 (the sim's outputs for its seed).
        self._base = self.fingerprint() if synthetic else 0

    @classmethod
    def initial(cls, model_dir: str | None, seed: int) -> SimWeights:
        if model_dir is not None and list(Path(model_dir).glob("*.safetensors")):
            specs, digests = _read_dir(model_dir)
            return cls(specs, digests, synthetic=False)
        spec = TensorSpec(SYNTHETIC, "int64", (1,))
        digest = _digest(seed.to_bytes(8, "little", signed=True))
        return cls({spec.name: spec}, {spec.name: digest}, synthetic=True)

    def fingerprint(self) -> int:
        h = hashlib.blake2b(digest_size=8)
        for name in sorted(self.digests):
            h.update(name.encode() + b"\0" + self.digests[name])
        return int.from_bytes(h.digest(), "little")

    @property
    def key(self) -> int:
        """The sampler's key: the checkpoint's fingerprint (0: the synthetic one)."""
        return self.fingerprint() ^ self._base

    def check(self, specs: Sequence[TensorSpec], *, allow_partial: bool) -> None:
        """Refuse tensors that do not fit the model (nothing is changed)."""
        check_update(self.specs, specs, allow_partial=allow_partial)

    def load_dir(self, path: str, *, allow_partial: bool) -> WeightLoad:
        specs, digests = _read_dir(path)
        self.check(list(specs.values()), allow_partial=allow_partial)
        self.digests.update(digests)
        return WeightLoad(len(specs), sum(s.nbytes for s in specs.values()))

    def writer(
        self,
        specs: Sequence[TensorSpec],
        *,
        allow_partial: bool,
        then: Callable[[], None] = lambda: None,
    ) -> SimWeightWriter:
        """``then``: called once the streamed weights are in place."""
        self.check(specs, allow_partial=allow_partial)
        return SimWeightWriter(self, specs, then)


class SimWeightWriter(WeightWriter):
    """Hashes each tensor's bytes as they stream in; nothing is kept."""

    def __init__(
        self, weights: SimWeights, specs: Sequence[TensorSpec], then: Callable[[], None]
    ) -> None:
        self._weights = weights
        self._then = then
        self._specs = list(specs)
        self._index = 0
        self._left = specs[0].nbytes if specs else 0
        self._hash = _hasher()
        self._digests: dict[str, bytes] = {}
        self._skip_empty()
        self._worker = OffLoop(self._consume)

    def _skip_empty(self) -> None:
        while self._index < len(self._specs) and self._left == 0:
            self._digests[self._specs[self._index].name] = self._hash.digest()
            self._index += 1
            self._hash = _hasher()
            if self._index < len(self._specs):
                self._left = self._specs[self._index].nbytes

    async def write(self, data: memoryview) -> None:
        await self._worker.submit(data)

    def _consume(self, data: memoryview) -> None:
        while data:
            take = min(len(data), self._left)
            self._hash.update(data[:take])
            data, self._left = data[take:], self._left - take
            self._skip_empty()

    async def commit(self) -> WeightLoad:
        await self._worker.close()
        if self._index < len(self._specs):
            raise WeightUpdateError("the tensors' bytes ended short")
        self._weights.digests.update(self._digests)
        self._then()
        return WeightLoad(len(self._specs), sum(s.nbytes for s in self._specs))

    async def discard(self) -> None:
        try:
            await self._worker.close()
        finally:
            self._digests.clear()


def _digest(data: bytes | memoryview) -> bytes:
    hasher = _hasher()
    hasher.update(data)
    return hasher.digest()


def _hasher() -> hashlib._Hash:
    """Per-tensor digests: SHA-1 (not for security; twice blake2b's speed), so that
    reading the bytes, not digesting them, is the sim's cost of a load."""
    return hashlib.sha1(usedforsecurity=False)


def _read_dir(path: str | Path) -> tuple[dict[str, TensorSpec], dict[str, bytes]]:
    specs: dict[str, TensorSpec] = {}
    digests: dict[str, bytes] = {}
    for file in checkpoint_files(path):
        for spec, data in read_safetensors(file):
            specs[spec.name] = spec
            digests[spec.name] = _digest(data)
    return specs, digests
