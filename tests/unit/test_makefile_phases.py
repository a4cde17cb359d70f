"""The Makefile's file lists for ``make test``'s phases name files that exist and
are marked as the phase expects: a renamed file would otherwise leave its phase
silently (``--ignore`` of a missing path is no error), and a `serial` file left
unmarked would run a second time, on two workers, beside other tests."""

from __future__ import annotations

import ast
import re

import pytest

from harness import ROOT


def makefile_list(name: str) -> list[str]:
    """The words of ``NAME := ...`` (backslash continuations joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name} := (.*)$", text, re.MULTILINE)
    assert match, f"{name} is not set in the Makefile"
    return match.group(1).split()


def marked_serial(path: str) -> bool:
    """Whether the module's ``pytestmark`` holds ``pytest.mark.serial``."""
    module = ast.parse((ROOT / path).read_text())
    for node in module.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return any(
                isinstance(n, ast.Attribute) and n.attr == "serial" for n in ast.walk(node.value)
            )
    return False


@pytest.mark.parametrize(
    ("name", "serial"),
    [
        ("PAIRED_SERIAL", True),
        ("ALONE_SERIAL", True),
        ("BESIDE_SERIAL", False),
        ("BESIDE_SOAK", False),
    ],
)
def test_each_phase_lists_existing_files_marked_as_it_runs_them(name: str, serial: bool) -> None:
    files = makefile_list(name)
    assert files
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert not missing, f"{name} names files that do not exist: {missing}"
    wrong = [f for f in files if marked_serial(f) != serial]
    assert not wrong, f"{name}: {'not ' if serial else ''}marked serial: {wrong}"


def test_no_file_is_in_two_phases() -> None:
    lists = {
        name: set(makefile_list(name))
        for name in ("PAIRED_SERIAL", "ALONE_SERIAL", "BESIDE_SERIAL", "BESIDE_SOAK")
    }
    seen: dict[str, str] = {}
    for name, files in lists.items():
        for f in files:
            assert f not in seen, f"{f} is in {seen[f]} and {name}"
            seen[f] = name


def test_the_low_end_runs_the_paired_files() -> None:
    """PAIRED_SERIAL runs beside the low end's own run of the same files (its `-m
    serial` run of LOW_SUITES): a file dropped from LOW_SUITES would run alone."""
    assert set(makefile_list("PAIRED_SERIAL")) <= set(makefile_list("LOW_SUITES"))
