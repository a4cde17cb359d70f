"""An aiperf ``inputs_json`` dataset of rollout bodies, for ``aiperf profile
--custom-dataset-type inputs_json``: token-id prompts with the rollout
annotation, sent verbatim to ``/v1/completions`` (aiperf's ``raw_payload``
would want chat ``messages``; ``inputs_json`` sends any body as is).

    python -m scripts.aiperf_inputs --model mymodel --model-dir DIR --out rollouts.json

Each rollout asks for its text too (``rollout:{"text": true}``): aiperf counts
an answer without text as failed. Prompts are random token ids of the model's
vocabulary (deterministic per ``--seed``), never its special tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from rl_client import driver


def special_ids(model_dir: Path) -> set[int]:
    """Ids a prompt should not hold: the tokenizer's added (special) tokens."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    return {int(t["id"]) for t in tokenizer.get("added_tokens", [])}


def payloads(
    model: str,
    vocab: int,
    banned: set[int],
    *,
    count: int,
    prompt_tokens: int,
    max_tokens: int,
    greedy: bool,
    stream: bool,
    seed: int,
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt: list[int] = []
        while len(prompt) < prompt_tokens:
            token = rng.randrange(vocab)
            if token not in banned:
                prompt.append(token)
        body = driver.build_rollout_body(
            model, prompt, greedy=greedy, max_tokens=max_tokens, text=True
        )
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        out.append(body)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--model-dir", type=Path, required=True, help="the model folder")
    parser.add_argument("--out", type=Path, required=True, help="the inputs_json file to write")
    parser.add_argument("--count", type=int, default=512, help="rollouts (default 512)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--greedy", action="store_true", help="greedy (default: sampled)")
    parser.add_argument("--stream", action="store_true", help="streamed answers (SSE)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = json.loads((args.model_dir / "config.json").read_text())
    bodies = payloads(
        args.model,
        int(config["vocab_size"]),
        special_ids(args.model_dir),
        count=args.count,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        greedy=args.greedy,
        stream=args.stream,
        seed=args.seed,
    )
    sessions = [{"session_id": f"rollout-{i}", "payloads": [b]} for i, b in enumerate(bodies)]
    args.out.write_text(json.dumps({"data": sessions}))
    print(f"wrote {len(bodies)} rollout bodies to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
