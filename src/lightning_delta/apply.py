"""How an engine follower writes the SPARSE payloads of the steps from the state held to the step
asked for (one, or several in turn for a follower that is late): the apply backends, behind one
small protocol.

- `ApplyBackend.CPU_WALK` (`sparse_walk`, numba): each payload decoded, checked and written in one
  pass over CPU parameters; a malformed payload stops its walk where it is found.
- `ApplyBackend.DEVICE` (`device_walk`, Triton): each payload in a fixed number of launches on the
  engine's device, the results left there; the step waits for the device once, at its decision
  (on the CPU only under `TRITON_INTERPRET=1`, which is how it is tested).  Its kernels prove
  themselves on the device when the walker is made, before anything is written; where they fail,
  the follower takes torch.
- `ApplyBackend.TORCH` (`torch_walk`): each payload decoded with torch a chunk of changes at a
  time, checked and written through the same segment tables: the reference, and where the others
  cannot run (no numba, no triton, kernels that failed their proof).

What no walk takes (CLASSED payloads, chains from a base, maps a table cannot address) the
follower decodes with `torch_path`, verifying before it writes.

Whatever the backend, a step is written before it is checked and taken back if any worker's check
fails (steps add mod 2**16, so `undo` restores every bit): `apply` walks every payload, settles
the results on the host (the one wait), sums the workers' partial checksums in one exchange
(`group.sum_partials`, which carries any worker's error to all), and decides.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from . import codec, device_walk, sparse_walk, torch_path
from . import format as fmt
from .errors import ChecksumError, DeltaError, DeviceError, FormatError
from .group import sum_partials
from .sparse_walk import Segments
from .torch_walk import TorchWalk

__all__ = ["ApplyBackend", "Payload", "TorchWalker", "UndoError", "Walker", "apply", "backend_of", "check", "walker"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1

Name = str | int
"""What a segment table's parameter is: an engine parameter by name, or the follower's kept copy
of a refused tensor by its index."""
Moved = int | Tensor
"""A walk's partial result: the checksum move itself (CPU), or a device tensor of `device_walk.RESULT_FIELDS`."""


class ApplyBackend(Enum):
    """Which code writes the SPARSE payloads of a step in sync (`EngineFollower(apply=...)`)."""

    CPU_WALK = "cpu_walk"
    DEVICE = "device"
    TORCH = "torch"

    @staticmethod
    def default(device: torch.device) -> ApplyBackend:
        """The CPU walk on the CPU and the device walk on a GPU, where they can run; else torch."""
        if device.type == "cpu":
            return ApplyBackend.CPU_WALK if sparse_walk.AVAILABLE else ApplyBackend.TORCH
        return ApplyBackend.DEVICE if device.type == "cuda" and device_walk.AVAILABLE else ApplyBackend.TORCH


@dataclass(frozen=True)
class Payload:
    """One SPARSE payload of a step in sync, as a walk takes it: its bytes, its worker's segment
    table and the arrays the table names, and the checksum move the group's partials must reach."""

    key: tuple[int, int]  # (trainer rank, payload)
    data: bytes | memoryview
    numel: int
    dtype: torch.dtype
    changed: int  # from the part's header
    segments: Segments
    names: tuple[Name, ...]
    moved: int
    where: str  # "<store> rank R step S: payload I", for messages

    def parse(self) -> codec.Packed:
        packed = codec.parse(self.data, self.numel)
        if packed.dtype != self.dtype:
            raise fmt.FormatError(f"{self.where} is {packed.dtype}, expected {self.dtype}")
        if packed.m != self.changed:
            raise fmt.FormatError(f"{self.where} changes {packed.m} elements, its header says {self.changed}")
        return packed


class PayloadWalk(Protocol):
    """One payload's walk: `check` writes nothing, `apply` writes, `undo` takes back what `apply`
    wrote (all of it, or what it wrote before it raised)."""

    def check(self) -> Moved: ...

    def apply(self) -> Moved: ...

    def undo(self) -> None: ...

    def wrote(self, at: int, /) -> bool:
        """Whether the last `apply` wrote into the table's `at`-th array (after the decision)."""
        ...


class Walker(Protocol):
    """An apply backend: its walks, and how their results reach the host."""

    def takes(self, names: Sequence[Name]) -> bool:
        """Whether it walks a table naming these arrays (planned once, agreed by the group)."""
        ...

    def walk(self, payload: Payload, targets: Sequence[Tensor]) -> PayloadWalk:
        """`payload`'s walk into `targets` (flat int16 tensors, one per name)."""
        ...

    def settle(self, payloads: Sequence[Payload], moved: Sequence[Moved]) -> list[int]:
        """The walks' checksum moves on the host (the step's one wait for the device); a payload
        its walk refused raises `FormatError`."""
        ...


