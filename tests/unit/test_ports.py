"""The harness's port draws: no two test processes are handed one port."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import ports


def _free_range(size: int) -> range:
    """``size`` consecutive loopback ports free right now, below the harness's ranges."""
    for start in range(5000, 9000, size):
        block = range(start, start + size)
        if all(ports._bindable(port) for port in block):
            return block
    pytest.skip("no free block of loopback ports below 9000")


def test_no_port_is_handed_out_twice_until_its_claim_lapses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = tmp_path / "claims"
    monkeypatch.setattr(ports, "_CLAIMS", claims)
    block = _free_range(3)
    drawn = {ports._draw(block)}
    # Another process (an xdist worker, the low end's run) shares the record.
    code = (
        "from pathlib import Path; from harness import ports; "
        f"ports._CLAIMS = Path({str(claims)!r}); "
        f"print(ports._draw(range({block.start}, {block.stop})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    drawn.add(int(out.stdout))
    drawn.add(ports._draw(block))
    assert drawn == set(block)
    with pytest.raises(OSError, match=f"no free port in \\[{block.start}, {block.stop}\\)"):
        ports._draw(block)
    # A claim older than the window no longer holds its port.
    claims.write_text("".join(f"{port} {time.time() - ports._CLAIM_S - 1}\n" for port in block))
    assert ports._draw(block) in block
