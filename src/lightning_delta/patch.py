"""A step as a patch of the held state: decoded, verified and applied at the cost of the change.

Each trainer rank's part holds payloads, each the concatenation of slices of the run's tensors.
A `PayloadView` reads and writes one payload through a `Sink` (the held state: the loader's
copies, a module, an engine), so a delta is decoded by reading only the old values at its changed
positions, verified with the incremental value checksum, and written only there.  A chain of
several parts composes into one patch relative to the held state; a RAW payload (a base) is a
patch of every element.  Nothing here writes into a sink before `apply` is called, and the
loader calls it only once every payload of every rank has verified.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import codec, records
from . import format as fmt
from .checksum import checksum, checksum_update
from .errors import ChainError, ChecksumError, FormatError, first_names
from .sinks import Sink

__all__ = ["LoadReport", "PayloadPatch", "PayloadView", "RankPatch", "RankState", "StepPatch", "decode_rank", "views"]


@dataclass(frozen=True)
class RankState:
    """What a loader knows of one trainer rank's part of the held state besides the values: the
    part it was reached with, its probe, and each payload's checksum (the trainer's, verified)."""

    header: fmt.PartHeader
    probe: tuple[float, ...] | None
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class PayloadPatch:
    """One payload at the target step, relative to the held state: new bits at ascending
    positions, or (`index` None) every element."""

    index: Tensor | None
    new: Tensor  # int16
    checksum: int  # the trainer's, at the target step

    @property
    def changed(self) -> int:
        return self.new.numel() if self.index is None else self.index.numel()


@dataclass(frozen=True)
class RankPatch:
    """One trainer rank's payloads at the target step, and the state the loader then holds."""

    state: RankState
    payloads: tuple[PayloadPatch, ...]
    base_step: bool  # the target step is a base step (the cadence of full checks)

    @property
    def whole(self) -> bool:
        """Every payload is whole: applying the patch needs nothing from the held state."""
        return all(p.index is None for p in self.payloads)


@dataclass(frozen=True)
class LoadReport:
    """What loading a step did (`DeltaLoader.last_report`, `FollowedStep.report`)."""

    step: int
    kind: fmt.Kind  # of the part rank 0 rebuilt the step with (its bridge is a delta)
    parts_read: int  # part objects this worker fetched; 0 when the step was already held
    bytes_read: int  # every object this worker read from the store for it: markers, manifest, parts
    tensors: int  # tensors of the step
    changed: int  # elements to write: the changes, or every element when the step came from a base
    seconds: float  # fetch, decode and verification (with a replica: the exchange and agreement too)
    share_seconds: float  # of which fetching, decoding and verifying this worker's share of the ranks
    probe: tuple[float, ...] | None = None  # the trainer's probe log-probs at this step, if published

    def __repr__(self) -> str:  # the probe's values would drown the rest
        probe = "None" if self.probe is None else f"<{len(self.probe)} log-probs>"
        return (
            f"LoadReport(step={self.step}, kind={self.kind.value}, parts_read={self.parts_read}, "
            f"bytes_read={self.bytes_read}, tensors={self.tensors}, changed={self.changed}, "
            f"seconds={self.seconds:.3f}, probe={probe})"
        )


@dataclass
class StepPatch:
    """A verified step that is not written yet: every trainer rank's patch of the held state."""

    step: int
    ranks: list[RankPatch]
    report: LoadReport
    generation: int  # of the held state it was decoded against: a later write makes it stale
    tensors: dict[str, Tensor] | None = field(default=None, repr=False)  # copies, once taken


class PayloadView:
    """One payload of one trainer rank, read and written through a sink."""

    def __init__(self, run: fmt.Run, rank: int, payload: int) -> None:
        self.slices = run.manifest.ranks[rank][payload]
        self.numel, self.dtype = run.payloads[rank][payload]
        self.offsets = [0]
        for s in self.slices:
            self.offsets.append(self.offsets[-1] + s.numel)

    def pieces(self, index: Tensor) -> Iterator[tuple[fmt.SliceSpec, int, Tensor, slice]]:
        """Per slice holding some of the ascending payload positions `index`: the slice, its offset
        in the payload, the positions in its tensor, and where they sit in `index`."""
        if len(self.slices) == 1:
            s = self.slices[0]
            yield s, 0, index + s.start if s.start else index, slice(0, index.numel())
            return
        bounds = torch.tensor(self.offsets, dtype=torch.int64, device=index.device)
        cuts = torch.searchsorted(index, bounds).tolist()
        for s, offset, lo, hi in zip(self.slices, self.offsets, cuts, cuts[1:], strict=False):
            if hi > lo:
                yield s, offset, index[lo:hi] + (s.start - offset), slice(lo, hi)

    def gather(self, sink: Sink, index: Tensor) -> Tensor:
        """The held int16 bits at payload positions `index` (ascending)."""
        parts = [sink.gather(s.tensor, positions) for s, _, positions, _ in self.pieces(index)]
        if not parts:
            return torch.empty(0, dtype=torch.int16, device=index.device)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(index.device)

    def read(self, sink: Sink) -> Tensor:
        """Every held int16 bit pattern of the payload (a copy where it has several slices)."""
        parts = [sink.read(s.tensor, s.start, s.numel) for s in self.slices]
        return parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts])

    def exponents(self, sink: Sink) -> Tensor:
        """The held values' exponent bytes (what a CLASSED payload is decoded against): one pass
        over the payload and one byte an element, slice by slice."""
        parts = [codec.exponent_bytes(sink.read(s.tensor, s.start, s.numel).view(self.dtype)) for s in self.slices]
        return parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts])

    def checksum(self, sink: Sink) -> int:
        """The value checksum of what the sink holds, slice by slice (no copy of the payload)."""
        total = 0
        for s, offset in zip(self.slices, self.offsets, strict=False):
            total += checksum(sink.read(s.tensor, s.start, s.numel), offset)
        return total & ((1 << 64) - 1)

    def apply(self, sink: Sink, patch: PayloadPatch) -> None:
        """Write the patch's bits into the sink, slice by slice."""
        if patch.index is None:
            for s, offset in zip(self.slices, self.offsets, strict=False):
                sink.write(s.tensor, s.start, patch.new[offset : offset + s.numel])
            return
        for s, _, positions, where in self.pieces(patch.index):
            sink.scatter(s.tensor, positions, patch.new[where])


