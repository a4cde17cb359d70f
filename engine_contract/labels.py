"""What a weight-version label may hold: one rule for both sides of the contract.

A label travels with every rollout's ``weight_versions``, into log lines, into
a Prometheus label value and into the RL routes' JSON answers. So it must be
printable text: no control characters (a NUL ends a C string in an exporter, a
newline forges a log line), no format characters (bidi overrides make a label
read as another), no line or paragraph separators and no lone surrogates. The
engine server refuses such a label on every RPC that sets one; the bridge
refuses it on every RL route before it reaches the engine server.
"""

from __future__ import annotations

import unicodedata

MAX_LABEL_LENGTH = 256
# Unicode categories refused: Cc (controls, NUL and newline among them), Cf
# (format: bidi controls, zero-width joiners), Cs (surrogates), Zl and Zp
# (line and paragraph separators).
_REFUSED = {
    "Cc": "control",
    "Cf": "format",
    "Cs": "surrogate",
    "Zl": "line separator",
    "Zp": "paragraph separator",
}


def label_problem(label: str) -> str | None:
    """Why ``label`` cannot be a weight-version label, or None when it can."""
    if not label.strip():
        return "must not be empty"
    if len(label) > MAX_LABEL_LENGTH:
        return f"{len(label)} characters, more than the limit of {MAX_LABEL_LENGTH}"
    for index, char in enumerate(label):
        kind = _REFUSED.get(unicodedata.category(char))
        if kind is not None:
            return (
                f"holds the {kind} character U+{ord(char):04X} at index {index}: a label "
                "must be printable text"
            )
    return None
