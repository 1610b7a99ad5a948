"""An engine follower's writes of what no walk takes (`apply`: the CPU walk, the device walk, and
torch's walk, `ApplyBackend.TORCH`): CLASSED payloads, chains from a base, steps composed on a
payload shipped whole, tensors the map holds in ways a walk cannot address.  They are verified
before anything is written, not walked in and taken back.

A payload is decoded with torch into what it does (`codec.decode_steps`: changed positions and
16-bit steps, or every element), a chunk of changes at a time for a step from the state held, so
that a follower's memory beyond the engine is bounded by a chunk; the changes a worker owns are
hashed into partial checksums, which the follower sums over its group before anything is written,
and then every worker adds the steps at the positions it holds (`write_slice`).  A CLASSED
payload's positions need the exponents of the whole old tensor: each worker fills in what it holds
and the group takes the maximum, after an exchange that carries any worker's failure.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from . import codec
from . import format as fmt
from .checksum import checksum, checksum_at, checksum_update
from .errors import ChecksumError, DeltaError, SnapshotNotFoundError
from .group import Agreed
from .patch import PayloadView, RankState
from .replica import exchange_bytes
from .viewmap import Box

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["PayloadPatch", "TorchPath", "chunk_size", "flat_bits"]

log = logging.getLogger("lightning_delta.engine")
"""The engine follower's logger: its warnings (a CLASSED payload in a group) are filtered by that name."""

_MASK64 = (1 << 64) - 1

_CHUNK = 1 << 14
"""The fewest changes decoded, checked and written at a time by a follower in sync: its memory
beyond the engine is bounded by a chunk (100-300 bytes a change while one is decoded), whatever
the tensor."""
_CHUNK_PER_ELEMENT, _CHUNK_PER_ELEMENT_ON_GPU = 1 / 8192, 1 / 2048
"""More changes a chunk where the worker holds more elements, as each chunk has a fixed cost,
larger on a GPU (host syncs and kernel launches).  Measured at 2% changed:
0.035x-0.062x the model beyond the engine on the CPU (scripts/bench_vllm.py), 0.022x on an H200
(scripts/gpu_check.py)."""


@dataclass
class PayloadPatch:
    """One payload at the target step, relative to the held state: `step` added at ascending
    positions `index`, or (`whole`) every element."""

    index: Tensor | None = None
    step: Tensor | None = None
    whole: Tensor | None = None

    @property
    def changed(self) -> int:
        return self.whole.numel() if self.whole is not None else (self.index.numel() if self.index is not None else 0)


