"""``make train-demo``: a tiny GRPO run through frontend -> bridge -> vLLM engine servers.

    python -m train_demo [--steps 25] [--fault-step 10] [--workers 2 | --single]
                         [--lr 2e-2] [--out train-results]

By default the generation workers are a fleet of Ray actors behind the KV
router, one of them killed (``ray.kill``) at the fault step and replaced;
``--single``: one worker as plain processes, its engine server killed and
restarted. A progress bar per step (reward, token_mult_prob_error, step time),
then the reward curve as a PNG and the run as JSON in ``--out``, and a summary.
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
    fault = result.fault
    if fault is not None:
        top.axvline(fault.step, color="grey", linestyle="--", label=f"{fault.killed} killed")
        if fault.joined_during_step and fault.replacement:
            top.axvline(
                fault.joined_during_step,
                color="tab:green",
                linestyle=":",
                label=f"{fault.replacement} caught up ({fault.caught_up_to!r})",
            )
        top.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train_demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument(
        "--fault-step",
        type=int,
        default=10,
        help="kill a worker holding this step's rollouts (0: never)",
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="generation workers in Ray actors (KV router)"
    )
    parser.add_argument(
        "--rejoin-within",
        type=int,
        default=3,
        help="steps after the fault by which the killed worker's replacement serves",
    )
    parser.add_argument(
        "--single",
        action="store_true",
        help="one worker as plain processes (engine server, bridge), no Ray",
    )
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "train-results")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    # The driver logs each retry; while the killed engine restarts, that is dozens.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rl_client.driver").setLevel(logging.ERROR)

    if not args.single and args.workers < (2 if args.fault_step else 1):
        parser.error("--workers: at least 2 with a fault step (a survivor), else at least 1")
    config = RunConfig(
        steps=args.steps,
        learning_rate=args.lr,
        seed=args.seed,
        fault_step=args.fault_step,
        workers=0 if args.single else args.workers,
        rejoin_within=args.rejoin_within,
    )
    bar = tqdm(total=args.steps, unit="step", desc="GRPO")

    def on_step(stats: StepStats) -> None:
        bar.set_postfix(
            reward=f"{stats.reward:.3f}",
            err=f"{stats.error:.5f}",
            gen=f"{stats.generation_s:.1f}s",
            refit=f"{stats.refit_s * 1000:.0f}ms",
            workers=stats.refit_workers,
        )
        bar.update(1)

    root = Path(tempfile.mkdtemp(prefix="train-demo-"))
    try:
        what = (
            "vLLM engine server, bridge"
            if args.single
            else f"a Ray cluster, {args.workers} vLLM workers in Ray actors"
        )
        bar.write(f"starting the stack ({what}, Dynamo frontend)...")
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
