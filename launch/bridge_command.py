"""The bridge's command line as a supervisor writes it: from ``BridgeLaunch``,
the settings a supervisor gives the bridge, each field its flag.

``BridgeLaunch`` is the base of ``bridge.config.BridgeConfig``, so these flags
are defined once, here, where a supervisor that may not import the bridge
(``engine_server.host``: the engine server never imports Dynamo or the bridge;
``engine_worker``: neither side) can write them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from launch.config_flags import external, flag, to_argv


@dataclass(frozen=True)
class BridgeLaunch:
    # Fields with flag(...) metadata are the bridge's flags (bridge.config), each
    # with its environment variable (BRIDGE_ and the flag: BRIDGE_MODEL_PATH).
    engine_address: str = field(
        metadata=flag(
            "Engine server address, HOST:PORT or unix:PATH.",
            name="--engine",
            env="BRIDGE_ENGINE_ADDRESS",
        )
    )
    model_path: str = field(
        metadata=flag(
            "Local model directory the frontend reads the tokenizer and config "
            "from (config.json, tokenizer.json, tokenizer_config.json)."
        )
    )
    served_model_name: str | None = field(
        default=None,
        metadata=flag("Name to serve the model under (default: the engine server's model name)."),
    )
    # Dynamo's own flag (its runtime group); None: Dynamo's default, or DYN_NAMESPACE.
    namespace: str | None = field(default=None, metadata=external("--namespace"))
    # Set by a host that supervises the bridge, where a vanished engine server
    # means a vanished host.
    exit_after_engine_gone_s: float | None = field(
        default=None,
        metadata=flag(
            "Exit, leaving discovery, once the engine server has been unreachable "
            "for this many seconds (0: never, the default; a standalone bridge waits for "
            "its engine server to come back). engine_server.host sets it for the bridges "
            "it supervises.",
            off=True,
        ),
    )

    def __post_init__(self) -> None:
        if not self.engine_address:
            raise ValueError("an engine server address is required (--engine HOST:PORT)")
        value = self.exit_after_engine_gone_s
        if value is not None and not value > 0:
            raise ValueError(f"exit_after_engine_gone_s must be > 0 (or off), got {value}")


def bridge_argv(
    python: str | os.PathLike[str], launch: BridgeLaunch, extra: Sequence[str] = ()
) -> list[str]:
    """``python -m bridge`` with ``launch``'s flags, then ``extra`` (given last, so
    they win)."""
    return [os.fspath(python), "-m", "bridge", *to_argv(launch), *extra]
