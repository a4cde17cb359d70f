"""What tests/conftest.py sets for the suite and every process it starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests import conftest


def test_each_environment_keeps_its_own_vllm_cache() -> None:
    # The low end's run (its own interpreter) gets its own folder too: vLLM 0.23 and
    # 0.32 name their model-class cache files alike and would overwrite each other's.
    if conftest.VLLM_CACHE_ROOT_GIVEN:
        pytest.skip("VLLM_CACHE_ROOT is set from outside the suite")
    assert Path(os.environ["VLLM_CACHE_ROOT"]) == Path(sys.prefix) / "vllm-cache"
