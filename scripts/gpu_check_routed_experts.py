"""GPU check: routed experts through VllmBackend on a tiny random Mixtral.

vLLM's CPU build cannot return routed experts (the feature needs Model Runner
V2, which needs Triton with a CPU backend), so this is the real-engine check
for a CUDA machine with the ``vllm`` extra installed. Self-contained: builds
the tiny MoE offline, starts the backend with ``enable_return_routed_experts``,
runs greedy rollouts and checks what comes back:

- EngineInfo reports routed experts;
- the final output carries them, and only the final output;
- shape [prompt + generated - 1, moe_layers (2), top_k (2)], dtype uint8
  (4 experts), ids in range and distinct per row, bytes little-endian;
- informational: agreement with the Hugging Face model's own router top-k on
  the same tokens (random weights make near-ties rare, bf16 may flip a few).

    python -m scripts.gpu_check_routed_experts [--dtype bfloat16] [--keep DIR]

Prints one line per check and PASS or FAIL last; exit status 0 on PASS.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import traceback
from pathlib import Path

LAYERS, TOP_K, EXPERTS = 2, 2, 4


def hf_router_topk(model_dir: Path, token_ids: list[int]) -> list[list[list[int]]]:
    """Per position and layer, the HF Mixtral router's top-k expert ids."""
    import torch
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_router_logits=True)
    per_layer = [logits.topk(TOP_K, dim=-1).indices.tolist() for logits in out.router_logits]
    return [[per_layer[layer][pos] for layer in range(LAYERS)] for pos in range(len(token_ids))]


async def check(model_dir: Path, dtype: str) -> list[str]:
    import numpy as np
    from vllm.engine.arg_utils import AsyncEngineArgs

    from engine_server.backends.base import FinishReason, SamplingSpec
    from engine_server.backends.vllm import VllmBackend

    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    backend = VllmBackend(
        AsyncEngineArgs(
            model=str(model_dir),
            skip_tokenizer_init=True,
            max_model_len=256,
            dtype=dtype,
            kv_cache_memory_bytes=256 << 20,
            enable_prefix_caching=True,
            enable_return_routed_experts=True,
        )
    )
    t0 = time.monotonic()
    info = await backend.start(None)
    print(f"engine ready in {time.monotonic() - t0:.1f} s: {info}", flush=True)
    try:
        expect(info.reports_routed_experts, "EngineInfo.reports_routed_experts")
        prompts = [list(range(3, 20)), [5, 9, 11, 200, 7, 7, 7, 31, 64, 90, 15, 3, 300]]
        for n, prompt in enumerate(prompts):
            gen = 6 + n
            spec = SamplingSpec(
                max_tokens=gen, temperature=0.0, top_k=1, logprobs=0, ignore_eos=True,
                return_routed_experts=True,
            )  # fmt: skip
            outs = [o async for o in backend.generate(f"r3-{n}", prompt, spec)]
            final = outs[-1]
            tokens = [t for o in outs for t in o.token_ids]
            expect(final.finish_reason is FinishReason.LENGTH, f"[{n}] finished by length")
            expect(len(tokens) == gen, f"[{n}] {gen} tokens generated")
            expect(
                all(o.routed_experts is None for o in outs[:-1]), f"[{n}] only the final carries"
            )
            re = final.routed_experts
            expect(re is not None, f"[{n}] routed experts returned")
            if re is None:
                continue
            want = (len(prompt) + gen - 1, LAYERS, TOP_K)
            expect(tuple(re.shape) == want, f"[{n}] shape {tuple(re.shape)} == {want}")
            expect(re.dtype == "uint8", f"[{n}] dtype {re.dtype} == uint8")
            arr = np.frombuffer(re.data, dtype=np.dtype(re.dtype).newbyteorder("<"))
            expect(arr.size == int(np.prod(re.shape)), f"[{n}] byte length matches shape")
            arr = arr.reshape(re.shape)
            expect(bool(((arr >= 0) & (arr < EXPERTS)).all()), f"[{n}] expert ids in range")
            expect(
                all(len(set(row)) == TOP_K for row in arr.reshape(-1, TOP_K).tolist()),
                f"[{n}] top-k ids distinct per row",
            )
            try:
                hf = hf_router_topk(model_dir, (prompt + tokens)[:-1])
                same = sum(
                    set(arr[p, layer].tolist()) == set(hf[p][layer])
                    for p in range(arr.shape[0])
                    for layer in range(LAYERS)
                )
                total = arr.shape[0] * LAYERS
                print(f"info [{n}] agreement with HF router top-k: {same}/{total}", flush=True)
            except Exception as e:  # informational only
                print(f"info [{n}] HF comparison skipped: {e}", flush=True)
    finally:
        await backend.shutdown()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--keep", type=Path, help="build the model here and keep it")
    args = parser.parse_args()
    from harness.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(args.keep or Path(tmp) / "tiny-moe", seed=0, moe=True)
        try:
            failures = asyncio.run(check(model_dir, args.dtype))
        except Exception:
            traceback.print_exc()
            print("FAIL (engine error)", flush=True)
            return 1
    print("PASS" if not failures else f"FAIL ({len(failures)} checks)", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
