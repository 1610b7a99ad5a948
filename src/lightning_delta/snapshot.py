"""What `DeltaPublisher.publish` does on the training thread: read the rank's slices, diff each
payload's group against the cache on its device, and bring the cache up to date.

Only what must see the live weights is done here (the diff, and for a base a device-side copy);
the upload workers (`uploader`) pack, copy to the host and compress.  On an accelerator the
calling thread waits for the device once per publish: every group's count of changes is taken
first, in one transfer, and each group's positions then without a sync.  The weights are read
whole once, for the masks; after the sync only where they changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import codec
from .merged import MergedTensors, is_peft_model, merged_tensors
from .shards import OwnedSlice, check_readable, named_tensors, read_slice

__all__ = ["SMALL", "Group", "Piece", "TensorSource", "as_source", "described", "grouped", "snapshot"]

TensorSource = nn.Module | Mapping[str, Tensor] | Callable[[], Mapping[str, Tensor]]

SMALL = 1 << 18
"""Slices of at most this many elements share one payload: one diff and one codec call for all.
Each codec call has a fixed cost of ~1 ms on a CPU, as much as 256K elements' diff and pack."""


@dataclass
class Group:
    """The slices of one payload: a large slice alone, or all the small ones on one device."""

    specs: list[OwnedSlice]
    bits: Tensor  # `dtype` copy of the slices as last published, concatenated, on their device


@dataclass(frozen=True)
class Piece:
    """One group of a snapshot as it leaves the training thread: only what must see the live
    weights is done there (the diff, and for a base a device-side copy); the worker packs."""

    snapshot: Tensor | None = None  # base: the group's values, a copy no later step writes to
    change: codec.Change | None = None  # delta, or a base's bridge
    whole: Tensor | None = None  # delta that may be stored RAW: the group's new values, unshared


def grouped(specs: list[OwnedSlice], tensors: Mapping[str, Tensor]) -> list[list[OwnedSlice]]:
    """Large slices alone, then the small ones of each device together: the payloads."""
    large = [[spec] for spec in specs if spec.numel > SMALL]
    small: dict[torch.device, list[OwnedSlice]] = {}
    for spec in specs:
        if spec.numel <= SMALL:
            small.setdefault(tensors[spec.name].device, []).append(spec)
    return large + list(small.values())


def snapshot(
    cache: list[Group],
    tensors: Mapping[str, Tensor],
    dtype: torch.dtype,
    options: codec.CodecOptions,
    is_base: bool,
    bridge: bool,
) -> tuple[list[Piece], int]:
    """Diff every group against the cache on its device and bring the cache up to date.

    A delta (and a base's bridge) writes only the changed elements into the cache; a base
    also hands the worker a device-side copy of the group to pack.  Returns the pieces and how
    many elements changed (a base: all of them).
    """

    def values(group: Group) -> tuple[Tensor, bool]:
        parts = [read_slice(tensors[spec.name], spec).to(dtype) for spec in group.specs]
        # A lone slice may be a view of the live weights (already `dtype`); a concatenation is ours.
        return (parts[0], True) if len(parts) == 1 else (torch.cat(parts), False)

    pieces: list[Piece] = []
    if is_base and not bridge:
        for group in cache:
            new, shared = values(group)
            group.bits = new.clone() if shared else new
            # The worker packs a copy of its own: the next step writes its changes into the cache.
            pieces.append(Piece(snapshot=group.bits.clone()))
        return pieces, sum(s.numel for group in cache for s in group.specs)
    # One read of the weights: each group's values are read (cast, concatenated) once, for its mask.
    # Small slices' concatenation is kept until its diff; a lone slice's cast is not (keeping every
    # group's would cost another copy of the shard), and its live values are read again only at the
    # changed positions (`diff_at`), or whole where the change may be stored RAW.
    masks: list[Tensor | None] = []
    kept: list[Tensor | None] = []
    for group in cache:
        if group.bits.is_cpu:  # `codec.diff` reads the group once, with no count first
            masks.append(None)
            kept.append(None)
            continue
        new, shared = values(group)
        masks.append(group.bits.view(torch.int16) != new.view(torch.int16))
        kept.append(None if shared else new)
    sums = [mask.sum() for mask in masks if mask is not None]
    counts = iter(torch.stack([c.to(sums[0].device) for c in sums]).tolist() if sums else [])  # the one sync
    changed_total = 0
    for group, mask, held in zip(cache, masks, kept, strict=True):
        exponents = options.conditions(group.bits.device)
        if mask is None:
            new, shared = values(group)
            change = codec.diff(group.bits, new, exponents=exponents)
        else:
            new_at = _reader(group, tensors, dtype) if held is None else _gather(held)
            change = codec.diff_at(group.bits, mask, next(counts), new_at, exponents=exponents)
        whole = None
        if codec.may_pack_raw(change):  # a small group, or over a quarter changed: RAW needs it whole
            if mask is not None:
                new, shared = values(group) if held is None else (held, False)
            whole = new.clone() if shared else new
        group.bits.view(torch.int16).index_copy_(0, change.index, change.new)
        copy = group.bits.clone() if is_base else None  # the cache changes at the next step
        pieces.append(Piece(snapshot=copy, change=change, whole=whole))
        changed_total += change.numel if is_base else change.index.numel()
    return pieces, changed_total


def _reader(group: Group, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """A lone slice's new int16 bits at given positions, read from the live weights there only."""
    (spec,) = group.specs
    live = read_slice(tensors[spec.name], spec)  # a view: nothing is read until the positions are
    return lambda index: live.index_select(0, index).to(dtype).view(torch.int16)


def _gather(new: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda index: new.view(torch.int16).index_select(0, index)


def as_source(tensors: TensorSource) -> Callable[[], Mapping[str, Tensor]]:
    if isinstance(tensors, nn.Module):
        check_readable(tensors)
    if isinstance(tensors, nn.Module) and is_peft_model(tensors):  # the merged policy, base model's names
        return lambda: merged_tensors(tensors)
    if isinstance(tensors, nn.Module):
        return lambda: named_tensors(tensors)
    if isinstance(tensors, Mapping):
        return lambda: tensors
    if callable(tensors):
        return tensors
    raise TypeError(f"tensors must be an nn.Module, a mapping or a callable, got {type(tensors).__name__}")


def described(tensors: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """Tensors with the names, shapes, devices and placements of `tensors`, read at no cost: a
    PEFT policy's base weights stand for its merged ones, which cost a merge each to read."""
    return tensors.unmerged() if isinstance(tensors, MergedTensors) else tensors