def views(run: fmt.Run, rank: int) -> list[PayloadView]:
    return [PayloadView(run, rank, i) for i in range(len(run.manifest.ranks[rank]))]


# ----------------------------------------------------------------------------- decode


def decode_rank(
    run: fmt.Run,
    rank: int,
    parts: Sequence[fmt.Part],
    held: RankState | None,
    sink: Sink | None,
    device: torch.device,
    where: str,
    base_step: bool,
) -> RankPatch:
    """Decode `parts` (oldest first, linked by `prev_step`) into one patch of the held state
    (`held`, whose values `sink` holds), verifying every payload of every part as it goes."""
    first = parts[0].header if parts else None
    if (
        first is not None
        and first.kind == fmt.Kind.DELTA
        and (held is None or sink is None or first.prev_step != held.header.step)
    ):
        raise ChainError(f"{where}: the chain does not reach a base or the step held")
    patches: list[PayloadPatch | None] = [None] * len(run.payloads[rank])
    sums = list(held.checksums) if held is not None else [0] * len(patches)
    for part in parts:
        for i, (entry, data, view) in enumerate(zip(part.entries, part.payloads, views(run, rank), strict=True)):
            previous = patches[i]

            def old_at(index: Tensor, view: PayloadView = view, previous: PayloadPatch | None = previous) -> Tensor:
                return _through(view, sink, previous, index)

            def exponents(view: PayloadView = view, previous: PayloadPatch | None = previous) -> Tensor:
                if previous is not None and previous.index is None:
                    return codec.exponent_bytes(previous.new.view(view.dtype))
                assert sink is not None  # a delta is decoded against a held state
                held_exponents = view.exponents(sink).to(device)
                if previous is not None and previous.index is not None:
                    changed = codec.exponent_bytes(previous.new.view(view.dtype))
                    held_exponents.index_copy_(0, previous.index, changed)
                return held_exponents

            try:
                decoded = codec.decode_patch(
                    data, numel=view.numel, dtype=view.dtype, device=device, old_at=old_at, exponents=exponents
                )
            except FormatError as err:
                raise FormatError(f"{where} step {part.header.step}: payload {i}: {err}") from None
            if decoded.whole is not None:
                value = checksum(decoded.whole.view(torch.int16))
                patch = PayloadPatch(None, decoded.whole.view(torch.int16), value)
            else:
                change = decoded.change
                assert change is not None
                if change.index.numel() != entry.changed:
                    raise FormatError(
                        f"{where} step {part.header.step}: payload {i} changes {change.index.numel()} elements, "
                        f"header says {entry.changed}"
                    )
                value = checksum_update(sums[i], change.index, change.old, change.new)
                patch = _compose(previous, change.index, change.new, value)
            if value != entry.checksum:
                names = [run.manifest.tensors[s.tensor].name for s in view.slices]
                raise ChecksumError(
                    f"{where} step {part.header.step}: payload {i} ({first_names(names)}) does not reproduce "
                    "the trainer's checksum"
                )
            sums[i], patches[i] = value, patch
    if not parts:  # the step is held already: an empty patch
        assert held is not None
        empty = torch.empty(0, dtype=torch.int64, device=device)
        patches = [PayloadPatch(empty, empty.to(torch.int16), c) for c in held.checksums]
        return RankPatch(held, tuple(p for p in patches if p is not None), base_step)
    newest = parts[-1]
    state = RankState(newest.header, newest.probe, tuple(sums))
    return RankPatch(state, tuple(p for p in patches if p is not None), base_step)


