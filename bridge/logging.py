"""The bridge's own logging, which survives Dynamo's takeover of the root logger.

``Worker.run()`` calls ``configure_dynamo_logging()``: it removes every root
handler, sets the root level from ``DYN_LOG`` and forwards root records to Rust
tracing. The bridge therefore never relies on the root logger: the ``bridge``
logger gets its own stderr handler and level and does not propagate, so its
records and level are untouched by whatever Dynamo (or a host) does to root.
Dynamo's own Python records still go where Dynamo sends them.

``configure_dynamo_logging()`` also writes a logging config for SGLang to a new
file in the temporary folder, which nothing removes: one file per bridge start
(and per restart after a lost lease). The bridge runs no SGLang, so it sets
Dynamo's own switch that skips it (``DYN_SKIP_SGLANG_LOG_FORMATTING``), unless
the user set it.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "bridge"
SKIP_SGLANG_LOGGING_ENV = "DYN_SKIP_SGLANG_LOG_FORMATTING"
_HANDLER_NAME = "bridge-stderr"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_bridge_logging(level: str | int = "INFO") -> logging.Logger:
    """Give the ``bridge`` logger a stderr handler and level of its own (idempotent);
    before Dynamo configures its logging."""
    os.environ.setdefault(SKIP_SGLANG_LOGGING_ENV, "1")
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False
    if not any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    return logger
