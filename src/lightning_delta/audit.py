"""Every stored object of a chain checked, and which readers each damaged one breaks.

A loader takes the cheapest path and, where it crosses damage, falls back to a base: so a chain
can load step by step while one of its objects is damaged, and a reader on the other path fails
(a joiner on a damaged base, a follower in sync on a damaged bridge).  `audit` reads every object
itself (each against its commit marker, then parsed), and then rebuilds the chain along both
paths: a joiner at every base step (the base alone) and a follower in sync through every step
(the delta, or the bridge beside a base, alone), each verified against the trainer's checksums.

It reads every object once for its bytes and every base and delta once more for its values: a
base twice in all, on top of what one loader reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

from . import format as fmt
from .errors import DeltaError, SnapshotNotFoundError
from .format import PartRef
from .loader import DeltaLoader
from .reader import ChainReader
from .store import Store

__all__ = ["Audit", "Damage", "Reader", "Unreadable", "audit"]


class Reader(Enum):
    """Who reads an object: a late joiner (a base and the deltas after it), or a follower in sync
    (the previous step held: a delta, or the bridge beside a base)."""

    JOINER = "joiner"
    FOLLOWER = "follower"


@dataclass(frozen=True)
class Damage:
    """A stored object that does not check, and the readers it breaks."""

    step: int
    rank: int
    part: str  # base, delta, bridge, or markers (the commit objects of the rank's step)
    error: str
    message: str
    breaks: list[str]


@dataclass(frozen=True)
class Unreadable:
    """A step some readers cannot rebuild, with the first error met."""

    step: int
    readers: list[Reader]
    error: str
    message: str


@dataclass
class Audit:
    """What `audit` found: clean only if every object checks and every reader rebuilds every step."""

    steps: list[int]  # the complete steps checked
    objects: int = 0  # stored objects checked for their bytes
    damaged: list[Damage] = field(default_factory=list)
    unreadable: list[Unreadable] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.damaged and not self.unreadable


class _Deltas(Store):
    """The chain with its bases hidden while `bases` is False: a loader that holds the previous
    step can then take a step only by its delta or bridge, never by falling back to a base."""

    def __init__(self, store: Store) -> None:
        super().__init__(store.objects, trust=store.trust)  # the readers check what the caller's would
        self.bases = True

    def part_refs(self, step: int, rank: int, world_size: int) -> list[PartRef]:
        refs = super().part_refs(step, rank, world_size)
        return refs if self.bases else [r for r in refs if r.kind == fmt.Kind.DELTA]


def audit(store: Store, only: int | None = None) -> Audit:
    """Check every object of every complete step (or of step `only`), and rebuild each step as a
    joiner and as a follower in sync would."""
    world = store.run().world_size
    complete = ChainReader(store).steps()
    if only is not None and only not in complete:
        raise SnapshotNotFoundError(f"step {only} is not completely published in {store.url}")
    refs = {s: _objects(store, s, world) for s in complete}  # markers only: small reads
    bases = [s for s in complete if refs[s] and all(_has(r, fmt.Kind.BASE) for r in refs[s])]
    steps = complete if only is None else [only]
    result = Audit(steps)
    for step in steps:
        result.objects += _check_objects(store, step, refs[step], complete, bases, result.damaged)
    failures: dict[int, tuple[set[Reader], DeltaError]] = {}

    def failed(steps: list[int], reader: Reader, err: DeltaError) -> None:
        for step in steps:
            failures.setdefault(step, (set(), err))[0].add(reader)

    deltas = _Deltas(store)
    follower = _loaded(deltas, only - 1) if only is not None and only - 1 in complete else None
    for step in steps:
        refused = next((r for r in refs[step] if isinstance(r, DeltaError)), None)
        if refused is not None:  # markers no reader accepts: the step, and a joiner's way past it, are broken
            failed([step], Reader.FOLLOWER, refused)
            failed(_segment(step, complete, bases), Reader.JOINER, refused)
            follower = None
            continue
        if follower is not None and follower.held_step == step - 1 and all(_has(r, fmt.Kind.DELTA) for r in refs[step]):
            deltas.bases = False  # the delta, or the bridge beside a base, alone
            try:
                with _fallback_cause() as cause:
                    follower.state_dict(step)
            except DeltaError as err:
                failed([step], Reader.FOLLOWER, cause[0] if cause else err)
                if step not in bases:  # a joiner reads this delta too
                    failed(_segment(step, complete, bases), Reader.JOINER, cause[0] if cause else err)
            finally:
                deltas.bases = True
        if follower is not None and follower.held_step != step:
            follower = None
        if step in bases or only is not None:
            joiner = DeltaLoader(deltas)
            try:
                joiner.state_dict(step)
            except DeltaError as err:
                failed(_segment(step, complete, bases) if step in bases else [step], Reader.JOINER, err)
                continue
            follower = follower or joiner
    result.unreadable = [
        Unreadable(s, sorted(readers, key=lambda r: r.value), type(err).__name__, str(err))
        for s, (readers, err) in sorted(failures.items())
        if s in steps
    ]
    return result


def _check_objects(
    store: Store,
    step: int,
    per_rank: list[list[PartRef] | DeltaError],
    complete: list[int],
    bases: list[int],
    damaged: list[Damage],
) -> int:
    """Check each object of `step` against its marker and parse it; returns how many were read."""
    count = 0
    for rank, found in enumerate(per_rank):
        if isinstance(found, DeltaError):
            damaged.append(
                Damage(step, rank, "markers", type(found).__name__, str(found), ["every reader of the step"])
            )
            continue
        for ref in found:
            count += 1
            try:
                blob = store.read_object(ref, rank, len(per_rank))
                ChainReader(store).parse([ref], [blob], rank)
            except DeltaError as err:
                part = "bridge" if ref.bridge else ref.kind.value
                damaged.append(Damage(step, rank, part, type(err).__name__, str(err), _breaks(ref, complete, bases)))
    return count


def _objects(store: Store, step: int, world: int) -> list[list[PartRef] | DeltaError]:
    """Per rank, the step's committed parts, or the error its markers raise."""
    out: list[list[PartRef] | DeltaError] = []
    for rank in range(world):
        try:
            out.append(store.part_refs(step, rank, world))
        except DeltaError as err:
            out.append(err)
    return out


