"""One SPARSE payload walked with torch through a segment table (`ApplyBackend.TORCH`): the torch
reference of the CPU walk and the device walk, behind the same protocol (`apply.PayloadWalk`).

The payload is decoded a chunk of changes at a time (`codec.iter_steps`), so that the memory beyond
the engine is bounded by a chunk, and each chunk is mapped through the table's rows (a run of a
parameter, or a block of a 2-D one: `sparse_walk.SEGMENT_FIELDS`) to where this worker holds it.
`check` hashes the owned changes' old and new values into the partial checksum and writes nothing;
`apply` does the same and adds each step (mod 2**16); `undo` decodes the chunks `apply` wrote once
more and subtracts them, which restores every bit.  A malformed payload may raise only once its
last chunk is decoded (`codec.iter_steps`), after earlier chunks were written: `undo` decodes only
the chunks `apply` wrote, never the bad spot again; a chunk is written whole or not at all (every
row's places, steps and sum are made before its first write, and `undo` takes back first the rows
of a chunk whose write raised between two of them); and every position is bounded by its row, so
none is written outside what the table names.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import codec
from .checksum import checksum_update
from .errors import FormatError

if TYPE_CHECKING:
    from .apply import Payload

__all__ = ["TorchWalk"]

_MASK64 = (1 << 64) - 1


class TorchWalk:
    """`payload`'s walk into `targets` (flat int16 tensors, one per name of its table), decoded on
    `device` in chunks of about `chunk` changes."""

    def __init__(self, payload: Payload, targets: Sequence[Tensor], device: torch.device, chunk: int) -> None:
        payload.segments.check_fits([t.numel() for t in targets])
        self._payload, self._targets, self._device, self._chunk = payload, list(targets), device, chunk
        self._rows = payload.segments.calls[:-1]  # the last: the walk's sentinel, held by no one
        self._applied = 0  # the chunks the last `apply` wrote
        self._bounds: Tensor | None = None  # each row's first and last position, on the decoding device
        self._wrote: set[int] = set()
        self._torn: list[tuple[int, Tensor, Tensor]] = []  # the rows written of a chunk not written whole

    def check(self) -> int:
        return self._run(0, None)

    def apply(self) -> int:
        self._applied, self._wrote, self._torn = 0, set(), []
        return self._run(1, None)

    def undo(self) -> None:
        for param, places, steps in reversed(self._torn):  # a chunk `apply` wrote in part
            self._targets[param].index_add_(0, places, -steps)
        self._torn = []
        if self._applied:
            self._run(-1, self._applied)
            self._applied = 0

    def wrote(self, at: int) -> bool:
        return at in self._wrote

    def _chunks(self) -> Iterator[tuple[Tensor, Tensor]]:
        payload = self._payload
        payload.parse()  # its dtype and count against the header, as every walk checks them
        for steps in codec.iter_steps(
            payload.data,
            numel=payload.numel,
            dtype=payload.dtype,
            device=self._device,
            exponents=None,
            chunk=self._chunk,
        ):
            if steps.index is None or steps.step is None:
                raise FormatError(f"{payload.where} is not a SPARSE payload")
            yield steps.index, steps.step

    def _run(self, sign: int, limit: int | None) -> int:
        """Hash (`sign` 0 or 1) and add `sign` times each step, chunk by chunk (the first `limit`:
        an undo never decodes past what `apply` wrote, where a malformed payload would raise)."""
        moved = 0
        for done, (index, step) in enumerate(itertools.islice(self._chunks(), limit)):
            writes = []
            for at, places, steps, param, owned in self._held(index, step):
                target = self._targets[param]
                places = places.to(target.device)
                steps = steps.to(target.device)
                if owned and sign >= 0:
                    old = target.index_select(0, places)
                    moved += checksum_update(0, at.to(target.device), old, old + steps)
                if sign:
                    writes.append((param, places, steps if sign > 0 else -steps))
            # every row's places, steps and sum are made before the first write, and the rows a write
            # that raised left written are `undo`'s first: a chunk is written whole or not at all
            for param, places, steps in writes:
                self._targets[param].index_add_(0, places, steps)  # int16 wraps: mod 2**16
                self._wrote.add(param)
                if sign > 0:
                    self._torn.append((param, places, steps))
            if sign > 0:
                self._applied, self._torn = done + 1, []
        return moved & _MASK64

    def _held(self, index: Tensor, step: Tensor) -> Iterator[tuple[Tensor, Tensor, Tensor, int, bool]]:
        """Of a chunk's changes, per row: the payload positions this worker holds, their places in
        the row's parameter, their steps, the parameter, and whether its partial sum counts them.
        The chunk's positions ascend, so each row's are one slice, found for every row by one
        search (one wait a chunk, not one a row; each row's checksum move and a block row's mask
        still wait for the device: torch is the reference walk, the device walk the one without)."""
        if self._bounds is None or self._bounds.device != index.device:
            self._bounds = torch.tensor([b for r in self._rows for b in r[:2]], dtype=torch.int64, device=index.device)
        slices = torch.searchsorted(index, self._bounds).view(-1, 2).tolist()
        for (lo, _, param, base, first, columns, row, rows, column, width, stride, owned), (a, b) in zip(
            self._rows, slices, strict=True
        ):
            if a == b:
                continue
            at, steps = index[a:b], step[a:b]
            if columns:  # a block of a 2-D tensor
                flat = at - lo + first
                r, c = flat // columns, flat % columns
                inside = (r >= row) & (r < row + rows) & (c >= column) & (c < column + width)
                places = base + (r - row) * stride + (c - column)
                at, places, steps = at[inside], places[inside], steps[inside]
                if not at.numel():
                    continue
            else:  # a run
                places = at - lo + base
            yield at, places, steps, param, bool(owned)
