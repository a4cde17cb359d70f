"""An update rolled back: the model put back as vLLM's layerwise reload found it.

An update that ends before its finish (its trainer killed mid-broadcast, a round
past ``timeout_s``, an update info refused, the engine server abandoning it) must
leave the old weights serving bit for bit. ``ReloadSnapshot`` is taken at the
update's first round, a host copy of the tensors the reload writes into;
``roll_back`` puts it back, or says it could not (the weights are then unknown).
Apart from the engines because it reaches into vLLM's reload records, which the
transfer itself never touches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def _copied(value: Any) -> Any:
    return value.copy() if isinstance(value, dict | list | set) else value


@dataclass
class _ModuleState:
    module: torch.nn.Module
    attributes: dict[str, Any]  # its __dict__, containers copied
    reload: dict[str, Any]  # its layerwise-reload record's fields


class ReloadSnapshot:
    """The model as vLLM's layerwise reload left it before anything of the update
    loaded (every module waiting, its kernel tensors, the tensors its weights are
    copied into, aside): what rolling the update back puts back. The values of the
    kernel tensors are copied to host memory; whatever processing derived from them
    (a CPU build's packed GEMM weights, say) is kept by reference, since a
    processed layer replaces it rather than writing into it."""

    def __init__(self, states: list[_ModuleState], values: list[tuple[torch.Tensor, torch.Tensor]]):
        self.states = states
        self.values = values

    @classmethod
    def take(cls, model: torch.nn.Module) -> ReloadSnapshot | None:
        """None unless a layerwise reload has started and loaded nothing yet."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        states = []
        for module in model.modules():
            info = get_layerwise_info(module)
            if not info.can_load() or info.load_numel or info.kernel_tensors is None:
                return None
            attributes = {k: _copied(v) for k, v in vars(module).items()}
            states.append(
                _ModuleState(module, attributes, {k: _copied(v) for k, v in vars(info).items()})
            )
        values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for state in states:
            parameters, buffers = state.reload["kernel_tensors"]
            for tensor in (*parameters.values(), *buffers.values()):
                if id(tensor) not in values and not tensor.is_meta:
                    values[id(tensor)] = (tensor, tensor.detach().to("cpu", copy=True))
        return cls(states, list(values.values()))

    def _reload_record(self, state: _ModuleState) -> Any:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        return get_layerwise_info(state.module)

    def current(self) -> bool:
        """Whether the reload in progress is still the one it was taken from: each
        module still waits with the same kernel tensors, or was processed since
        (and some still wait: the containers do until the reload finishes)."""
        now = [self._reload_record(s).kernel_tensors for s in self.states]
        kept = [
            held is s.reload["kernel_tensors"] for held, s in zip(now, self.states, strict=True)
        ]
        return any(kept) and all(k or held is None for k, held in zip(kept, now, strict=True))

    def restore(self, model: torch.nn.Module, model_config: Any) -> None:
        """Every module's attributes and reload record back as they were taken (as if
        nothing had loaded), the reload finished (vLLM puts the kernel tensors back
        in place), then their values back."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        for state in self.states:
            attributes = vars(state.module)
            attributes.clear()
            attributes.update({k: _copied(v) for k, v in state.attributes.items()})
            vars(self._reload_record(state)).update(
                {k: _copied(v) for k, v in state.reload.items()}
            )
        finalize_layerwise_reload(model, model_config)
        with torch.no_grad():
            for tensor, saved in self.values:
                tensor.data.copy_(saved)


def roll_back(model: torch.nn.Module, snapshot: ReloadSnapshot | None, model_config: Any) -> bool:
    """End the layerwise reload in progress with the weights it started from;
    whether that was possible (else the weights are unknown)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    if snapshot is not None and snapshot.current():
        snapshot.restore(model, model_config)
        return True
    records = [get_layerwise_info(module) for module in model.modules()]
    if not any(record.can_load() for record in records):
        return False  # not a layerwise reload (0.23's kernel-format updates)
    untouched = all(record.can_load() and not record.load_numel for record in records)
    finalize_layerwise_reload(model, model_config)  # the kernel tensors back in place
    return untouched