def walker(backend: ApplyBackend | None, device: torch.device) -> Walker:
    """The walker of `backend` (None: `ApplyBackend.default`) on `device`.  Raises `ValueError`
    where the backend cannot run.  The device walk first proves its kernels on `device`
    (`device_walk.prove`): where they raise or disagree with torch's decoder, one warning says what
    failed, and the follower walks with torch for its life; `DeviceError` where the failure broke
    the device's CUDA context (torch could not write there either)."""
    backend = backend or ApplyBackend.default(device)
    if backend == ApplyBackend.TORCH:
        return TorchWalker(device)
    if backend == ApplyBackend.CPU_WALK:
        if device.type != "cpu" or not sparse_walk.AVAILABLE:
            raise ValueError(f"the CPU walk writes CPU parameters with numba, not parameters on {device}")
        return CpuWalker()
    if not device_walk.AVAILABLE:
        raise ValueError("the device walk needs triton (pip install triton; it ships with CUDA builds of torch)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the device walk runs on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1)")
    if device.type == "cuda" and device.index is None:  # a table's parameters are on one device, by index
        device = torch.device("cuda", torch.cuda.current_device())
    failed = device_walk.prove(device)
    if failed is not None and device.type == "cuda":
        try:  # a kernel that failed may have broken the context (an illegal address): torch cannot write either
            torch.cuda.synchronize(device)
        except Exception as err:
            raise DeviceError(
                f"the device walk's Triton kernels failed their proof on {device} ({failed}) and left its CUDA "
                f"context broken ({type(err).__name__}: {str(err)[:300]}): nothing can write there, torch "
                "included; restart the process, with apply=ApplyBackend.TORCH (init_info apply: torch) to skip "
                "the kernels, and please report it with your GPU, torch and triton versions"
            ) from err
    if failed is not None:
        log.warning(
            "lightning_delta: the device walk's Triton kernels failed their proof on %s (%s): this follower writes "
            "every step with torch instead (ApplyBackend.TORCH, exact, slower); please report it with your GPU, "
            "torch and triton versions",
            device,
            failed,
        )
        return TorchWalker(device)
    return DeviceWalker(device)


def backend_of(walker: Walker) -> ApplyBackend:
    """The backend a walker made by `walker` is."""
    if isinstance(walker, DeviceWalker):
        return ApplyBackend.DEVICE
    return ApplyBackend.CPU_WALK if isinstance(walker, CpuWalker) else ApplyBackend.TORCH


def check(walker: Walker, payloads: Sequence[Payload], targets: Callable[[Name], Tensor]) -> list[int]:
    """Each payload's partial checksum move over the changes this worker owns, writing nothing
    (a step verified before it is written)."""
    walks = [walker.walk(p, [targets(n) for n in p.names]) for p in payloads]
    return walker.settle(payloads, [w.check() for w in walks])


def apply(
    walker: Walker, payloads: Sequence[Payload], targets: Callable[[Name], Tensor], group: dist.ProcessGroup | None
) -> set[int]:
    """Walk every payload in, then check the group's sums: if any payload fails on any worker,
    every walk is taken back on every worker and the step leaves nothing written (`ChecksumError`,
    or the failing worker's error; `UndoError` on a worker where a walk could not be taken back).
    Returns the kept copies written."""
    walks: list[PayloadWalk] = []
    try:
        outcome: Exception | None = None
        partials: list[int] = []
        try:
            moved = []
            for payload in payloads:
                walks.append(walker.walk(payload, [targets(n) for n in payload.names]))
                moved.append(walks[-1].apply())
            partials = walker.settle(payloads, moved)
        except Exception as err:  # whatever it is, the group hears of it with the partial sums
            outcome = err
        for payload, got in zip(payloads, sum_partials(group, partials, outcome), strict=True):
            if got != payload.moved:
                raise ChecksumError(
                    f"{payload.where} does not reproduce the trainer's checksum from the values the engine holds; "
                    "nothing was written, and the next step is written whole"
                )
    except BaseException as err:
        _undo(walks, err)
        raise
    return {
        name
        for walk, payload in zip(walks, payloads, strict=True)
        for at, name in enumerate(payload.names)
        if isinstance(name, int) and walk.wrote(at)
    }


