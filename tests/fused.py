"""A stand-in inference engine for the engine tests that need no vLLM: q/k/v fused into one
parameter and sliced for tensor parallelism by its own loader, the way vLLM's Llama does (`narrow`
of the checkpoint tensor, `copy_` into a `narrow` of the parameter); the o projection split on its
input dimension (a strided block); a norm replicated on every worker.  The real engine is tested
in tests/test_vllm.py."""

from __future__ import annotations

import torch
from torch import Tensor, nn

HIDDEN, DIM = 32, 64  # per projection: HIDDEN x DIM


def checkpoint(seed: int = 0) -> dict[str, Tensor]:
    """The trainer's tensors, under the checkpoint's names."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (HIDDEN, DIM),
        "k": (HIDDEN, DIM),
        "v": (HIDDEN, DIM),
        "o": (DIM, HIDDEN),
        "norm": (DIM,),
        "rope": (4,),
    }
    return {f"layer.{n}": (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in shapes.items()}


class Engine(nn.Module):
    """One tensor-parallel worker's parameters (`rank` of `size`)."""

    def __init__(self, rank: int = 0, size: int = 1, cast_norm: bool = False) -> None:
        super().__init__()
        self.rank, self.size = rank, size
        rows = HIDDEN // size
        self.qkv = nn.Parameter(torch.zeros(3 * rows, DIM, dtype=torch.bfloat16), requires_grad=False)
        self.o = nn.Parameter(torch.zeros(DIM, rows, dtype=torch.bfloat16), requires_grad=False)
        norm_dtype = torch.float32 if cast_norm else torch.bfloat16  # a cast: the map must refuse it
        self.norm = nn.Parameter(torch.zeros(DIM, dtype=norm_dtype), requires_grad=False)
        self.register_buffer("rope", torch.zeros(4, dtype=torch.bfloat16), persistent=False)  # its loader computes

    @torch.no_grad()
    def load_weights(self, name: str, tensor: Tensor) -> None:
        rows = HIDDEN // self.size
        short = name.removeprefix("layer.")
        if short in ("q", "k", "v"):
            at = "qkv".index(short) * rows
            self.qkv.data.narrow(0, at, rows).copy_(tensor.narrow(0, self.rank * rows, rows))
        elif short == "o":
            self.o.data.copy_(tensor.narrow(1, self.rank * rows, rows))
        elif short == "norm":
            self.norm.data.copy_(tensor)
        elif short == "rope":
            self.rope.copy_(tensor * 1)  # computed: not a view of the checkpoint tensor
        else:
            raise KeyError(name)

    def expected(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """What this worker's parameters hold when the checkpoint is `tensors`."""
        rows = HIDDEN // self.size
        part = slice(self.rank * rows, (self.rank + 1) * rows)
        qkv = torch.cat([tensors[f"layer.{n}"][part] for n in "qkv"])
        return {"qkv": qkv, "o": tensors["layer.o"][:, part], "norm": tensors["layer.norm"].to(self.norm.dtype)}

    def state(self) -> dict[str, Tensor]:
        return {"qkv": self.qkv.detach(), "o": self.o.detach(), "norm": self.norm.detach()}
