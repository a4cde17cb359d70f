"""Test-only launcher: ``python host_root.py -m MODULE ARGS`` runs the module from
the folder ``FLEET_HOST_ROOT`` names. A path under ``/proc/self/cwd/`` then
resolves in each process's own folder: every engine server reads "the same
path" on a host of its own, as workers on different machines do, so one of them
can find its copy of a checkpoint unreadable."""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        raise SystemExit("usage: host_root.py -m MODULE [ARGS...]")
    os.chdir(os.environ["FLEET_HOST_ROOT"])
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