class UndoError(DeltaError):
    """A walk could not be taken back: the engine holds part of a step, so the follower must hold
    none (its next write loads a base)."""


def _undo(walks: Sequence[PayloadWalk], failure: BaseException) -> None:
    """Take back every walk, even past one whose undo raised (each restores only its own writes);
    `UndoError` after them, from the first undo that raised, if one did."""
    first: Exception | None = None
    for walk in reversed(walks):
        try:
            walk.undo()
        except Exception as err:
            first = first or err
    if first is not None:
        raise UndoError(
            f"a step's walk failed ({type(failure).__name__}: {failure}) and could not be taken back "
            f"({type(first).__name__}: {first}): the engine holds part of the step"
        ) from first


# ---------------------------------------------------------------------------------- the CPU walk


class CpuWalker:
    """`ApplyBackend.CPU_WALK`: a payload's walk raises where it is malformed, its result is the
    move itself."""

    def takes(self, names: Sequence[Name]) -> bool:
        return True

    def walk(self, payload: Payload, targets: Sequence[Tensor]) -> PayloadWalk:
        return _CpuWalk(payload, [t.numpy() for t in targets])

    def settle(self, payloads: Sequence[Payload], moved: Sequence[Moved]) -> list[int]:
        return [int(m) for m in moved]


class _CpuWalk:
    """A `sparse_walk.Walk` that keeps no decoded sections between `apply` and `undo` (a step's
    would be the size of the step): `undo` parses the payload again."""

    def __init__(self, payload: Payload, arrays: list[np.ndarray]) -> None:
        self._payload, self._arrays = payload, arrays
        self._applied, self._wrote = 0, set[int]()

    def _walk(self) -> sparse_walk.Walk:
        return sparse_walk.Walk(self._payload.parse(), self._payload.segments, self._arrays)

    def check(self) -> int:
        return self._walk().check()

    def apply(self) -> int:
        walk = self._walk()
        try:
            return walk.apply()
        finally:
            self._applied = walk.applied
            self._wrote = {at for at in range(len(self._arrays)) if walk.wrote(at)}

    def undo(self) -> None:
        if self._applied:
            self._walk().undo(self._applied)
            self._applied = 0

    def wrote(self, at: int) -> bool:
        return at in self._wrote


# ---------------------------------------------------------------------------------- the torch walk


class TorchWalker:
    """`ApplyBackend.TORCH`: a payload's walk decodes with torch a chunk at a time (`torch_walk`),
    raises where it is malformed, and its result is the move itself."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def takes(self, names: Sequence[Name]) -> bool:
        return True

    def walk(self, payload: Payload, targets: Sequence[Tensor]) -> PayloadWalk:
        chunk = torch_path.chunk_size(sum(t.numel() for t in targets), self.device)
        return TorchWalk(payload, targets, self.device, chunk)

    def settle(self, payloads: Sequence[Payload], moved: Sequence[Moved]) -> list[int]:
        return [int(m) for m in moved]


# ---------------------------------------------------------------------------------- the device walk


class DeviceWalker:
    """`ApplyBackend.DEVICE`: a payload's walk leaves its status and partial sums on the device;
    `settle` reads every walk's at once.  Each payload's segment table is copied to the device
    once, and again only when a parameter it names no longer lies where it did (the engine
    re-registered it: a table holds addresses and sizes, not the tensors, so a replaced
    parameter is freed)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tables: dict[tuple[int, int], device_walk.DeviceTable] = {}

    def takes(self, names: Sequence[Name]) -> bool:
        # a refused tensor's kept copy is host memory: on a GPU its payload is decoded by torch
        return self.device.type == "cpu" or all(isinstance(n, str) for n in names)

    def walk(self, payload: Payload, targets: Sequence[Tensor]) -> PayloadWalk:
        table = self._tables.get(payload.key)
        if table is None or table.places != device_walk.places(targets):
            table = device_walk.DeviceTable(payload.segments, targets, self.device)
            self._tables[payload.key] = table
        return device_walk.DeviceWalk(payload.parse(), table, targets)

    def settle(self, payloads: Sequence[Payload], moved: Sequence[Moved]) -> list[int]:
        if not moved:
            return []
        rows = torch.stack([m for m in moved if isinstance(m, Tensor)]).tolist()  # the step's one wait
        settled = []
        for payload, row in zip(payloads, rows, strict=True):
            try:
                settled.append(device_walk.decide(row))
            except FormatError as err:
                raise FormatError(f"{payload.where}: {err}") from None
        return settled
