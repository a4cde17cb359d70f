"""The old import paths of what moved to ``rl_client`` (``bridge.driver``,
``bridge.batch``, ``bridge.refit``) keep working for user code, with the driver
extra alone; our own code imports the new homes."""

from __future__ import annotations

import ast
import importlib

import pytest

from harness import ROOT
from harness.env import blocking_env
from tests.bridge.test_bridge_dependency_rule import RL_CLIENT_BANNED, run

SHIMS = {
    "bridge.driver": "rl_client.driver",
    "bridge.batch": "rl_client.batch",
    "bridge.refit": "rl_client.refit",
}
# Where our code lives (the shims themselves excepted).
OUR_CODE = (
    "bridge",
    "rl_client",
    "engine_server",
    "engine_contract",
    "engine_worker",
    "harness",
    "tests",
    "bench",
    "scripts",
    "train_demo",
)


@pytest.mark.parametrize("old,new", sorted(SHIMS.items()))
def test_an_old_path_reexports_the_new_modules_public_objects(old: str, new: str) -> None:
    shim, home = importlib.import_module(old), importlib.import_module(new)
    assert shim.__all__, old
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(home, name), (old, name)


def test_the_old_paths_import_with_the_driver_extra_alone() -> None:
    banned = [p for p in RL_CLIENT_BANNED if p != "bridge"]
    code = "from bridge.driver import RolloutClient\nimport bridge.batch, bridge.refit\nprint('ok')"
    out = run(blocking_env(*banned), "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_our_code_imports_the_new_homes_not_the_old_paths() -> None:
    shim_files = {ROOT / (old.replace(".", "/") + ".py") for old in SHIMS}
    offenders = []
    for package in OUR_CODE:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in shim_files:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                    if node.module == "bridge":
                        names += [f"bridge.{alias.name}" for alias in node.names]
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n in SHIMS]
    assert not offenders, offenders
