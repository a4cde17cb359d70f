"""The note of a bridge's etcd leases (launch.leases) without etcd: written whole
and read back, refused when it is not one, and an etcd that does not answer
ending the revocation at its first failure."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from harness.ports import free_port
from launch.leases import Leases, LeasesFile, read, revoke, write


def test_a_note_is_read_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "leases.json"
    leases = Leases(("http://127.0.0.1:2379",), ((1 << 63) - 1, 7))  # 64-bit ids, exact
    write(path, leases)
    assert read(path) == leases
    assert [p.name for p in tmp_path.iterdir()] == ["leases.json"]  # no temporary left


@pytest.mark.parametrize("text", ["", "[]", '{"ids": [1]}', '{"endpoints": [], "ids": ["x"]}'])
def test_what_is_not_a_note_reads_as_none(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "leases.json"
    path.write_text(text)
    assert read(path) is None
    assert "is not a note of leases" in caplog.text
    assert read(tmp_path / "absent.json") is None


def test_an_etcd_that_does_not_answer_ends_the_revocation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="launch.leases")
    started = time.monotonic()
    assert revoke(Leases((f"http://127.0.0.1:{free_port()}",), (1, 2, 3))) == []
    assert time.monotonic() - started < 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "expire with their TTL" in warnings[0].getMessage()


async def test_the_note_is_forgotten_whatever_the_exit(tmp_path: Path) -> None:
    supervisor = LeasesFile(tmp_path)
    write(supervisor.path, Leases((f"http://127.0.0.1:{free_port()}",), (1,)))
    await supervisor.revoke(0)
    assert not supervisor.path.exists()
