"""Build a tiny random-weight Llama (or Mixtral with ``--moe``) model folder, offline.

    python -m scripts.build_tiny_model --out DIR [--seed N] [--moe] [--no-chat-template]

The builder is ``harness.tiny_model`` (tests and the benchmark call it too);
the same seed gives the same files byte for byte, and a second call with the
same settings returns at once. ``--no-chat-template`` leaves the chat template
out, as in most RL base checkpoints.
"""

from __future__ import annotations

import argparse
import sys

from harness.tiny_model import build_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="model folder to create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true", help="tiny Mixtral instead of Llama")
    parser.add_argument(
        "--no-chat-template", action="store_true", help="no chat template (a base checkpoint)"
    )
    args = parser.parse_args(argv)
    print(
        build_tiny_model(
            args.out, seed=args.seed, moe=args.moe, chat_template=not args.no_chat_template
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
