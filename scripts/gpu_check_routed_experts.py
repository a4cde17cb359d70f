"""GPU check: our engine server's routed experts against vLLM's own, on a tiny Mixtral.

The stock CPU build of vLLM cannot capture routed experts (Model Runner V2 only,
which needs Triton: docs/nemo-rl.md says where it stops), so this is the real
check for a CUDA machine with the ``vllm`` extra. Self-contained: builds the
tiny random MoE offline, asks vLLM itself (``AsyncLLM``, the same engine flags)
for greedy completions of a few prompts, shuts it down, starts
``python -m engine_server --backend vllm`` with those flags, asks it for the same
rollouts over gRPC, and compares tokens and the routed experts' dtype, shape and
bytes (rows: prompt + generated - 1; layers 2; top-k 2; uint8 for 4 experts).

    python -m scripts.gpu_check_routed_experts [--dtype float32] [--keep DIR]
    python -m scripts.gpu_check_routed_experts --direct-json OUT   # vLLM's side only

Prints one line per check and PASS or FAIL last; exit status 0 on PASS. The CPU
test (tests/vllm_engine/test_vllm_routed_experts.py) uses ``--direct-json`` as its
reference, under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

EOS = 1
LAYERS, TOP_K = 2, 2
# (prompt, max new tokens): distinct, each shorter than a KV block, so that no
# prefix-cache hit makes one run differ from the other.
CASES: list[tuple[list[int], int]] = [
    (list(range(3, 20)), 6),
    ([5, 9, 11, 200, 7, 7, 7, 31, 64, 90, 15, 3, 300], 9),
    ([700, 3, 44, 44, 512, 8], 12),
]


def engine_flags(dtype: str) -> list[str]:
    """vLLM engine flags for both sides (after ``--model DIR``)."""
    return [
        "--dtype",
        dtype,
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--enable-prefix-caching",
        "--enable-return-routed-experts",
        "--skip-tokenizer-init",
    ]


async def vllm_direct(model_dir: Path, dtype: str) -> list[dict[str, Any]]:
    """Each case's greedy tokens and routed experts as vLLM returns them (NeMo RL's
    greedy: temperature 0, top-k 1, EOS a stop token)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_server.vllm_processes import before_engine_start

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    namespace = parser.parse_args(["--model", str(model_dir), *engine_flags(dtype)])
    before_engine_start()  # vLLM's socket files go with this process
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(namespace))
    results: list[dict[str, Any]] = []
    try:
        for n, (prompt, gen) in enumerate(CASES):
            params = SamplingParams(
                max_tokens=gen, temperature=0.0, top_k=1, stop_token_ids=[EOS], logprobs=0
            )
            final = None
            async for out in engine.generate(
                TokensPrompt(prompt_token_ids=prompt), params, f"d{n}"
            ):
                final = out
            assert final is not None
            comp = final.outputs[0]
            routes = comp.routed_experts
            entry: dict[str, Any] = {"tokens": list(comp.token_ids), "routed_experts": None}
            if routes is not None:
                arr = np.ascontiguousarray(routes)
                little = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
                entry["routed_experts"] = {
                    "dtype": arr.dtype.name,
                    "shape": list(arr.shape),
                    "data": base64.b64encode(little).decode("ascii"),
                }
            results.append(entry)
    finally:
        engine.shutdown()
    return results


def engine_server_rollouts(
    model_dir: Path, dtype: str, log_dir: Path, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The same cases as rollouts of our engine server, in vLLM's form."""
    import grpc

    from engine_contract.v1 import engine_pb2 as pb
    from engine_contract.v1 import engine_pb2_grpc as pb_grpc
    from harness.engine import wait_serving
    from harness.procs import ProcessGroup

    results: list[dict[str, Any]] = []
    with ProcessGroup(log_dir) as group:
        proc, address = group.engine_server(
            "engine-r3",
            "--model",
            str(model_dir),
            *engine_flags(dtype),
            backend="vllm",
            env=env,
            timeout=600,
        )
        wait_serving(address, 600, [proc])
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            for n, (prompt, gen) in enumerate(CASES):
                request = pb.RolloutRequest(
                    request_id=f"es{n}", prompt_token_ids=prompt, greedy=True, max_new_tokens=gen
                )
                answer = stub.Rollout(request, timeout=600)
                entry: dict[str, Any] = {"tokens": list(answer.token_ids), "routed_experts": None}
                if answer.HasField("routed_experts"):
                    re = answer.routed_experts
                    dtype = pb.TensorDtype.Name(re.dtype).removeprefix("TENSOR_DTYPE_").lower()
                    entry["routed_experts"] = {
                        "dtype": dtype,
                        "shape": list(re.shape),
                        "data": base64.b64encode(re.data).decode("ascii"),
                    }
                results.append(entry)
    return results


def compare(direct: list[dict[str, Any]], served: list[dict[str, Any]]) -> list[str]:
    """Every check, printed; the failed ones returned."""
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    for n, ((prompt, _), d, s) in enumerate(zip(CASES, direct, served, strict=True)):
        expect(d["tokens"] == s["tokens"], f"[{n}] same greedy tokens ({len(s['tokens'])})")
        dre, sre = d["routed_experts"], s["routed_experts"]
        expect(dre is not None, f"[{n}] vLLM returned routed experts")
        expect(sre is not None, f"[{n}] the engine server's rollout carries routed experts")
        if dre is None or sre is None:
            continue
        rows = len(prompt) + len(d["tokens"]) - 1
        expect(dre["shape"] == [rows, LAYERS, TOP_K], f"[{n}] vLLM shape {dre['shape']}")
        expect(sre["dtype"] == dre["dtype"], f"[{n}] dtype {sre['dtype']} == {dre['dtype']}")
        expect(sre["shape"] == dre["shape"], f"[{n}] shape {sre['shape']} == {dre['shape']}")
        expect(sre["data"] == dre["data"], f"[{n}] the same expert ids, byte for byte")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--keep", type=Path, help="build the model here and keep it")
    parser.add_argument("--direct-json", type=Path, help="only run vLLM directly; write here")
    args = parser.parse_args()
    from engine_server.backends.vllm._env import apply_env_defaults
    from harness.tiny_model import build_tiny_model

    apply_env_defaults()  # the engine server's own (CPU build only), before torch loads

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(args.keep or Path(tmp) / "tiny-moe", seed=0, moe=True)
        try:
            started = time.monotonic()
            direct = asyncio.run(vllm_direct(model_dir, args.dtype))
            print(f"vLLM direct: {time.monotonic() - started:.1f} s", flush=True)
            if args.direct_json is not None:
                args.direct_json.write_text(json.dumps(direct))
                return 0
            started = time.monotonic()
            served = engine_server_rollouts(model_dir, args.dtype, Path(tmp) / "logs")
            print(f"engine server: {time.monotonic() - started:.1f} s", flush=True)
        except Exception:
            traceback.print_exc()
            print("FAIL (engine error)", flush=True)
            return 1
        failures = compare(direct, served)
    print("PASS" if not failures else f"FAIL ({len(failures)} checks)", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
