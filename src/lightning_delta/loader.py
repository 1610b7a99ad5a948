"""The rollout side: rebuild a published step bit for bit, verify it, and only then use it.

For each rank of the step, the loader walks that rank's chain back to its base (or to the state
it already holds), then decodes forward.  Every object is checked against its commit marker's
SHA-256; every slice against the trainer's value checksum (incrementally for intermediate steps,
in full for the step returned); every link against its predecessor's `snapshot_id`.  Any
mismatch raises and leaves the loader's state, and any module, as it was.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from . import codec
from . import format as fmt
from .checksum import checksum, checksum_update, parse_checksum
from .errors import (
    ChainError,
    ChecksumError,
    FormatError,
    ModelMismatchError,
    SnapshotNotFoundError,
)
from .follow import FollowedStep, follow
from .shards import assemble, named_tensors
from .store import Store, as_store

__all__ = ["DeltaLoader", "LoadReport", "copy_into"]


@dataclass(frozen=True)
class LoadReport:
    """What the last `state_dict` / `apply_to` call did."""

    step: int
    kind: fmt.Kind  # of the step itself (rank 0's part)
    parts_read: int  # objects fetched; 0 when the step was already held
    payload_bytes: int  # tensor payload bytes fetched
    tensors: int  # full tensors rebuilt and verified
    seconds: float  # fetch, decode and verification


@dataclass(frozen=True)
class _Slice:
    entry: fmt.TensorEntry
    bits: Tensor  # reconstructed values, 1-D, entry's dtype
    checksum: int


@dataclass(frozen=True)
class _RankState:
    header: fmt.PartHeader
    slices: dict[str, _Slice]


class DeltaLoader:
    """Read-only view of a published chain.

    Args:
        store: fsspec URL (a local path works) or a `Store`.
        device: where reconstruction happens and where returned tensors live.
    """

    def __init__(
        self,
        store: str | Store,
        *,
        storage_options: Mapping[str, Any] | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.store = as_store(store, storage_options)
        self.device = torch.device(device)
        self._states: dict[tuple[int, int], _RankState] = {}  # (rank, world) -> last verified
        self._fetched: list[fmt.PartHeader] = []
        self._complete: dict[int, int] = {}  # step -> world size, for steps seen complete
        self.last_report: LoadReport | None = None

    def steps(self) -> list[int]:
        """Steps whose every rank part is committed, ascending.

        Parts are never rewritten, so a step seen complete stays complete until it is deleted:
        a poll lists `steps/` and only the step folders not yet seen complete.
        """
        listed = self.store.published_steps()
        present = set(listed)  # steps deleted by retention drop out
        self._complete = {s: w for s, w in self._complete.items() if s in present}
        for step in listed:
            if step not in self._complete and (world := self.store.complete_world_size(step)):
                self._complete[step] = world
        return [s for s in listed if s in self._complete]

    def state_dict(self, step: int | None = None) -> tuple[int, dict[str, Tensor]]:
        """(step, full tensors by name) of a complete step, `None` for the latest one, verified."""
        if step is None:
            steps = self.steps()
            if not steps:
                raise SnapshotNotFoundError(f"no complete step in {self.store.url}")
            step = steps[-1]
        world = self._complete.get(step) or self.store.complete_world_size(step)
        if world is None:
            raise SnapshotNotFoundError(f"step {step} is not completely published in {self.store.url}")
        started, self._fetched = time.perf_counter(), []
        states = [self._rank_state(step, rank, world) for rank in range(world)]
        ids = {s.header.snapshot_id for s in states}
        if len(ids) != 1:
            raise ChainError(f"step {step}: rank parts belong to different snapshots {sorted(ids)}")
        tensors = _assemble(states)
        for rank, state in enumerate(states):
            self._states[(rank, world)] = state
        self.last_report = LoadReport(
            step=step,
            kind=states[0].header.kind,
            parts_read=len(self._fetched),
            payload_bytes=sum(h.payload_bytes for h in self._fetched),
            tensors=len(tensors),
            seconds=time.perf_counter() - started,
        )
        return step, tensors

    def apply_to(self, module: nn.Module, step: int | None = None) -> int:
        """Copy a verified step into `module`'s parameters and buffers in place; returns the step.

        Nothing is copied unless every name and shape matches.
        """
        step, tensors = self.state_dict(step)
        copy_into(module, tensors, step)
        return step

    def follow(
        self,
        *,
        poll_seconds: float = 1.0,
        prefetch: int = 1,
        max_staleness: int | None = None,
        timeout: float | None = None,
    ) -> Iterator[FollowedStep]:
        """Watch the store and yield each newer complete step, verified, as a `FollowedStep`.

        The next step is fetched and rebuilt in the background while the caller works on the
        current one (`prefetch` steps at most).  A follower that fell behind skips to the newest
        step; one whose chain broke waits for the next step that rebuilds.  `max_staleness` logs
        a warning when a handed-out step is more than that many published steps behind; `timeout`
        ends the iteration after that many seconds without a new step.  While following, the
        loader's other methods must not be called from another thread.
        """
        return follow(self, poll_seconds=poll_seconds, prefetch=prefetch, max_staleness=max_staleness, timeout=timeout)

    # ------------------------------------------------------------------ reconstruction

    def _rank_state(self, step: int, rank: int, world: int) -> _RankState:
        chain: list[tuple[fmt.PartHeader, memoryview]] = []
        start: _RankState | None = None
        at, wanted_id = step, None
        while True:
            held = self._states.get((rank, world))
            if held and held.header.step == at and wanted_id in (None, held.header.snapshot_id):
                start = held
                break
            try:
                header, payload = self.store.read_part(at, rank, world)
            except SnapshotNotFoundError:
                if not chain:
                    raise
                raise ChainError(
                    f"step {chain[-1][0].step} rank {rank} is a delta against step {at}, "
                    "which is not in the store (deleted, or its upload never finished)"
                ) from None
            if wanted_id is not None and header.snapshot_id != wanted_id:
                raise ChainError(
                    f"step {chain[-1][0].step} rank {rank} expects predecessor {wanted_id}, "
                    f"the store holds {header.snapshot_id} at step {at}"
                )
            chain.append((header, payload))
            self._fetched.append(header)
            if header.kind == fmt.Kind.BASE:
                break
            at, wanted_id = header.prev_step, header.prev_snapshot_id
        state = start
        for i, (header, payload) in enumerate(reversed(chain)):
            state = self._apply(state, header, payload, full_check=i == len(chain) - 1)
        assert state is not None
        return state

    def _apply(
        self,
        state: _RankState | None,
        header: fmt.PartHeader,
        payload: memoryview,
        full_check: bool,
    ) -> _RankState:
        where = f"{self.store.url}/{fmt.blob_path(header.step, header.rank, header.world_size)}"
        if header.kind == fmt.Kind.DELTA:
            assert state is not None
            layout = {e.name: (e.dtype, e.shape, e.start, e.numel) for e in header.tensors}
            held = {n: (s.entry.dtype, s.entry.shape, s.entry.start, s.entry.numel) for n, s in state.slices.items()}
            if layout != held:
                raise ChainError(f"{where}: its slices differ from those of its predecessor step {header.prev_step}")
        slices = {}
        for entry in header.tensors:
            data = payload[entry.offset : entry.offset + entry.length]
            old = state.slices[entry.name] if header.kind == fmt.Kind.DELTA and state else None
            try:
                decoded = codec.decode_change(old.bits if old else None, data, numel=entry.numel)
            except FormatError as err:
                raise FormatError(f"{where}: tensor {entry.name!r}: {err}") from None
            new = decoded.new.to(self.device)
            if new.dtype != fmt.DTYPE_NAMES[entry.dtype]:
                raise FormatError(f"{where}: tensor {entry.name!r} payload is {new.dtype}, header says {entry.dtype}")
            change = decoded.change
            if change is not None and change.index.numel() != entry.changed:
                raise FormatError(
                    f"{where}: tensor {entry.name!r} changes {change.index.numel()} elements, "
                    f"header says {entry.changed}"
                )
            if change is not None and old is not None and not full_check:
                value = checksum_update(old.checksum, change.index, change.old, change.new)
            else:
                value = checksum(new.view(torch.int16))
            if value != parse_checksum(entry.checksum):
                raise ChecksumError(
                    f"{where}: tensor {entry.name!r} elements [{entry.start}, {entry.start + entry.numel}) "
                    "do not reproduce the trainer's checksum"
                )
            slices[entry.name] = _Slice(entry, new, value)
        return _RankState(header, slices)


def copy_into(module: nn.Module, tensors: Mapping[str, Tensor], step: int) -> None:
    """Copy verified full tensors into `module` in place; nothing is copied unless all fit."""
    targets = named_tensors(module)
    missing, unexpected = sorted(targets.keys() - tensors.keys()), sorted(tensors.keys() - targets.keys())
    wrong = [n for n in targets.keys() & tensors.keys() if targets[n].shape != tensors[n].shape]
    if missing or unexpected or wrong:
        raise ModelMismatchError(
            f"step {step} does not fit {type(module).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[name])


def _assemble(states: list[_RankState]) -> dict[str, Tensor]:
    pieces: dict[str, list[tuple[int, Tensor]]] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for state in states:
        for name, s in state.slices.items():
            if meta.setdefault(name, (s.entry.dtype, s.entry.shape)) != (
                s.entry.dtype,
                s.entry.shape,
            ):
                raise FormatError(f"{name}: ranks disagree on its dtype or shape")
            pieces.setdefault(name, []).append((s.entry.start, s.bits))
    return {
        name: assemble(name, meta[name][1], fmt.DTYPE_NAMES[meta[name][0]], pieces[name]) for name in sorted(pieces)
    }