def _has(refs: list[PartRef] | DeltaError, kind: fmt.Kind) -> bool:
    return isinstance(refs, list) and any(r.kind == kind for r in refs)


def _segment(step: int, complete: list[int], bases: list[int]) -> list[int]:
    """The steps from `step` up to the next base: a joiner at any of them reads `step`'s part."""
    after = [b for b in bases if b > step]
    return [s for s in complete if step <= s < (after[0] if after else s + 1)]


def _breaks(ref: PartRef, complete: list[int], bases: list[int]) -> list[str]:
    """The readers a damaged part stops, in words."""
    segment = _segment(ref.step, complete, bases)
    joiners = f"a joiner at step {segment[0]}" + (f"-{segment[-1]}" if len(segment) > 1 else "")
    if ref.bridge:
        return [f"a follower in sync at step {ref.prev_step} (it falls back to the base at {ref.step})"]
    if ref.kind == fmt.Kind.BASE:
        return [joiners]
    return [f"a follower in sync at step {ref.prev_step}", joiners]


def _loaded(store: Store, step: int) -> DeltaLoader | None:
    loader = DeltaLoader(store)
    try:
        loader.state_dict(step)
    except DeltaError:
        return None
    return loader


@contextmanager
def _fallback_cause() -> Iterator[list[DeltaError]]:
    """The error that made a loader fall back to a base (it logs it, then tries the base, which
    is hidden here and fails with an error of its own)."""
    cause: list[DeltaError] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            args = record.args if isinstance(record.args, tuple) else ()
            cause.extend(a for a in args if isinstance(a, DeltaError))

    logger, handler = logging.getLogger("lightning_delta.loader"), Catch()
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # reported here, not logged
    try:
        yield cause
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
