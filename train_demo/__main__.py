"""``make train-demo``: a tiny GRPO run through frontend -> bridge -> vLLM engine server.

    python -m train_demo [--steps 25] [--fault-step 10] [--lr 2e-2] [--out train-results]

A progress bar per step (reward, token_mult_prob_error, step time), then the
reward curve as a PNG and the run as JSON in ``--out``, and a one-line summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from harness import ROOT
from harness.tiny_model import tiny_model_dir
from train_demo.loop import RunConfig, RunResult, StepStats, run


def plot(result: RunResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in result.steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [s.reward for s in result.steps], marker="o")
    top.set_ylabel("mean reward")
    top.set_title("GRPO through Dynamo: reward per step")
    bottom.plot(steps, [s.error for s in result.steps], marker=".", color="tab:red")
    bottom.set_ylabel("token_mult_prob_error")
    bottom.set_xlabel("step")
    for s in result.steps:
        if s.step > 1 and s.engine_restarts > result.steps[s.step - 2].engine_restarts:
            top.axvline(s.step, color="grey", linestyle="--", label="engine killed")
            top.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train_demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--fault-step", type=int, default=10, help="kill -9 the engine (0: never)")
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "train-results")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    # The driver logs each retry; while the killed engine restarts, that is dozens.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rl_client.driver").setLevel(logging.ERROR)

    config = RunConfig(
        steps=args.steps, learning_rate=args.lr, seed=args.seed, fault_step=args.fault_step
    )
    bar = tqdm(total=args.steps, unit="step", desc="GRPO")

    def on_step(stats: StepStats) -> None:
        bar.set_postfix(
            reward=f"{stats.reward:.3f}",
            err=f"{stats.error:.5f}",
            gen=f"{stats.generation_s:.1f}s",
            refit=f"{stats.refit_s * 1000:.0f}ms",
        )
        bar.update(1)

    root = Path(tempfile.mkdtemp(prefix="train-demo-"))
    try:
        bar.write("starting the stack (vLLM engine server, bridge, Dynamo frontend)...")
        result = asyncio.run(run(config, root, tiny_model_dir(), on_step))
    finally:
        bar.close()
        shutil.rmtree(root, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.json").write_text(json.dumps(result.as_json(), indent=1))
    plot(result, args.out / "reward.png")
    print(result.summary())
    print(f"written to {args.out / 'reward.png'} and {args.out / 'train.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