def _through(view: PayloadView, sink: Sink | None, patch: PayloadPatch | None, index: Tensor) -> Tensor:
    """The bits at `index` of the held state with `patch` applied, without applying it."""
    if patch is not None and patch.index is None:
        return patch.new.index_select(0, index)
    if sink is None:
        raise ChainError("a delta needs the state it applies to, and none is held")
    bits = view.gather(sink, index).to(index.device)
    if patch is None or patch.index is None or not patch.index.numel() or not index.numel():
        return bits
    at = torch.searchsorted(patch.index, index).clamp_(max=patch.index.numel() - 1)
    hit = patch.index.index_select(0, at) == index
    bits[hit] = patch.new.index_select(0, at[hit])
    return bits


def _compose(previous: PayloadPatch | None, index: Tensor, new: Tensor, value: int) -> PayloadPatch:
    """`previous`, then the change (`new` bits at `index`), as one patch of the held state."""
    if previous is None:
        return PayloadPatch(index, new, value)
    if previous.index is None:  # a whole payload: ours, staged, patched in place
        previous.new.index_copy_(0, index, new)
        return PayloadPatch(None, previous.new, value)
    union, inverse = torch.unique(torch.cat([previous.index, index]), sorted=True, return_inverse=True)
    bits = torch.empty(union.numel(), dtype=torch.int16, device=index.device)
    bits[inverse[: previous.index.numel()]] = previous.new
    bits[inverse[previous.index.numel() :]] = new  # the later change wins
    return PayloadPatch(union, bits, value)


# ----------------------------------------------------------------------------- verify and apply


def held_checksums(run: fmt.Run, rank: int, sink: Sink) -> tuple[int, ...]:
    """Each payload's checksum of what the sink holds: the full check, a pass over the state."""
    return tuple(view.checksum(sink) for view in views(run, rank))


def verify_against(run: fmt.Run, rank: int, patch: RankPatch, held: RankState | None, sink: Sink | None) -> None:
    """Check a patch another worker decoded against this worker's own held state: each payload
    must reach the checksum it claims from the values this worker holds (O(changes))."""
    for i, (payload, view) in enumerate(zip(patch.payloads, views(run, rank), strict=True)):
        if payload.index is None:
            value = checksum(payload.new)
        else:
            if held is None or sink is None:
                raise ChainError(f"rank {rank}: a patch of a state this worker does not hold")
            old = view.gather(sink, payload.index).to(payload.new.device)
            value = checksum_update(held.checksums[i], payload.index, old, payload.new)
        if value != payload.checksum:
            raise ChecksumError(
                f"rank {rank} payload {i}: the patch another worker decoded does not reproduce the trainer's "
                "checksum from the values this worker holds"
            )


def apply(run: fmt.Run, rank: int, patch: RankPatch, sink: Sink) -> None:
    for payload, view in zip(patch.payloads, views(run, rank), strict=True):
        view.apply(sink, payload)


# ----------------------------------------------------------------------------- exchange


def pack(patch: RankPatch) -> list[Tensor]:
    """A patch as uint8 tensors for a collective: a JSON description, then each payload's
    positions and bits (decoded, so a receiver does no decoding work)."""
    state = patch.state
    head = {
        "header": json.loads(records.dumps(state.header)),
        "probe": list(state.probe) if state.probe is not None else None,
        "checksums": [str(c) for c in state.checksums],
        "payloads": [[p.index is not None, str(p.checksum)] for p in patch.payloads],
        "base_step": patch.base_step,
    }
    out = [torch.frombuffer(bytearray(json.dumps(head).encode()), dtype=torch.uint8)]
    for p in patch.payloads:
        if p.index is not None:
            out.append(p.index.contiguous().view(torch.uint8))
        out.append(p.new.contiguous().view(torch.uint8))
    return out


def unpack(pieces: Sequence[Tensor], count: int, device: torch.device) -> list[RankPatch]:
    """The `count` patches a worker of the same group packed back to back (their shapes are
    checked, not trusted)."""
    rest = iter(pieces)
    out = []
    try:
        for _ in range(count):
            head = json.loads(bytes(next(rest).cpu().numpy()))
            header = records.loads(
                json.dumps(head["header"]).encode(), fmt.PartHeader, what="a worker's header", max_bytes=1 << 16
            )
            payloads = []
            for sparse, value in head["payloads"]:
                index = next(rest).to(device).view(torch.int64) if sparse else None
                new = next(rest).to(device).view(torch.int16)
                if index is not None and index.numel() != new.numel():
                    raise ValueError("positions and bits differ in length")
                payloads.append(PayloadPatch(index, new, int(value)))
            probe = tuple(float(v) for v in head["probe"]) if head["probe"] is not None else None
            state = RankState(header, probe, tuple(int(c) for c in head["checksums"]))
            out.append(RankPatch(state, tuple(payloads), bool(head["base_step"])))
    except (ValueError, KeyError, TypeError, StopIteration, RuntimeError) as err:
        raise FormatError(f"a worker of the group sent a malformed patch: {err}") from None
    if next(rest, None) is not None:
        raise FormatError("a worker of the group sent more than its patches")
    return out
