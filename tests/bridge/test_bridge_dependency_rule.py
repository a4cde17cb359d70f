"""The dependency rule, checked at runtime and in the source: the bridge runs
where vllm and torch cannot be imported; the engine server where dynamo and
bridge cannot; the RL side's clients (rl_client) and what both processes and
the launcher share (launch) where none of dynamo, vllm, torch, bridge and
engine_server can; and no file of any imports them, even lazily."""

from __future__ import annotations

import ast
import subprocess
import sys

from harness import ROOT
from harness.env import blocking_env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_blocker_blocks() -> None:
    out = run(blocking_env("vllm", "torch"), "-c", "import torch")
    assert out.returncode != 0 and "blocked" in out.stderr


def test_bridge_imports_and_runs_without_vllm_or_torch() -> None:
    env = blocking_env("vllm", "torch")
    out = run(env, "-c", "import bridge.engine, bridge.__main__; print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    out = run(env, "-m", "bridge", "--help")
    assert out.returncode == 0, out.stderr
    assert "--engine" in out.stdout and "--discovery-backend" in out.stdout


def test_engine_server_imports_no_dynamo_or_bridge() -> None:
    env = blocking_env("dynamo", "bridge")
    code = (
        "import engine_server.server, engine_server.cli, engine_server.servicer, "
        "engine_server.backends.sim; print('ok')"
    )
    out = run(env, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    out = run(env, "-m", "engine_server", "--backend", "sim", "--help")
    assert out.returncode == 0, out.stderr


# What the driver and the trainer run with (the `driver` extra): none of these.
RL_CLIENT_BANNED = ("dynamo", "vllm", "torch", "bridge", "engine_server")


def _modules(package: str) -> list[str]:
    """Every module of ``package``, dotted, the package itself first."""
    names = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names, key=lambda name: (name != package, name))


def _assert_imports_without(modules: list[str], *banned: str) -> None:
    """Every one of ``modules`` imports in a fresh interpreter in which ``banned``
    cannot be imported: none of them needs those, not even through another module."""
    code = f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\nprint('ok')"
    out = run(blocking_env(*banned), "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_rl_client_module_imports_without_dynamo_vllm_torch_bridge_or_engine_server() -> None:
    modules = _modules("rl_client")
    assert "rl_client.driver" in modules and "rl_client.refit" in modules, modules
    _assert_imports_without(modules, *RL_CLIENT_BANNED)


def test_every_launch_module_imports_without_either_side() -> None:
    modules = _modules("launch")
    assert "launch.supervisor" in modules and "launch.config_flags" in modules, modules
    _assert_imports_without(modules, *RL_CLIENT_BANNED)


def _imported_roots(package: str) -> dict[str, set[str]]:
    """Every top-level module each file of ``package`` imports, at any depth of the
    code (a lazy import inside a function counts: the runtime checks above only
    see what importing runs)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        roots: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = roots
    return found


def test_no_file_of_either_side_imports_the_other_sides_dependencies() -> None:
    rules = {
        "bridge": {"vllm", "torch"},
        "engine_server": {"dynamo", "bridge"},
        "rl_client": set(RL_CLIENT_BANNED),
        "launch": {*RL_CLIENT_BANNED, "engine_worker"},
    }
    for package, banned in rules.items():
        found = _imported_roots(package)
        assert found, package
        offenders = {path: roots & banned for path, roots in found.items() if roots & banned}
        assert not offenders, offenders
