"""What the engine server and the ``gloo`` worker engine tell each other across vLLM.

vLLM hands a worker's error to the engine server as text only ("Call to
collective_rpc method failed: ..."), and the engine server's word to a worker
only as an update info (a dict). So the two sides share these words: the
backend's name; ``ABANDON_KEY``, the update info by which the engine server ends
an update whose trainer went away; and each failure the engine server answers
with a status of its own, its message starting with its kind's tag
(``transfer_failure`` reads the kind back). No torch, no vLLM: the engine
server's process imports this alone.
"""

from __future__ import annotations

from typing import ClassVar

BACKEND = "gloo"

# The key of an update info that abandons the update in progress (its value: why):
# the engine server's way to end an update whose trainer went away between calls.
ABANDON_KEY = "abandon_update"


class GlooTransferError(RuntimeError):
    """A weight-transfer failure the engine server answers with a status of its own.
    vLLM hands a worker's error to the engine server as text only, so each kind's
    message starts with its tag, and ``transfer_failure`` reads the kind back."""

    TAG: ClassVar[str] = "gloo weight transfer"

    def __init__(self, detail: str) -> None:
        super().__init__(f"{self.TAG}: {detail}")
        self.detail = detail


class PeerUnreachable(GlooTransferError):
    """The rendezvous found no trainer: refused or unreachable for ``timeout_s``, or
    its group went away while forming (UNAVAILABLE)."""

    TAG = "gloo rendezvous: the trainer's group could not be reached"


class PeerSilent(GlooTransferError):
    """The rendezvous did not complete in time: a peer that accepts the connection
    and never answers, or ranks that never join (DEADLINE_EXCEEDED)."""

    TAG = "gloo rendezvous: no answer in time"


class RendezvousStuck(GlooTransferError):
    """An earlier rendezvous of this process is still blocked (UNAVAILABLE)."""

    TAG = "gloo rendezvous: a previous weight-transfer init is still stuck"


class UpdateRolledBack(GlooTransferError):
    """An update ended before its finish (its trainer gone, its info refused, the
    engine server abandoning it): the old weights were put back."""

    TAG = "gloo weight update abandoned and rolled back"


class UpdateLeftPartWay(GlooTransferError):
    """An update ended before its finish and could not be rolled back: the
    engine's weights are unknown."""

    TAG = "gloo weight update abandoned part way"


FAILURES: tuple[type[GlooTransferError], ...] = (
    PeerUnreachable,
    PeerSilent,
    RendezvousStuck,
    UpdateRolledBack,
    UpdateLeftPartWay,
)


def transfer_failure(error: BaseException) -> GlooTransferError | None:
    """The failure that ``error``'s text carries (a worker's error, as vLLM passes it
    on: "Call to collective_rpc method failed: ..."), or None."""
    text = str(error)
    for kind in FAILURES:
        at = text.find(f"{kind.TAG}: ")
        if at >= 0:
            return kind(text[at + len(kind.TAG) + 2 :])
    return None


def first_line(error: BaseException, most: int = 300) -> str:
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= most else f"{text[: most - 3]}..."
