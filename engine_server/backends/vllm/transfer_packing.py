"""Packing, as the installed vLLM's weight-transfer engine takes it.

vLLM 0.23's NCCL engine read packing (``packed``, ``packed_buffer_size_bytes``,
``packed_num_buffers``) from each update's info, and trainers written for it
(NeMo RL's included) still send ``"packed": true`` with every update. From 0.32
packing is set once, by the init info (the worker decodes every round as its init
said), and the update-info dataclass has no such field: the old body makes vLLM's
own ``parse_update_info`` fail. So a per-update setting that the installed
engine's update info lacks and its init info declares must agree with what the
group's init set (vLLM's default where the init left it out), and is then dropped.
A disagreement is refused before the engine sees it: the worker would cut the
trainer's bytes with the other layout. Where the update info declares the setting
(0.23's NCCL, our ``gloo``), it passes unchanged.

Decided by the engine's dataclasses, never by vLLM's version: this module is the
one place that looks.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from engine_server.backends.refit import WeightUpdateError

PACKING = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")

UpdateInfo = dict[str, Any] | list[dict[str, Any]]


def _fields(cls: Any) -> dict[str, Any]:
    """A dataclass's fields and their defaults (``MISSING`` for none); {} for a
    class that is not one (a plug-in engine's own info types)."""
    if not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type: ``true`` is not the buffer count 1."""
    return type(a) is type(b) and a == b


class InitTimePacking:
    """One engine server's weight-transfer group: the packing its init set, which
    every update after it must agree with. ``engine_cls``: the worker engine class
    vLLM creates (None: unknown here, updates pass unchanged)."""

    def __init__(self, engine_cls: type | None) -> None:
        init = _fields(getattr(engine_cls, "init_info_cls", None))
        update = _fields(getattr(engine_cls, "update_info_cls", None))
        self.engine = getattr(engine_cls, "__name__", "the weight-transfer engine")
        self._init_cls = getattr(engine_cls, "init_info_cls", None)
        # Settings that moved to the init: declared there (with a default), not per update.
        self.moved = tuple(
            key
            for key in PACKING
            if key in init and init[key] is not dataclasses.MISSING and key not in update
        )
        self.values: dict[str, Any] = {key: init[key] for key in self.moved}
        self._from_init: set[str] = set()  # which of them the last init set itself

    @classmethod
    def for_backend(cls, backend: str) -> InitTimePacking:
        """The rule for the engine vLLM's workers create under ``backend``. The
        factory has no public lookup; its registry loads the class as the worker's
        ``create_engine`` does. One this process cannot load gets no rule: the
        workers, which did load it, answer for the update."""
        loader = WeightTransferEngineFactory._registry.get(backend)
        try:
            return cls(loader() if loader is not None else None)
        except ImportError:
            return cls(None)

    def note_init(self, init_info: dict[str, Any]) -> None:
        """Take the packing an init info sets, read by vLLM's own init dataclass
        (so its defaults). One that dataclass refuses changes nothing: the worker's
        parse refuses it too, in its own words. The NCCL engine takes the packing
        before it opens its group, so an init that fails after parsing still sets it."""
        if not self.moved or self._init_cls is None:
            return
        try:
            parsed = self._init_cls(**init_info)
        except (TypeError, ValueError):
            return
        self.values = {key: getattr(parsed, key) for key in self.moved}
        self._from_init = {key for key in self.moved if key in init_info}

    def fit_update(self, update_info: UpdateInfo) -> UpdateInfo:
        """``update_info`` as the engine takes it (each entry of a per-rank list);
        WeightUpdateError where it disagrees with the init."""
        if not self.moved:
            return update_info
        if isinstance(update_info, list):
            return [self._fit(entry) for entry in update_info]
        return self._fit(update_info)

    def _fit(self, entry: dict[str, Any]) -> dict[str, Any]:
        for key in self.moved:
            if key in entry and not _same(entry[key], self.values[key]):
                sent, agreed = json.dumps(entry[key]), json.dumps(self.values[key])
                said = f"set {agreed}"
                if key not in self._from_init:
                    said = f"left it at vLLM's default, {agreed}"
                raise WeightUpdateError(
                    f"update_info {key!r} is {sent} but the weight-transfer group's init "
                    f"{said}: {self.engine} takes {key!r} from init_info only, "
                    f"so an update cannot change it; send {key!r}: {sent} in init_info "
                    f"(init_weights_update_group), or leave it out of update_info"
                )
        return {key: value for key, value in entry.items() if key not in self.moved}
