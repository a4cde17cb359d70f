"""Port draws (``bridge.admin.port_claims``): no two processes on a host are handed
one port before it is bound, the bridges' internal ports and the harness's alike."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge.admin import port_claims


def _free_range(size: int) -> range:
    """``size`` consecutive loopback ports free right now, below every drawn range."""
    for start in range(5000, 9000, size):
        block = range(start, start + size)
        if all(port_claims.bindable(port) for port in block):
            return block
    pytest.skip("no free block of loopback ports below 9000")


def test_no_port_is_handed_out_twice_until_its_claim_lapses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = tmp_path / "claims"
    monkeypatch.setattr(port_claims, "CLAIMS", claims)
    block = _free_range(3)
    drawn = {port_claims.draw(block)}
    # Another process (another bridge, an xdist worker) shares the record.
    code = (
        "from pathlib import Path; from bridge.admin import port_claims; "
        f"port_claims.CLAIMS = Path({str(claims)!r}); "
        f"print(port_claims.draw(range({block.start}, {block.stop})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    drawn.add(int(out.stdout))
    drawn.add(port_claims.draw(block))
    assert drawn == set(block)
    with pytest.raises(OSError, match=f"no free port in \\[{block.start}, {block.stop}\\)"):
        port_claims.draw(block)
    # A claim older than the window, or dated ahead, or unreadable, holds nothing.
    stale = time.time() - port_claims.CLAIM_S - 1
    claims.write_bytes(
        f"{block[0]} {stale}\n{block[1]} {time.time() + 3600}\n{block[2]} nan\n\xff\n".encode()
        + b"\xff\xfe\n"
    )
    assert {port_claims.draw(block) for _ in block} == set(block)


def test_an_unusable_claims_file_still_draws_a_free_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(port_claims, "CLAIMS", tmp_path)  # a folder: cannot be opened
    block = _free_range(2)
    assert port_claims.draw(block) in block
