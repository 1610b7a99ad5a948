"""Several rollout workers of one replica share one download through torch.distributed.

The workers of a replica (say the tensor-parallel ranks of one inference engine) need the same
step.  Rather than each fetching every object, worker `i` of `n` fetches the parts of the trainer
ranks `r` with `r % n == i` and broadcasts those blobs, as uint8 tensors, to the others; every
worker then decodes and verifies all of them itself.  The replica's traffic from the store is one
copy of the step, and the only trust between workers is the group itself: every blob a worker
receives still has to pass the value checksums.

All workers must call these functions in the same order (they are collectives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import errors
from .errors import DeltaError

__all__ = ["agree", "exchange"]

# An error raised by one worker's fetch is raised, as the same type, by every worker.
_ERRORS: list[type[DeltaError]] = [
    errors.ChainError,
    errors.ChecksumError,
    errors.FormatError,
    errors.SnapshotNotFoundError,
    DeltaError,
]


def _device(group: dist.ProcessGroup) -> torch.device:
    """NCCL moves CUDA tensors only; gloo and others take CPU tensors."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(value: int, group: dist.ProcessGroup) -> int:
    """Group rank 0's `value`, on every worker: so that all of them pick the same step."""
    device = _device(group)
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return int(tensor.item())


def exchange(mine: list[bytes] | BaseException, group: dist.ProcessGroup) -> list[list[bytes]]:
    """Every worker's fetched blobs, by group rank; `mine` is this worker's, or its fetch error.

    If any worker's fetch failed, every worker raises that error once all broadcasts are done,
    so no worker is left waiting in a collective.
    """
    device, me, size = _device(group), dist.get_rank(group), dist.get_world_size(group)
    received: list[list[bytes]] = []
    failure: tuple[int, int, str] | None = None
    for src in range(size):
        if src == me:
            if isinstance(mine, BaseException):
                kind = next((i for i, cls in enumerate(_ERRORS) if isinstance(mine, cls)), len(_ERRORS) - 1)
                items, status = [str(mine).encode()], 1 + kind
            else:
                items, status = mine, 0
            meta = torch.tensor([status, len(items), *map(len, items)], dtype=torch.int64, device=device)
            count = torch.tensor([meta.numel()], dtype=torch.int64, device=device)
        else:
            count = torch.empty(1, dtype=torch.int64, device=device)
        root = dist.get_global_rank(group, src)
        dist.broadcast(count, src=root, group=group)
        if src != me:
            meta = torch.empty(int(count.item()), dtype=torch.int64, device=device)
        dist.broadcast(meta, src=root, group=group)
        sizes = meta[2:].tolist()
        if src == me:
            data = torch.frombuffer(bytearray(b"".join(items)), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        if data.numel():
            dist.broadcast(data, src=root, group=group)
        raw = data.cpu().numpy().tobytes()
        blobs, pos = [], 0
        for n in sizes:
            blobs.append(raw[pos : pos + n])
            pos += n
        status = int(meta[0].item())
        if status and failure is None:
            failure = (src, status - 1, blobs[0].decode(errors="replace"))
        received.append(blobs)
    if failure is not None:
        if isinstance(mine, BaseException):
            raise mine
        src, kind, message = failure
        raise _ERRORS[kind](f"replica worker {src}: {message}")
    return received
