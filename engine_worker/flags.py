"""Which flags one side's parser knows, and how many values each takes.

Run in a child process by the launcher, so that the launcher itself imports
neither side (the engine server's parser imports vLLM, the bridge's Dynamo):

    python -m engine_worker.flags engine BACKEND   # engine_server.cli.build_parser(BACKEND)
    python -m engine_worker.flags bridge           # bridge.config.build_parser()

prints one JSON object, option string -> arity: ``0`` (a switch), an integer
count of values, or argparse's ``"?"``, ``"*"``, ``"+"``. The parser is the
program's own, built the way the program builds it, so the listing can never
drift from what the program accepts.

With ``--serve`` after the engine side's BACKEND, the child then reads one line
of JSON from stdin, the arguments ``python -m engine_server`` would be given,
and serves them in this process, whose imports (vLLM's, for its parser) are
done already; end of input instead: it exits 0 (``engine_worker.listing``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

Arity = int | str
MARKER = "engine_worker.flags: "
SERVE = "--serve"


def arity(action: argparse.Action) -> Arity:
    """How many values an option takes: 0, a count, or "?", "*", "+"."""
    nargs = action.nargs
    if nargs is None:
        return 1
    if isinstance(nargs, int):
        return nargs
    if nargs in ("?", "*", "+"):
        return nargs
    return "*"  # argparse.REMAINDER and friends: everything up to the next option


def describe(parser: argparse.ArgumentParser) -> dict[str, Arity]:
    """Every option string of ``parser`` with its arity."""
    return {
        option: arity(action)
        for option, action in parser._option_string_actions.items()
        if not isinstance(action, argparse._HelpAction)
    }


def _parser(side: str, backend: str | None) -> argparse.ArgumentParser:
    if side == "engine":
        from engine_server.cli import build_parser as engine_parser

        return engine_parser(backend or "sim")
    if side == "bridge":
        from bridge.config import build_parser as bridge_parser

        return bridge_parser()
    raise SystemExit(f"unknown side {side!r} (engine or bridge)")


def serve_when_told() -> None:
    """The engine server on the arguments read from stdin (none: return)."""
    line = sys.stdin.readline()
    if not line.strip():
        return
    engine_args = json.loads(line)
    if not isinstance(engine_args, list) or not all(isinstance(a, str) for a in engine_args):
        raise SystemExit(f"{SERVE}: expected a JSON list of strings on stdin")
    # stdin as an engine server started by the supervisor has it.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    from engine_server.cli import main as serve

    serve(engine_args)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    serve = args[2:] == [SERVE] and args[0] == "engine"
    if serve:
        args = args[:2]
    if not args or len(args) > 2:
        raise SystemExit(f"usage: python -m engine_worker.flags engine BACKEND [{SERVE}] | bridge")
    side, backend = args[0], (args[1] if len(args) > 1 else None)
    listing = describe(_parser(side, backend))
    # Marked: an import may print to stdout too (vLLM does).
    sys.stdout.write(MARKER + json.dumps(listing, sort_keys=True) + "\n")
    if serve:
        sys.stdout.flush()
        serve_when_told()


if __name__ == "__main__":
    main()
