"""Test-only launcher: ``python skewed_revision.py -m engine_server|bridge ARGS``
runs the module with engine_contract's revision constants overridden from
``SKEW_CONTRACT_REVISION``, ``SKEW_MINIMUM_CLIENT_REVISION`` and
``SKEW_MINIMUM_SERVER_REVISION``: a real process of another contract revision,
without a second checkout. Both sides read the constants at call time."""

from __future__ import annotations

import os
import runpy
import sys

import engine_contract

NAMES = ("CONTRACT_REVISION", "MINIMUM_CLIENT_REVISION", "MINIMUM_SERVER_REVISION")


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        raise SystemExit("usage: skewed_revision.py -m MODULE [ARGS...]")
    for name in NAMES:
        value = os.environ.get(f"SKEW_{name}")
        if value:
            setattr(engine_contract, name, int(value))
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
