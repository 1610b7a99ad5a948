"""Which rank publishes which elements, and how a reader puts them back together.

Every published slice is a contiguous range `[start, start + numel)` of a tensor's row-major
flattened elements.  That one shape covers both layouts we read through public torch APIs:

* FSDP2 (`fully_shard`) parameters are DTensors sharded on dim 0 over a 1-D mesh; the rank's
  `to_local()` rows are a contiguous range, placed as `torch.chunk` places them.
* Replicated tensors (DDP, a single device, buffers, `Replicate()` DTensors) are laid end to
  end and the concatenation is cut into `world_size` near-equal ranges, so each rank uploads a
  disjoint share, no byte is uploaded twice and most tensors stay in one piece.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .errors import FormatError, UnsupportedStrategyError

__all__ = [
    "OwnedSlice",
    "assemble",
    "check_readable",
    "clean_name",
    "named_tensors",
    "plan",
    "read_slice",
    "split_replicated",
]

WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Name segments that torch.compile, activation checkpointing and FSDP1 insert."""


@dataclass(frozen=True)
class OwnedSlice:
    """The part of tensor `name` that this rank publishes."""

    name: str
    shape: tuple[int, ...]
    start: int  # in the global flattened tensor
    numel: int
    local_start: int  # in the rank's flattened local tensor


def clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def named_tensors(module: nn.Module) -> dict[str, Tensor]:
    """Parameters and persistent floating-point buffers under wrapper-free names.

    Parameters come from `named_parameters()` (tied weights once); a buffer counts as persistent
    when it appears in `state_dict()`, which is how torch itself decides.  `state_dict()` comes
    first: FSDP2's pre-hook reshards a module that a no-grad forward (a probe) left unsharded and
    frees the unsharded storage, so parameters taken before it would be full tensors whose memory
    is gone; taken after it, they are each rank's own DTensor shards.
    """
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    persistent = {clean_name(k) for k in module.state_dict(keep_vars=True)}
    out: dict[str, Tensor] = {clean_name(n): p for n, p in module.named_parameters()}
    for n, b in module.named_buffers():
        name = clean_name(n)
        if name in persistent and b.is_floating_point() and name not in out:
            out[name] = b
    return out


def check_readable(module: nn.Module) -> None:
    """Refuse, with the way out, parameters that are not the weights they stand for: FSDP1's flat
    parameters, DeepSpeed ZeRO-3's empty placeholders, and packed 4-bit or 8-bit base weights
    (bitsandbytes, under QLoRA).  Published as they are, they would be wrong or empty weights."""
    for name, p in module.named_parameters():
        kind = type(p).__name__
        if kind == "FlatParameter" or "_flat_param" in name:
            raise UnsupportedStrategyError(
                f"{name} is an FSDP1 flat parameter, which holds many tensors' shards back to back: use FSDP2 "
                "(torch.distributed.fsdp.fully_shard; Lightning's ModelParallelStrategy, accelerate's fsdp_version=2)"
            )
        if hasattr(p, "ds_id") or hasattr(p, "ds_shape"):
            raise UnsupportedStrategyError(
                f"{name} is a DeepSpeed ZeRO-3 placeholder (its weights live partitioned elsewhere, it holds "
                f"{p.numel()} elements): use ZeRO stage 1 or 2, or FSDP2 (accelerate's fsdp_version=2)"
            )
        if kind in ("Params4bit", "Int8Params") or hasattr(p, "quant_state") or hasattr(p, "SCB"):
            raise UnsupportedStrategyError(
                f"{name} is a packed {kind} base weight (bitsandbytes, QLoRA): its LoRA merge is not the bf16 "
                "weights a rollout engine serves; train LoRA over a bf16 base model, or publish "
                "`merge_and_unload()` copies of a dequantized model"
            )


def plan(tensors: dict[str, Tensor], rank: int, world_size: int) -> list[OwnedSlice]:
    """The slices `rank` publishes, in a fixed order (sorted by name)."""
    owned: list[OwnedSlice] = []
    replicated: list[tuple[str, Tensor]] = []
    for name in sorted(tensors):
        t = tensors[name]
        if isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements):
            owned.append(_dim0_shard(name, t, world_size))
        else:
            replicated.append((name, t))
    numels = [t.numel() for _, t in replicated]
    for i, start, numel in split_replicated(numels, world_size, rank):
        name, t = replicated[i]
        owned.append(OwnedSlice(name, tuple(t.shape), start, numel, start))
    return sorted(owned, key=lambda s: s.name)


def split_replicated(numels: Sequence[int], world_size: int, rank: int) -> list[tuple[int, int, int]]:
    """(tensor index, start, numel) pieces of rank's share of the concatenated tensors.

    Empty tensors go to rank 0, so that every tensor is listed somewhere.
    """
    total = sum(numels)
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size
    pieces, pos = [], 0
    for i, n in enumerate(numels):
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b or (n == 0 and rank == 0):
            pieces.append((i, a - pos if n else 0, max(b - a, 0)))
        pos += n
    return pieces


def read_slice(tensor: Tensor, s: OwnedSlice) -> Tensor:
    """The slice's current values, 1-D, on the tensor's device (a view where possible)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if tuple(tensor.shape) != s.shape:
        raise UnsupportedStrategyError(f"{s.name} changed shape from {s.shape} to {tuple(tensor.shape)}")
    return local.detach().reshape(-1)[s.local_start : s.local_start + s.numel]


def _dim0_shard(name: str, t: DTensor, world_size: int) -> OwnedSlice:
    mesh, placements = t.device_mesh, t.placements
    if mesh.ndim != 1 or not placements[0].is_shard(0) or mesh.size() != world_size:
        raise UnsupportedStrategyError(
            f"{name}: DTensor placements {placements} on a {mesh.ndim}-D mesh of {mesh.size()} ranks; "
            f"only dim-0 sharding over all {world_size} publishing ranks (FSDP2 fully_shard with "
            "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)) is supported"
        )
    shape = tuple(t.shape)
    rows = shape[0] if shape else 1
    chunk = -(-rows // world_size)
    first = min(mesh.get_local_rank() * chunk, rows)
    local_rows = min(chunk, rows - first)
    inner = math.prod(shape[1:])
    local = t.to_local()
    if local.numel() != local_rows * inner:
        raise UnsupportedStrategyError(
            f"{name}: local shard of {tuple(local.shape)} is not the torch.chunk dim-0 shard "
            f"({local_rows} rows) this format expects"
        )
    return OwnedSlice(name, shape, first * inner, local_rows * inner, 0)


def assemble(name: str, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[tuple[int, Tensor]]) -> Tensor:
    """Full tensor from (start, values) pieces that must tile it exactly."""
    end = 0
    ordered = sorted(pieces, key=lambda p: (p[0], p[1].numel()))
    for start, values in ordered:
        if start != end:
            raise FormatError(f"{name}: slices leave a gap or overlap at element {end} (next starts at {start})")
        end += values.numel()
    if end != math.prod(shape):
        raise FormatError(f"{name}: slices cover {end} of {math.prod(shape)} elements")
    flat = torch.cat([v for _, v in ordered]) if ordered else torch.empty(0, dtype=dtype)
    return flat.view(dtype).view(shape)