class TorchPath:
    """One worker's torch reference over the engine's parameters (`params`, read at each call) and
    `plan`'s kept copies of refused tensors (which the follower fills in a base's write): decoding,
    partial checksums, the exponents of a CLASSED payload, and writes, a payload slice at a time."""

    def __init__(self, plan: Plan, rank: int, group: dist.ProcessGroup | None) -> None:
        self._url, self.run, self._views, self.map = plan.url, plan.run, plan.views, plan.map
        self._owned, self._kept, self._names, self._shapes = plan.owned, plan.kept, plan.names, plan.shapes
        self.rank, self.group, self.device = rank, group, plan.device
        held = sum(b.numel for boxes in plan.map.boxes.values() for b in boxes)
        held += sum(t.numel for t in plan.run.manifest.tensors if t.name not in plan.map.boxes)
        self._chunk = chunk_size(held, plan.device)
        self._warned_classed = False

    def patches(
        self,
        rank: int,
        i: int,
        parts: tuple[fmt.Part, ...],
        held: RankState | None,
        params: Mapping[str, Tensor],
        partials: list[int] | None = None,
        expected: list[tuple[int, int, int, int]] | None = None,
    ) -> Iterator[PayloadPatch]:
        """Payload `i` of `rank` at the end of its chain, as patches of the held state, each part's
        payload decoded and verified in turn: a whole payload by its own checksum, a change by the
        partial sums over the changes this worker owns, which go into `partials` with what the
        group's sums must reach in `expected` (nothing is checked without them).  A step from the
        state held (a follower in sync) comes a chunk of changes at a time, so its cost is bounded
        by the chunk; a longer chain is composed into one patch first."""
        view = self._views[rank][i]
        if len(parts) == 1 and held is not None:
            yield from self._chunks(view, rank, i, parts[0], held.checksums[i], params, partials, expected)
            return
        patch, value = PayloadPatch(), held.checksums[i] if held is not None else 0
        for part in parts:
            entry, data = part.entries[i], part.payloads[i]
            steps = codec.decode_steps(
                data,
                numel=view.numel,
                dtype=view.dtype,
                device=self.device,
                exponents=functools.partial(self.exponents, view, patch, params),
            )
            where = f"{self._url} rank {rank} step {part.header.step}: payload {i}"
            if steps.whole is not None:
                bits = steps.whole.view(torch.int16)
                patch = PayloadPatch(whole=bits)
                if partials is not None and checksum(bits) != entry.checksum:
                    raise ChecksumError(f"{where} does not reproduce the trainer's checksum")
            else:
                assert steps.index is not None and steps.step is not None
                if steps.index.numel() != entry.changed:
                    raise fmt.FormatError(
                        f"{where} changes {steps.index.numel()} elements, its header says {entry.changed}"
                    )
                if patch.whole is not None:  # on top of a staged whole payload: every worker checks it
                    old = patch.whole.index_select(0, steps.index)
                    new = old + steps.step
                    moved = checksum_update(value, steps.index, old, new)
                    if partials is not None and moved != entry.checksum:
                        raise ChecksumError(f"{where} does not reproduce the trainer's checksum")
                    patch.whole.index_copy_(0, steps.index, new)
                else:
                    if partials is not None and expected is not None:
                        partials.append(self.partial(view, patch, steps.index, steps.step, params))
                        expected.append((rank, i, part.header.step, (entry.checksum - value) & _MASK64))
                    patch = _compose(patch, steps.index, steps.step)
            value = entry.checksum
        yield patch

    def _chunks(
        self,
        view: PayloadView,
        rank: int,
        i: int,
        part: fmt.Part,
        value: int,
        params: Mapping[str, Tensor],
        partials: list[int] | None,
        expected: list[tuple[int, int, int, int]] | None,
    ) -> Iterator[PayloadPatch]:
        """One part's payload over the held state whose checksum is `value`, in chunks."""
        entry, where = part.entries[i], f"{self._url} rank {rank} step {part.header.step}: payload {i}"
        moved, count = 0, 0
        for steps in codec.iter_steps(
            part.payloads[i],
            numel=view.numel,
            dtype=view.dtype,
            device=self.device,
            exponents=functools.partial(self.exponents, view, PayloadPatch(), params),
            chunk=self._chunk,
        ):
            if steps.whole is not None:  # a payload most of which changed, shipped whole
                bits = steps.whole.view(torch.int16)
                if partials is not None and checksum(bits) != entry.checksum:
                    raise ChecksumError(f"{where} does not reproduce the trainer's checksum")
                yield PayloadPatch(whole=bits)
                return
            assert steps.index is not None and steps.step is not None
            count += steps.index.numel()
            if partials is not None:
                moved += self.partial(view, PayloadPatch(), steps.index, steps.step, params)
            yield PayloadPatch(steps.index, steps.step)
        if count != entry.changed:
            raise fmt.FormatError(f"{where} changes {count} elements, its header says {entry.changed}")
        if partials is not None and expected is not None:
            partials.append(moved & _MASK64)
            expected.append((rank, i, part.header.step, (entry.checksum - value) & _MASK64))

    def _held_pieces(
        self, view: PayloadView, index: Tensor, params: Mapping[str, Tensor], owned_only: bool
    ) -> Iterator[tuple[slice | Tensor, Tensor]]:
        """Of the ascending payload positions `index`, piece by piece, those this worker holds (or
        owns): which they are (a slice of `index`, or their places in it) and their held bits."""
        for s, _, positions, where in view.pieces(index):
            for held, bits in self._tensor_bits(s.tensor, positions, params, owned_only):
                if isinstance(held, slice):
                    yield slice(where.start + held.start, where.start + held.stop), bits
                else:
                    yield codec.positions_of(held) + where.start, bits

    def _tensor_bits(
        self, tensor: int, positions: Tensor, params: Mapping[str, Tensor], owned_only: bool
    ) -> list[tuple[slice | Tensor, Tensor]]:
        """For ascending flat positions of checkpoint tensor `tensor`, per box: those it holds (a
        slice or a mask of `positions`) and their bits."""
        name = self._names[tensor]
        if name not in self.map.boxes:
            if owned_only and self.rank != 0:  # the kept copies are the same on every worker: rank 0 counts
                return []
            if tensor not in self._kept:
                raise SnapshotNotFoundError(f"{name} is not held yet")
            bits = self._kept[tensor].index_select(0, positions.cpu()).to(positions.device)
            return [(slice(0, positions.numel()), bits)]
        out: list[tuple[slice | Tensor, Tensor]] = []
        for box, owned in zip(self.map.boxes[name], self._owned[name], strict=True):
            if owned_only and not owned:
                continue
            held, target = box.locate(positions, self._shapes[tensor])
            flat = flat_bits(params[box.param])
            out.append((held, flat.index_select(0, target.to(flat.device)).to(positions.device)))
        return out

    def partial(
        self, view: PayloadView, patch: PayloadPatch, index: Tensor, step: Tensor, params: Mapping[str, Tensor]
    ) -> int:
        """This worker's share of how the checksum moves when `step` is added at `index` to the held
        state with `patch` applied: over the changed positions it owns."""
        total = 0
        for held, old in self._held_pieces(view, index, params, owned_only=True):
            at = index[held]
            if patch.index is not None:
                old = old + _overlay(patch, at)
            total += checksum_update(0, at, old, old + step[held])
        return total & _MASK64

    def exponents(self, view: PayloadView, patch: PayloadPatch, params: Mapping[str, Tensor]) -> Tensor:
        """The exponent bytes of the whole payload in the held state with `patch` applied: each
        worker fills in what it holds, and the group takes the maximum (the rest are zeros)."""
        if patch.whole is not None:
            return codec.exponent_bytes(patch.whole.view(view.dtype))
        if self.group is not None and not self._warned_classed:
            self._warned_classed = True
            log.warning(
                "%s: a payload is coded with the exponent context (CLASSED): every step, each worker gathers the "
                "exponent bytes of the whole tensor, work in the size of the tensor, not of the change; publish "
                "for tensor-parallel engines with CodecOptions(context=Context.NONE) (Hydra: delta.codec.context=NONE)",
                self._url,
            )
        where = torch.device("cpu") if self.group is not None else self.device  # a gloo group reduces on the CPU
        out, failure = torch.empty(0), None
        try:
            out = torch.zeros(view.numel, dtype=torch.uint8, device=where)
            for s, offset in zip(view.slices, view.offsets, strict=False):
                name = self._names[s.tensor]
                if name not in self.map.boxes:
                    if s.tensor in self._kept:
                        kept = self._kept[s.tensor][s.start : s.start + s.numel]
                        out[offset : offset + s.numel] = codec.exponent_bytes(kept.view(view.dtype)).to(where)
                    continue
                for box in self.map.boxes[name]:
                    flat = flat_bits(params[box.param])
                    for source, target in _runs(box, self._shapes[s.tensor], s.start, s.numel):
                        bits = flat[_on(target, flat.device)]
                        out[_on(_shift(source, offset), where)] = codec.exponent_bytes(bits.view(view.dtype)).to(where)
            if patch.index is not None and patch.index.numel():
                for held, old in self._held_pieces(view, patch.index, params, owned_only=False):
                    at = patch.index[held]
                    new = old + _overlay(patch, at)
                    out[at.to(where)] = codec.exponent_bytes(new.view(view.dtype)).to(where)
        except Exception as err:
            failure = err
        if self.group is None:
            if failure is not None:
                raise failure
            return out
        # An exchange first, the one every outcome of the group travels in: a worker that failed
        # before this decode is in its outcome exchange, which pairs with this one, and every
        # worker raises its error here; past it, every worker takes the all-reduce.
        try:
            exchange_bytes(failure or b"", self.group, torch.device("cpu"))
        except DeltaError as err:
            raise Agreed(err) from err
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out.to(self.device)

    def write_slice(self, s: fmt.SliceSpec, offset: int, patch: PayloadPatch, params: Mapping[str, Tensor]) -> bool:
        """Write one slice of a payload's patch; True if it went into the kept copies."""
        name = self._names[s.tensor]
        if patch.whole is not None:
            values = patch.whole[offset : offset + s.numel]
            if name not in self.map.boxes:
                numel = self.run.manifest.tensors[s.tensor].numel
                kept = self._kept.setdefault(s.tensor, torch.zeros(numel, dtype=torch.int16))
                kept[s.start : s.start + s.numel] = values.cpu()
                return True
            for box in self.map.boxes[name]:
                flat = flat_bits(params[box.param])
                for source, target in _runs(box, self._shapes[s.tensor], s.start, s.numel):
                    flat[_on(target, flat.device)] = values[_on(source, values.device)].to(flat.device)
            return False
        assert patch.index is not None and patch.step is not None
        bounds = torch.tensor([offset, offset + s.numel], device=patch.index.device)
        lo, hi = torch.searchsorted(patch.index, bounds).tolist()
        if lo == hi:
            return False
        positions = patch.index[lo:hi] - offset + s.start
        steps = patch.step[lo:hi]
        if name not in self.map.boxes:
            kept, positions = self._kept[s.tensor], positions.cpu()
            kept.index_add_(0, positions, steps.cpu())  # int16 adds wrap: mod 2**16, as a step is
            return True
        for box in self.map.boxes[name]:
            held, target = box.locate(positions, self._shapes[s.tensor])
            flat = flat_bits(params[box.param])
            target = target.to(flat.device)
            flat.index_add_(0, target, steps[held].to(flat.device))
        return False

    def owned_sum(self, view: PayloadView, params: Mapping[str, Tensor]) -> int:
        total = 0
        for s, offset in zip(view.slices, view.offsets, strict=False):
            name = self._names[s.tensor]
            if name not in self.map.boxes:
                if self.rank == 0 and s.tensor in self._kept:
                    total += checksum(self._kept[s.tensor][s.start : s.start + s.numel], offset)
                continue
            for box, owned in zip(self.map.boxes[name], self._owned[name], strict=True):
                if not owned:
                    continue
                flat = flat_bits(params[box.param])
                for source, target in _runs(box, self._shapes[s.tensor], s.start, s.numel):
                    bits = flat[_on(target, flat.device)]
                    if isinstance(source, slice):
                        total += checksum(bits, offset + source.start)
                    else:
                        total += checksum_at(bits, (source + offset).to(flat.device))
        return total & _MASK64


