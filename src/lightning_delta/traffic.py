"""What a chain costs to store and to follow, counted in one way: bytes of the objects read or
stored (blobs and their commit markers), from markers alone, so no payload is downloaded.

A reader's bytes are those `DeltaLoader` moves: for each rank, the markers it reads to plan
(`paths.cheapest_path`) and the parts on the path it picks.  `lightning-delta cost`,
`scripts/train.py` and `scripts/bench_traffic.py` all use these functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import format as fmt
from . import records
from .format import PartRef
from .paths import cheapest_path
from .store import Store

__all__ = ["ReaderCost", "marker_bytes", "reader_bytes", "stored_bytes", "window_cost"]


def marker_bytes(ref: PartRef) -> int:
    """The size of the commit marker this library writes for `ref`."""
    return len(records.dumps(dataclasses.replace(ref.marker, sha256=ref.sha256 or "0" * 64)))


def reader_bytes(target: int, held: int | None, parts_at: Callable[[int], Sequence[PartRef]]) -> int:
    """Bytes one rank's loader moves to reach `target` from `held`: markers read, parts fetched."""
    read: list[PartRef] = []

    def counted(step: int) -> Sequence[PartRef]:
        refs = parts_at(step)
        read.extend(refs)
        return refs

    path = cheapest_path(target, held, counted)
    return sum(marker_bytes(r) for r in read) + sum(r.size for r in path)


def stored_bytes(refs: Sequence[PartRef]) -> int:
    """Bytes the store holds for these parts: blobs and markers."""
    return sum(r.size + marker_bytes(r) for r in refs)


@dataclass(frozen=True)
class ReaderCost:
    """Bytes over a window of complete steps, for one region (one reader of each kind)."""

    steps: tuple[int, ...]
    dense_bytes: int  # the full model as bf16, shipped once
    full_every_step: int
    in_sync: int  # a follower that held the step before the window and loads every step
    late_joiner: int  # one that joins at `join` (holding nothing) and then loads every step
    join: int
    stored: int  # every object written for these steps, bridges included
    bases: int  # base steps in the window
    mean_delta: float  # a delta step's stored bytes, as a share of dense

    def share(self, value: int) -> float:
        return value / self.full_every_step if self.full_every_step else 0.0

    @property
    def formula(self) -> float:
        """The seed's `[f + (W - f) * delta] / W`, with bases counted as the full model."""
        w = len(self.steps)
        return (self.bases + (w - self.bases) * self.mean_delta) / w if w else 0.0


def window_cost(store: Store, steps: Sequence[int], before: int | None, join: int | None = None) -> ReaderCost:
    """The cost of following `steps` (complete, ascending); `before` is the complete step before
    them, which an in-sync follower holds, or None; `join` defaults to the last step."""
    run = store.manifest()
    if run is None or not steps:
        raise ValueError("window_cost needs a run and at least one step")
    world = run.world_size
    cache: dict[tuple[int, int], list[PartRef]] = {}

    def parts(rank: int) -> Callable[[int], list[PartRef]]:
        def at(step: int) -> list[PartRef]:
            if (step, rank) not in cache:
                cache[step, rank] = store.part_refs(step, rank, world)
            return cache[step, rank]

        return at

    def follow(first: int | None, window: Sequence[int]) -> int:
        total, held = 0, first
        for step in window:
            total += sum(reader_bytes(step, held, parts(rank)) for rank in range(world))
            held = step
        return total

    join = steps[-1] if join is None else join
    if join not in steps:
        raise ValueError(f"join step {join} is not a complete step of the window")
    after = [s for s in steps if s > join]
    late = sum(reader_bytes(join, None, parts(rank)) for rank in range(world)) + follow(join, after)
    dense = 2 * sum(run.numel(rank) for rank in range(world))
    refs = {s: [r for rank in range(world) for r in parts(rank)(s)] for s in steps}
    kinds = {s: {r.kind for r in refs[s] if not r.bridge} for s in steps}
    deltas = [stored_bytes(refs[s]) for s in steps if kinds[s] == {fmt.Kind.DELTA}]
    return ReaderCost(
        steps=tuple(steps),
        dense_bytes=dense,
        full_every_step=len(steps) * dense,
        in_sync=follow(before, steps),
        late_joiner=late,
        join=join,
        stored=sum(stored_bytes(r) for r in refs.values()),
        bases=sum(1 for s in steps if kinds[s] == {fmt.Kind.BASE}),
        mean_delta=sum(deltas) / len(deltas) / dense if deltas and dense else 0.0,
    )
