"""One retry rule: the proto's words, the contract's list and the driver's statuses agree."""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from engine_contract.retry import LIMIT_TRAILER, RETRYABLE_CODES, is_retryable

PROTO = Path(__file__).resolve().parents[2] / "proto" / "engine_contract" / "v1" / "engine.proto"


def proto_status_table() -> dict[str, str]:
    """The header comment's status list: code name -> its description."""
    header = PROTO.read_text().split("syntax =", 1)[0]
    entries: dict[str, str] = {}
    current = None
    for line in header.splitlines():
        match = re.match(r"//\s{3}([A-Z_]+)\s{2,}(.*)", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2)
        elif current is not None and line.startswith("//" + " " * 10):
            entries[current] += " " + line[2:].strip()
    return entries


def test_the_proto_says_of_every_listed_code_whether_it_is_retryable() -> None:
    table = proto_status_table()
    assert len(table) >= 10, table
    for name, text in table.items():
        code = grpc.StatusCode[name]
        says_retryable = "Retryable" in text and "Not retryable" not in text
        says_not = "Not retryable" in text
        assert says_retryable != says_not, f"{name}: say 'Retryable' or 'Not retryable': {text}"
        assert says_retryable == (code in RETRYABLE_CODES), f"{name}: {text}"


def test_every_retryable_code_is_in_the_proto() -> None:
    table = proto_status_table()
    assert {c.name for c in RETRYABLE_CODES} <= set(table)


def test_resource_exhausted_is_retryable_exactly_when_it_names_a_limit() -> None:
    text = proto_status_table()["RESOURCE_EXHAUSTED"]
    assert "Retryable" in text and "Not retryable" in text and LIMIT_TRAILER in text
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert is_retryable(code, limit="max_rollouts_per_stream")
    assert not is_retryable(code)
    assert is_retryable(grpc.StatusCode.UNAVAILABLE)
    assert not is_retryable(grpc.StatusCode.INVALID_ARGUMENT, limit="anything")
