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

import re
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import errors
from .codec import byte_view
from .errors import DeltaError

__all__ = ["exchange", "exchange_bytes", "group_device"]

_OK, _FAILED = 0, 1
_NAMED = re.compile(r"worker \d+ of the group: ")
_HEAD = 128
"""int64 slots each rank broadcasts first: its status, its item count, the items' sizes and, where
they fit after those, the items themselves.  Each broadcast is a round trip (about 0.1 ms under gloo
on an idle host, 0.7 ms on a busy one), so a small exchange (a decision, partial checksums) is one
broadcast a rank; a larger one two; one of more than 126 items three."""
_ALONE = 1 << 20
"""Items of at least this many bytes (a part's blob) each travel in a broadcast of their own, not
copied into the buffer the smaller ones share: a round trip more, a copy of the item less."""


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
    """Every rank's uint8 tensors, by group rank (this rank's as it sent them); `mine` is this
    rank's, or the error it met.

    If any rank failed, every rank raises once all broadcasts are done: the first failing rank its
    own error, every other rank (one that failed later included, raised from its own) that one, as
    the same `DeltaError` subclass, so that every rank takes the same branch after it (retry from a
    base, or give up).  An error that is not a `DeltaError` (an out-of-memory, a bug) is a
    `DeltaError` on every rank, the failing one included (raised from the original), so that a
    caller's `except DeltaError` is taken on all of them or none.
    """
    me, size = dist.get_rank(group), dist.get_world_size(group)
    received: list[list[Tensor]] = []
    failure: tuple[int, str, str] | None = None
    for src in range(size):
        root = dist.get_global_rank(group, src)
        head = torch.zeros(_HEAD, dtype=torch.int64, device=device)
        if src == me:
            failed = isinstance(mine, BaseException)
            items = [_describe(mine)] if isinstance(mine, BaseException) else [t.reshape(-1) for t in mine]
            meta = [_FAILED if failed else _OK, len(items), *(t.numel() for t in items)]
            head[: min(len(meta), _HEAD)] = torch.tensor(meta[:_HEAD], dtype=torch.int64)
            if _inline(meta[2:]):
                _place(items, head.view(torch.uint8)[8 * len(meta) :])
        dist.broadcast(head, src=root, group=group)
        values = head.tolist()
        if values[1] + 2 > _HEAD:  # more sizes than the head holds: the rest follow
            if src == me:
                rest = torch.tensor(meta[_HEAD:], dtype=torch.int64, device=device)
            else:
                rest = torch.empty(values[1] + 2 - _HEAD, dtype=torch.int64, device=device)
            dist.broadcast(rest, src=root, group=group)
            values += rest.tolist()
        status, sizes = values[0], values[2 : 2 + values[1]]
        if _inline(sizes):
            data = head.view(torch.uint8)[8 * (2 + len(sizes)) :]
            pieces = [data[start : start + n] for start, n in zip(_aligned(sizes), sizes, strict=False)]
        else:
            pieces = _broadcast(items if src == me else None, sizes, root, group, device)
        if src == me:  # its own, as sent: the buffer goes now, not with the exchange's result
            pieces = items
        if status != _OK and failure is None:
            kind, _, message = bytes(pieces[0].cpu().numpy()).decode(errors="replace").partition("\n")
            failure = (src, kind, message)
        received.append(pieces)
    if failure is not None:
        src, kind, message = failure
        if isinstance(mine, BaseException):
            if not isinstance(mine, Exception) or (src == me and isinstance(mine, DeltaError)):
                raise mine
            if src == me:  # as the others raise it: one decision, one type
                raise DeltaError(f"worker {me} of the group: {type(mine).__name__}: {mine}") from mine
        # a later failing rank too raises the first one's: every rank takes the same branch after
        cause = mine if isinstance(mine, BaseException) else None
        if not _NAMED.match(message):  # else a worker passing on a group's earlier error: its origin
            message = f"worker {src} of the group: {message}"
        raise errors.by_name(kind)(message) from cause
    return received


def exchange_bytes(mine: bytes | BaseException, group: dist.ProcessGroup, device: torch.device) -> list[bytes]:
    """`exchange` of one byte string per rank."""
    payload = mine if isinstance(mine, BaseException) else [byte_view(mine)]
    return [bytes(pieces[0].cpu().numpy()) for pieces in exchange(payload, group, device)]


def _broadcast(
    items: list[Tensor] | None, sizes: list[int], root: int, group: dist.ProcessGroup, device: torch.device
) -> list[Tensor]:
    """Items of these sizes from `root` (which passes them; the others None): the small ones in one
    buffer, each large one in a broadcast of its own, from the sender's tensor as it is (a part's
    blob is not copied into a buffer first, nor out of one at the receiver)."""
    small = [i for i, n in enumerate(sizes) if n < _ALONE]
    starts = _aligned([sizes[i] for i in small])
    data = torch.empty(starts[-1], dtype=torch.uint8, device=device)
    if items is not None:
        _place([items[i] for i in small], data)
    if data.numel():
        dist.broadcast(data, src=root, group=group)
    pieces = [data[0:0]] * len(sizes)
    for i, start in zip(small, starts, strict=False):
        pieces[i] = data[start : start + sizes[i]]
    for i, n in enumerate(sizes):
        if n >= _ALONE:
            pieces[i] = items[i].to(device) if items is not None else torch.empty(n, dtype=torch.uint8, device=device)
            dist.broadcast(pieces[i], src=root, group=group)
    return pieces


def _aligned(sizes: list[int]) -> list[int]:
    """Where each item starts in the broadcast buffer, and its end: 8-byte aligned, so a receiver
    views its pieces as int64 positions or int16 bits without a copy."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + (n + 7) // 8 * 8)
    return starts


def _inline(sizes: list[int]) -> bool:
    """Whether items of these sizes travel in the head, after the status, count and sizes."""
    return 2 + len(sizes) + _aligned(sizes)[-1] // 8 <= _HEAD


def _place(items: list[Tensor], data: Tensor) -> None:
    for item, start in zip(items, _aligned([t.numel() for t in items]), strict=False):
        data[start : start + item.numel()].copy_(item)


def _describe(error: BaseException) -> Tensor:
    """The error as the others raise it: its class name if it is one of ours, and its message."""
    if isinstance(error, DeltaError):
        return byte_view(f"{type(error).__name__}\n{error}".encode())
    return byte_view(f"{DeltaError.__name__}\n{type(error).__name__}: {error}".encode())
