"""``uv pip`` with this machine's pip settings: the Makefile's installs.

uv builds the environments in a fraction of pip's time (the main environment in
11.5 s against 79 s, uv's cache empty; docs/testing.md), but reads none of pip's
configuration, and a machine may keep what the installs need there: these keep
a folder of wheels (``find-links``) holding the ``torch==2.13.0+cpu`` that vLLM's
CPU build pins, extra indexes and a constraints file. So the settings pip would
install with (``pip config list``: its files and ``PIP_*`` variables, the
variables first) are handed to ``uv pip install`` as its own flags, unless uv's
own variable for the same setting is set:

- ``find-links``: ``--find-links``;
- ``index-url``: ``--default-index``;
- ``extra-index-url``: ``--index``, with ``--index-strategy unsafe-best-match``:
  pip takes the best version from every index, uv by default only looks past
  the first index that has a package;
- ``constraint``: ``--constraints``.

Usage: ``python -m scripts.uv_pip UV SUBCOMMAND [ARGS...]`` runs ``UV pip
SUBCOMMAND ARGS...``. The Makefile runs it on uv's own venv (``.tools/uv``), whose
pip's settings it reads, before the project's environments exist: standard library only.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping

# pip's setting: (uv's flag, uv's variable for the same setting).
FLAGS = {
    "find-links": ("--find-links", "UV_FIND_LINKS"),
    "index-url": ("--default-index", "UV_DEFAULT_INDEX"),
    "extra-index-url": ("--index", "UV_INDEX"),
    "constraint": ("--constraints", "UV_CONSTRAINT"),
}
# Where pip reads a setting for `pip install`, the first found winning.
SCOPES = (":env:", "install", "global")


def pip_settings(listing: str) -> dict[str, list[str]]:
    """The settings ``FLAGS`` names, from ``pip config list``'s lines
    (``scope.key='value'``, a list of values separated by white space)."""
    found: dict[tuple[str, str], list[str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if sep and key in FLAGS:
            found[(scope, key)] = shlex.split(value)[0].split() if value.strip() else []
    settings: dict[str, list[str]] = {}
    for key in FLAGS:
        for scope in SCOPES:
            if (scope, key) in found:
                settings[key] = found[(scope, key)]
                break
    return settings


def uv_flags(settings: Mapping[str, list[str]], env: Mapping[str, str]) -> list[str]:
    """``uv pip install``'s flags for pip's ``settings``, but those uv's own
    variables in ``env`` already set."""
    flags: list[str] = []
    for key, values in settings.items():
        flag, variable = FLAGS[key]
        if variable in env or (key == "index-url" and "UV_INDEX_URL" in env):
            continue
        for value in values:
            flags += [flag, value]
        if key == "extra-index-url" and values and "UV_INDEX_STRATEGY" not in env:
            flags += ["--index-strategy", "unsafe-best-match"]
    return flags


def read_pip_config() -> str:
    """``pip config list`` of this Python's pip; empty where it has none."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    uv, subcommand, *rest = argv
    flags = uv_flags(pip_settings(read_pip_config()), os.environ) if subcommand == "install" else []
    command = [uv, "pip", subcommand, *flags, *rest]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
