"""vLLM's own series on the worker's system port, where NeMo RL reads them.

dynamo.vllm publishes vLLM's registry in its worker's ``{system_url}/metrics``,
and NeMo RL's ``DynamoMetricsSampler`` reads ``vllm:*`` series there. One real
vLLM engine server (CPU build here, the tiny model) behind a bridge and a
frontend, a couple of rollouts, then one scrape of the bridge's system port read
as that sampler's ``parse_prometheus_metrics`` reads it
(``harness.nemo_rl.sampler_metrics``) and as Prometheus parses it.
"""

from __future__ import annotations

from pathlib import Path

from harness.engine import tiny_vllm_args
from harness.metrics import Samples, scrape
from harness.nemo_rl import sampler_metrics
from harness.ports import free_system_port
from harness.procs import ProcessGroup
from harness.stack import Stack
from harness.waits import wait_until
from rl_client import driver
from tests.e2e.e2e_stack import VLLM_STACK_MARKS

pytestmark = VLLM_STACK_MARKS

MODEL = "tiny-vllm"
PROMPTS = [[5, 6, 7, 8 + i] for i in range(2)]


async def test_vllm_series_on_the_system_port_as_nemo_rl_reads_them(
    tmp_path: Path, model_dir: Path
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL)
        _, address = stack.start_engine("engine", *tiny_vllm_args(), backend="vllm", timeout=300)
        port = free_system_port()
        stack.start_bridge("bridge", address, DYN_SYSTEM_PORT=str(port))
        stack.start_frontend()
        stack.wait_models([MODEL], timeout=300)
        system_url = f"http://127.0.0.1:{port}"
        async with driver.RolloutClient(stack.base_url, MODEL, timeout_s=120) as client:
            results = [await client.rollout(p, max_tokens=6) for p in PROMPTS]
        generated = sum(len(r.token_ids) for r in results)

        def settled() -> Samples | None:
            # vLLM records a step's stats as it hands its outputs over.
            samples = scrape(f"{system_url}/metrics")
            ok = samples.value("vllm:generation_tokens_total") == generated
            return samples if ok else None

        found = wait_until(settled, 20, "vLLM's counters on the system port")
    assert found is not None
    samples = found

    # What NeMo RL's sampler keeps of the vLLM series, under its names.
    seen = sampler_metrics(samples.text)
    assert seen["vllm_generation_tokens_total"] == generated > 0
    assert seen["vllm_prompt_tokens_total"] == sum(len(p) for p in PROMPTS)
    assert seen["vllm_num_requests_running"] == 0
    assert seen["vllm_num_requests_waiting"] == 0
    assert 0 <= seen["vllm_kv_cache_usage_perc"] <= 1
    assert seen["vllm_inter_token_latency_seconds_count"] == generated - len(PROMPTS)
    # Labelled as dynamo.vllm labels them: the worker's labels (those of the
    # bridge's own series), the model by its served name, the engine's own
    # labels winning (model_name, engine).
    [usage] = samples.labels("vllm:kv_cache_usage_perc")
    [bridge] = samples.labels("bridge_engine_server_info")
    worker = {k: v for k, v in bridge.items() if k.startswith("dynamo_") or k == "worker_id"}
    assert worker["dynamo_namespace"] == stack.namespace
    assert {"dynamo_component", "dynamo_endpoint"} <= worker.keys()
    assert usage.items() >= worker.items()
    assert usage["model_name"] == usage["model"] == MODEL and usage["engine"] == "0"
    # Dynamo's own series are still there, next to vLLM's.
    assert any(name.startswith("dynamo_component_") for name in samples.names())
