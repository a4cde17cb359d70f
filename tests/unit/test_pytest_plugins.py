"""The suite runs with pytest's plugins and its own conftests only: none of the
pytest plugins ai-dynamo's wheel registers for its own test folders (their hooks are
Dynamo's; dynamo.vllm's imports vLLM whenever a ``test_vllm_*`` file is collected)."""

from __future__ import annotations

import importlib.metadata

import pytest


def test_no_plugin_of_dynamos_own_tests_is_loaded(pytestconfig: pytest.Config) -> None:
    try:
        dist = importlib.metadata.distribution("ai-dynamo")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ai-dynamo is not installed")
    registered = [ep for ep in dist.entry_points if ep.group == "pytest11"]
    manager = pytestconfig.pluginmanager
    for ep in registered:
        assert manager.is_blocked(ep.name), f"add -p no:{ep.name} to addopts ({ep.value})"
        assert manager.get_plugin(ep.name) is None, f"{ep.name} ({ep.value}) is loaded"
