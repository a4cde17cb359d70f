"""``DynamoEngineWorker`` takes ``start_dynamo_endpoint``'s options once, when made:
a misspelt one is refused then, as a keyword it does not know always was, not when
the worker starts."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from engine_server.ray_worker import DynamoEngineWorker


def test_the_endpoint_options_are_kept_as_given() -> None:
    worker = DynamoEngineWorker(
        model_path="/m", served_model_name="policy", worker_idx=1, bridge_args=("--x",)
    )
    assert worker.endpoint_options == {
        "served_model_name": "policy",
        "worker_idx": 1,
        "bridge_args": ("--x",),
    }


def test_a_misspelt_option_is_refused_when_the_worker_is_made() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['namespce'\]"):
        DynamoEngineWorker(model_path="/m", namespce="ns")  # type: ignore[call-arg]