def _overlay(patch: PayloadPatch, at: Tensor) -> Tensor:
    """The steps `patch` adds at payload positions `at` (zero where it adds none)."""
    assert patch.index is not None and patch.step is not None
    if not patch.index.numel():
        return torch.zeros_like(at, dtype=torch.int16)
    where = torch.searchsorted(patch.index, at).clamp_(max=patch.index.numel() - 1)
    hit = patch.index.index_select(0, where) == at
    return torch.where(hit, patch.step.index_select(0, where), 0).to(torch.int16)


def _compose(patch: PayloadPatch, index: Tensor, step: Tensor) -> PayloadPatch:
    """`patch`, then `step` added at `index`, as one additive patch."""
    if patch.index is None or patch.step is None:
        return PayloadPatch(index, step)
    union, inverse = torch.unique(torch.cat([patch.index, index]), sorted=True, return_inverse=True)
    total = torch.zeros(union.numel(), dtype=torch.int16, device=index.device)
    total.index_add_(0, inverse[: patch.index.numel()], patch.step)
    total.index_add_(0, inverse[patch.index.numel() :], step)  # int16 wraps: steps add mod 2**16
    return PayloadPatch(union, total)


def _runs(box: Box, shape: Sequence[int], start: int, numel: int) -> Iterator[tuple[slice | Tensor, slice | Tensor]]:
    """The elements of flat checkpoint positions [start, start + numel) that `box` holds, in
    chunks: (their places in that range, their flat positions in the parameter), as one pair of
    slices where the box is one run of the checkpoint tensor."""
    first = box.run_start(shape)
    if first is not None:
        lo, hi = max(first, start), min(first + box.numel, start + numel)
        if hi > lo:
            yield slice(lo - start, hi - start), slice(box.offset + lo - first, box.offset + hi - first)
        return
    for source, target in box.positions(shape):
        inside = (source >= start) & (source < start + numel)
        if bool(inside.any()):
            yield source[inside] - start, target[inside]


def _on(where: slice | Tensor, device: torch.device) -> slice | Tensor:
    return where if isinstance(where, slice) else where.to(device)


def _shift(where: slice | Tensor, by: int) -> slice | Tensor:
    return slice(where.start + by, where.stop + by) if isinstance(where, slice) else where + by


def chunk_size(held: int, device: torch.device) -> int:
    """The changes decoded at a time by a worker that holds `held` elements (`_CHUNK`)."""
    per_element = _CHUNK_PER_ELEMENT if device.type == "cpu" else _CHUNK_PER_ELEMENT_ON_GPU
    return max(_CHUNK, int(held * per_element))


def flat_bits(tensor: Tensor) -> Tensor:
    return tensor.detach().view(-1).view(torch.int16)
