"""Moved to ``rl_client.driver``: this path keeps its public names (its ``__all__``)
importable (``from bridge.driver import RolloutClient``). New code imports
``rl_client.driver``."""

from rl_client.driver import *  # noqa: F403
from rl_client.driver import __all__ as __all__
