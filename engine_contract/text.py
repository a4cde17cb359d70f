"""A client's text in the contract: what a string field can carry, and how a
message may quote it. One rule for both sides (the engine server imports no
Dynamo, the bridge no vLLM or torch; both import this).
"""

from __future__ import annotations


def clip(value: object, most: int = 80) -> str:
    """A client's value as a message may quote it: repr, cut to ``most`` characters.
    Messages travel in bounded headers and trailers; never echo input whole."""
    text = repr(value)
    return text if len(text) <= most else f"{text[: most - 12]}... ({len(text)} chars)"


def text_problem(field: str, value: str) -> str | None:
    """Why ``value`` cannot travel as protobuf text (UTF-8), naming ``field``, or None
    when it can: a lone surrogate has no UTF-8 form."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"{field} is not valid text: {e.reason} at position {e.start} (a lone surrogate "
            "such as \\ud800 has no UTF-8 form)"
        )
    return None
