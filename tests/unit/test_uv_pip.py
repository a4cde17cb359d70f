"""scripts/uv_pip.py: the Makefile's uv installs get the settings pip would install with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts.uv_pip import main, pip_settings, uv_flags

# `pip config list` as these machines print it: a variable and two files' [global].
LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/elsewhere'
global.timeout='60'
"""


def test_the_variable_wins_over_the_file_and_lists_split_on_white_space() -> None:
    assert pip_settings(LISTING) == {
        "find-links": ["/opt/wheels"],
        "extra-index-url": ["file:///opt/pypi/simple", "file:///opt/pypi-more/simple"],
        "constraint": ["/etc/xdg/pip/constraints.txt"],
    }
    assert pip_settings("install.index-url='https://a/simple'\nglobal.index-url='https://b'") == {
        "index-url": ["https://a/simple"]
    }
    assert pip_settings("") == {}


def test_each_setting_becomes_uvs_flag_searching_every_index_as_pip_does() -> None:
    assert uv_flags(pip_settings(LISTING), {}) == [
        "--find-links",
        "/opt/wheels",
        "--index",
        "file:///opt/pypi/simple",
        "--index",
        "file:///opt/pypi-more/simple",
        "--index-strategy",
        "unsafe-best-match",
        "--constraints",
        "/etc/xdg/pip/constraints.txt",
    ]


def test_uvs_own_variables_win() -> None:
    env = {"UV_FIND_LINKS": "/mine", "UV_INDEX": "https://mine", "UV_CONSTRAINT": "c.txt"}
    assert uv_flags(pip_settings(LISTING), env) == []
    assert uv_flags({"index-url": ["https://a"]}, {"UV_INDEX_URL": "https://b"}) == []
    assert uv_flags({"extra-index-url": ["https://a"]}, {"UV_INDEX_STRATEGY": "first-index"}) == [
        "--index",
        "https://a",
    ]


def test_the_flags_go_to_install_only(tmp_path: Path) -> None:
    # A stand-in for uv that prints the arguments it was given.
    uv = tmp_path / "uv"
    uv.write_text(f"#!{sys.executable}\nimport sys; print(sys.argv[1:])\n")
    uv.chmod(0o755)
    done = subprocess.run(
        [sys.executable, "-m", "scripts.uv_pip", str(uv), "uninstall", "-q", "torchvision"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert done.stdout.strip() == "['pip', 'uninstall', '-q', 'torchvision']"
    assert main([]) == 2
