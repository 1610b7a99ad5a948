"""Collectives that never leave a rank waiting: every rank's outcome, or the error one of them met.

A rank that raised before a collective would leave the others waiting in it until the process
group times out.  So every collective of the library goes through `exchange`: each rank hands in
its result or the error it met, every rank takes part in every broadcast whatever happened, and
then every rank raises the first failing rank's error, as the same `DeltaError` type.  The
workers of a replica (say the tensor-parallel ranks of one inference engine) use it to share one
download: each decodes a share of a step and sends the others its patches.

All ranks must call these functions in the same order (they are collectives), on `device`: the
CPU for gloo, the rank's own GPU for NCCL, chosen by the caller (a worker thread's current CUDA
device is device 0, not the rank's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import errors
from .errors import DeltaError

__all__ = ["agree", "exchange", "exchange_bytes", "group_device"]

_OK, _FAILED = 0, 1
_HEAD = 16
"""int64 slots each rank broadcasts first: its status, its item count and the first sizes, so that
an exchange of a few items is two broadcasts a rank, not three (each one a round trip)."""


def group_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where `group`'s collectives run: `device` (a CUDA device with its index) under NCCL, which
    moves CUDA tensors only; the CPU under gloo and the others."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"an NCCL group needs the rank's CUDA device with its index, got {device}")
        return device
    return torch.device("cpu")


def exchange(
    mine: Sequence[Tensor] | BaseException, group: dist.ProcessGroup, device: torch.device
) -> list[list[Tensor]]:
    """Every rank's uint8 tensors, by group rank; `mine` is this rank's, or the error it met.

    If any rank failed, every rank raises once all broadcasts are done: the failing rank its own
    error, the others the first failing rank's, as the same `DeltaError` subclass.
    """
    me, size = dist.get_rank(group), dist.get_world_size(group)
    received: list[list[Tensor]] = []
    failure: tuple[int, str, str] | None = None
    for src in range(size):
        root = dist.get_global_rank(group, src)
        if src == me:
            failed = isinstance(mine, BaseException)
            items = [_describe(mine)] if isinstance(mine, BaseException) else [t.reshape(-1) for t in mine]
            meta = [_FAILED if failed else _OK, len(items), *(t.numel() for t in items)]
            head = torch.tensor(meta[:_HEAD] + [0] * (_HEAD - len(meta)), dtype=torch.int64, device=device)
        else:
            head = torch.empty(_HEAD, dtype=torch.int64, device=device)
        dist.broadcast(head, src=root, group=group)
        values = head.tolist()
        if values[1] + 2 > _HEAD:  # more sizes than the head holds: the rest follow
            rest = torch.tensor(meta[_HEAD:], device=device) if src == me else None
            if rest is None:
                rest = torch.empty(values[1] + 2 - _HEAD, dtype=torch.int64, device=device)
            dist.broadcast(rest, src=root, group=group)
            values += rest.tolist()
        status, sizes = values[0], values[2 : 2 + values[1]]
        starts = _aligned(sizes)
        data = torch.empty(starts[-1], dtype=torch.uint8, device=device)
        if src == me:
            for item, start in zip(items, starts, strict=False):
                data[start : start + item.numel()].copy_(item)
        if data.numel():
            dist.broadcast(data, src=root, group=group)
        pieces = [data[start : start + n] for start, n in zip(starts, sizes, strict=False)]
        if status != _OK and failure is None:
            kind, _, message = bytes(pieces[0].cpu().numpy()).decode(errors="replace").partition("\n")
            failure = (src, kind, message)
        received.append(pieces)
    if failure is not None:
        if isinstance(mine, BaseException):
            raise mine
        src, kind, message = failure
        raise errors.by_name(kind)(f"worker {src} of the group: {message}")
    return received


def exchange_bytes(mine: bytes | BaseException, group: dist.ProcessGroup, device: torch.device) -> list[bytes]:
    """`exchange` of one byte string per rank."""
    payload = mine if isinstance(mine, BaseException) else [_bytes(mine)]
    return [bytes(pieces[0].cpu().numpy()) for pieces in exchange(payload, group, device)]


def agree(value: int | BaseException, group: dist.ProcessGroup, device: torch.device) -> int:
    """Group rank 0's `value`, on every rank (so that all of them take the same decision), or the
    error any rank met instead of a value."""
    mine = value if isinstance(value, BaseException) else [torch.tensor([value]).view(torch.uint8)]
    first = exchange(mine, group, device)[0]
    return int(first[0].cpu().view(torch.int64)[0])


def _aligned(sizes: list[int]) -> list[int]:
    """Where each item starts in the broadcast buffer, and its end: 8-byte aligned, so a receiver
    views its pieces as int64 positions or int16 bits without a copy."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + (n + 7) // 8 * 8)
    return starts


def _describe(error: BaseException) -> Tensor:
    """The error as the others raise it: its class name if it is one of ours, and its message."""
    if isinstance(error, DeltaError):
        return _bytes(f"{type(error).__name__}\n{error}".encode())
    return _bytes(f"{DeltaError.__name__}\n{type(error).__name__}: {error}".encode())


def _bytes(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
