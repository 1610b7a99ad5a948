"""The weights a PEFT (LoRA) policy actually uses: base weights with their adapters merged in.

A `PeftModel` holds each adapted layer's base weight and its `lora_A`/`lora_B` apart; a rollout
engine that holds the plain base model needs `W + scale * B @ A` under the base model's names.
`merged_tensors` gives exactly what peft's `merge_and_unload()` would write, bit for bit, on the
tensors' device, without touching the training model.  It merges a layer only when its tensor is
read, and keeps nothing: a publisher reads one payload at a time, so a publish holds one merged
weight at a time, not a copy of every adapted weight (on CUDA it reads each twice for a delta:
once for the change mask every payload's count is taken from, once for the diff).  Adapters it
cannot merge that way (DoRA and other LoRA variants, `modules_to_save` copies, non-LoRA PEFT
methods) are refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .errors import UnsupportedStrategyError
from .shards import named_tensors

__all__ = ["MergedTensors", "is_peft_model", "merged_tensors"]


def is_peft_model(module: nn.Module) -> bool:
    """Whether `module` is a PEFT wrapper (peft's models carry `peft_config`)."""
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def merged_tensors(model: nn.Module) -> MergedTensors:
    """Every tensor `merge_and_unload()` would leave, under the base model's names."""
    return MergedTensors(model)


class MergedTensors(Mapping[str, Tensor]):
    """The merged policy's tensors by name: the base model's own, and each LoRA layer's weight
    (and bias) merged when it is read."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer

        base: nn.Module = model.get_base_model()  # type: ignore[operator]
        layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        if not layers:
            raise UnsupportedStrategyError(
                f"{type(model).__name__} holds no LoRA layer: only LoRA adapters are merged; publish "
                "`merge_and_unload()` copies with DeltaPublisher"
            )
        self._plain: dict[str, Tensor] = {}
        self._merged: dict[str, tuple[str, Any, str]] = {}  # name -> (layer name, layer, "weight" or "bias")
        for name, tensor in named_tensors(base).items():
            if ".modules_to_save." in f".{name}" or ".original_module." in f".{name}":
                raise UnsupportedStrategyError(
                    f"{name}: a PEFT `modules_to_save` copy; publish `merge_and_unload()` copies with DeltaPublisher"
                )
            if not any(name.startswith(f"{layer}.") for layer in layers):
                self._plain[name] = tensor
        for name, layer in layers.items():
            base_layer = layer.get_base_layer()
            if not hasattr(base_layer, "weight"):
                raise UnsupportedStrategyError(
                    f"{name}: a LoRA layer over {type(base_layer).__name__} cannot be merged here"
                )
            for adapter in layer.active_adapters:
                if adapter in getattr(layer, "lora_variant", {}):
                    raise UnsupportedStrategyError(
                        f"{name}: adapter {adapter!r} is a LoRA variant (DoRA, ...): "
                        "publish `merge_and_unload()` copies"
                    )
            self._merged[f"{name}.weight"] = (name, layer, "weight")
            if getattr(base_layer, "bias", None) is not None:
                self._merged[f"{name}.bias"] = (name, layer, "bias")

    def __getitem__(self, name: str) -> Tensor:
        if name in self._plain:
            return self._plain[name]
        _, layer, which = self._merged[name]
        return _merged(layer, which)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._plain, *self._merged])

    def __len__(self) -> int:
        return len(self._plain) + len(self._merged)

    def unmerged(self) -> dict[str, Tensor]:
        """Every tensor with the adapted layers' base weights in place of the merged ones: the
        same names, shapes, dtypes, devices and placements, for planning without merging."""
        out = dict(self._plain)
        for name, (_, layer, which) in self._merged.items():
            out[name] = getattr(layer.get_base_layer(), which)
        return out


@torch.no_grad()
def _merged(layer: Any, which: str) -> Tensor:
    """One LoRA layer's weight or bias, as peft's unsafe merge computes it."""
    base = layer.get_base_layer()
    if which == "bias":
        bias = base.bias.detach().clone()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A and getattr(layer, "lora_bias", {}).get(adapter):
                bias += layer.lora_B[adapter].bias * layer.scaling[adapter]
        return bias
    weight = base.weight.detach().clone()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
            weight += layer.get_delta_weight(adapter)
    return weight
