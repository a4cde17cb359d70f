"""The README's file map names every module of every package, so that a newcomer
finds each file's job there: a module added without a row fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine_contract", "engine_server", "bridge", "rl_client", "engine_worker", "launch")
# Generated, never hand-edited: the map names them as a group (`v1/*_pb2*.py`).
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")


def sections() -> dict[str, str]:
    """Each package folder's part of the map: its bold row and the rows under it."""
    text = ROOT.joinpath("README.md").read_text()
    start = text.index("### File map")
    table = text[start : text.index("\n### ", start + 1)]
    parts: dict[str, str] = {}
    current = package = ""
    for line in table.splitlines():
        row = re.match(r"\| (\*\*)?`([\w/]+)/`", line)
        if row:
            bold, folder = row.groups()
            if bold or folder.split("/")[0] in PACKAGES:
                current = package = folder
            else:  # a folder of the package above (`sim/` under backends)
                current = f"{package}/{folder}"
        if current:
            parts[current] = parts.get(current, "") + line + "\n"
    return parts


def test_every_package_module_is_in_the_readme_file_map() -> None:
    parts = sections()
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GENERATED.search(path.name) or "__pycache__" in path.parts:
                continue
            relative = path.relative_to(ROOT)
            # The deepest mapped folder holding it, and its name from there.
            folder = next(
                (str(parent) for parent in relative.parents if str(parent) in parts),
                None,
            )
            if folder is None:
                missing.append(f"{relative} (no section for its package)")
                continue
            inner = str(relative.relative_to(folder))
            names = {inner, path.name}
            section = parts[folder]
            if path.name == "__init__.py":
                continue  # the package's own row says what it is
            if not any(f"`{name}`" in section or f"{name}`" in section for name in names):
                missing.append(str(relative))
    assert not missing, f"modules missing from README's file map: {missing}"
