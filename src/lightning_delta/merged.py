"""The weights a PEFT (LoRA) policy actually uses: base weights with their adapters merged in.

A `PeftModel` holds each adapted layer's base weight and its `lora_A`/`lora_B` apart; a rollout
engine that holds the plain base model needs `W + scale * B @ A` under the base model's names.
`merged_tensors` computes exactly what peft's `merge_and_unload()` would write, bit for bit, on
the tensors' device, without touching the training model.  Adapters it cannot merge that way
(DoRA and other LoRA variants, `modules_to_save` copies, non-LoRA PEFT methods) are refused.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .errors import UnsupportedStrategyError
from .shards import named_tensors

__all__ = ["is_peft_model", "merged_tensors"]


def is_peft_model(module: nn.Module) -> bool:
    """Whether `module` is a PEFT wrapper (peft's models carry `peft_config`)."""
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


@torch.no_grad()
def merged_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every tensor `merge_and_unload()` would leave, under the base model's names."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    if not layers:
        raise UnsupportedStrategyError(
            f"{type(model).__name__} holds no LoRA layer: only LoRA adapters are merged; publish "
            "`merge_and_unload()` copies with DeltaPublisher"
        )
    out = {}
    for name, tensor in named_tensors(base).items():
        if ".modules_to_save." in f".{name}" or ".original_module." in f".{name}":
            raise UnsupportedStrategyError(
                f"{name}: a PEFT `modules_to_save` copy; publish `merge_and_unload()` copies with DeltaPublisher"
            )
        if not any(name.startswith(f"{layer}.") for layer in layers):
            out[name] = tensor
    for name, layer in layers.items():
        out.update(_merged_layer(name, layer))
    return out


def _merged_layer(name: str, layer: nn.Module) -> dict[str, Tensor]:
    """One LoRA layer's weight (and bias) as peft's unsafe merge computes them."""
    base = layer.get_base_layer()
    if not hasattr(base, "weight"):
        raise UnsupportedStrategyError(f"{name}: a LoRA layer over {type(base).__name__} cannot be merged here")
    weight, bias = base.weight.detach().clone(), getattr(base, "bias", None)
    bias = bias.detach().clone() if bias is not None else None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A and adapter not in getattr(layer, "lora_embedding_A", {}):
            continue
        if adapter in getattr(layer, "lora_variant", {}):
            raise UnsupportedStrategyError(
                f"{name}: adapter {adapter!r} is a LoRA variant (DoRA, ...): publish `merge_and_unload()` copies"
            )
        weight += layer.get_delta_weight(adapter)
        if getattr(layer, "lora_bias", {}).get(adapter):
            assert bias is not None  # peft refuses lora_bias on a layer without bias
            bias += layer.lora_B[adapter].bias * layer.scaling[adapter]
    merged = {f"{name}.weight": weight}
    if bias is not None:
        merged[f"{name}.bias"] = bias
    return merged
