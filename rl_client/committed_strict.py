"""The committed-weights record read strictly: whatever the store holds, reading it
answers at once, with the bytes or a ValueError naming what is wrong.

Apart from the record's meaning (``committed``) because this is a defence, not a
format: the store is shared, so what sits at the record's place may be a FIFO, a
folder, a device, a file of gigabytes or hostile JSON (nesting deep enough to
crash the parser, numbers that take seconds to convert). Each is refused before
it can block or crash its reader: a size cap, a regular file opened without
blocking, nesting counted before the parser recurses, numbers checked as parsed.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import math
import os
import re
import stat
from pathlib import Path

# A record is a few hundred bytes (64 KiB names about 2,000 workers): anything larger
# is not one, and is refused before it is read whole.
MAX_RECORD_BYTES = 64 * 1024
# A record nests two deep; a deeper one is refused before the parser recurses.
MAX_NESTING = 16
# Strings (an unclosed one runs to the end: one pass, never a rescan) and brackets.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"?|[][{}]', re.DOTALL)
# The longest base64 text of a record within the cap.
_MAX_BASE64 = 4 * -(-MAX_RECORD_BYTES // 3)
_DEPTH = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class _OutOfRange(ValueError):
    """A number no record holds (told apart from JSON that does not parse)."""


def brief(value: object) -> str:
    """``value`` for an error message: a hostile record is not repeated whole."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge int"
    return text if len(text) <= 60 else f"{text[:57]}..."


def check_size(size: int) -> None:
    if size > MAX_RECORD_BYTES:
        raise ValueError(
            f"the committed-weights record is {size} bytes, more than the cap of "
            f"{MAX_RECORD_BYTES}: it is not one"
        )


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise _OutOfRange(f"the number {text[:40]} is out of range")
    return number


def _small_int(text: str) -> int:
    if len(text.lstrip("-")) > 30:  # no field holds more; int() of 4,300+ digits raises
        raise _OutOfRange(f"an integer of {len(text)} digits is out of range")
    return int(text)


def _no_constant(name: str) -> float:
    raise _OutOfRange(f"{name} is not a number a record holds")


def parse(raw: bytes) -> object:
    """``raw`` as JSON, checked before the parser sees it (size, nesting: it recurses)
    and as it goes (no NaN, infinity or huge numbers); ValueError otherwise."""
    check_size(len(raw))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the committed-weights record is not UTF-8: {e}") from e
    steps = (_DEPTH.get(token[0], 0) for token in _TOKENS.findall(raw))
    depth = max(itertools.accumulate(steps), default=0)
    if depth > MAX_NESTING:
        raise ValueError(
            f"the committed-weights record is nested {depth} deep, more than {MAX_NESTING}"
        )
    try:
        return json.loads(
            text, parse_float=_finite, parse_int=_small_int, parse_constant=_no_constant
        )
    except _OutOfRange as e:
        raise ValueError(f"the committed-weights record holds {e}") from None
    except RecursionError:  # unreachable past the nesting check; kept a ValueError
        raise ValueError("the committed-weights record is nested too deep") from None
    except ValueError as e:
        raise ValueError(f"the committed-weights record is not JSON: {e}") from None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"a file of mode {stat.filemode(mode)}"


def read_capped(path: Path) -> bytes | None:
    """The file at ``path`` (None: none there), at most one byte over the cap. Only
    a regular file: a FIFO would block the reader (its thread, and so its process's
    exit) and a device may never end. Checked on the path, so no device is opened,
    and on the opened descriptor, so nothing swapped in between is read."""
    try:
        before = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"the committed-weights record {path} cannot be read: {e}") from e
    if not stat.S_ISREG(before.st_mode):
        raise ValueError(
            f"the committed-weights record {path} is {_kind(before.st_mode)}, not a file"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"the committed-weights record {path} cannot be read: {e}") from e
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise ValueError(
                f"the committed-weights record {path} is {_kind(opened.st_mode)}, not a file"
            )
        check_size(opened.st_size)
        chunks: list[bytes] = []
        left = MAX_RECORD_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise ValueError(f"the committed-weights record {path} cannot be read: {e}") from e
    finally:
        os.close(fd)


def decode_base64(value: str, where: str) -> bytes:
    """A record stored as base64 text (etcd's JSON gateway), refused by its length
    before it is decoded."""
    if len(value) > _MAX_BASE64:
        raise ValueError(
            f"the committed-weights record in {where} is about {len(value) * 3 // 4} bytes, "
            f"more than the cap of {MAX_RECORD_BYTES}: it is not one"
        )
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as e:
        raise ValueError(f"the committed-weights record in {where} is not base64: {e}") from e
