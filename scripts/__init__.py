"""Command-line tools of this repository, run as modules from its root:
``python -m scripts.NAME`` (``scripts.run_demo``, ``scripts.soak``, ...).

Run that way, the repository root is the first entry of ``sys.path``, so the
scripts import ``harness`` (not an installed package) as the tests do, and need
no ``sys.path`` edit of their own.
"""
