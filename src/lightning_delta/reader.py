"""Reading a chain: which steps are complete, which parts lead to one, and those parts, parsed once.

For each trainer rank, the reader plans the cheapest path from the step held (or from a base) by
the sizes in commit markers (`paths.cheapest_path`), fetches only the blobs on it, checks each
against its marker's SHA-256 and parses it with `format.parse_part`, the one parser.  Listings
are hints: a step counts once every rank's marker is there, and parts are never rewritten, so a
step seen complete stays complete until retention deletes it.  On a store that fills out of order
(a replicated bucket), an object a step needs may not be there yet: that is `MissingObjectError`,
which a follower retries rather than counts as damage.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from . import format as fmt
from .errors import ChainError, ChecksumError, FormatError, MissingObjectError
from .paths import cheapest_path
from .store import Store

__all__ = ["ChainReader", "Fetched"]


@dataclass(frozen=True)
class Fetched:
    """One rank's parts from the state held (or a base) to a step."""

    parts: tuple[fmt.Part, ...]  # oldest first
    base_step: bool  # the step is a base step (its part is a base; a follower may read its bridge)


class ChainReader:
    """Lists, plans and fetches the parts of one store's chain."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._complete: set[int] = set()

    def steps(self, after: int | None = None) -> list[int]:
        """Complete steps, ascending; with `after`, only later ones.

        A poll lists the step folders and looks into only those not yet seen complete; with
        `after` it lists only the blocks from `after`'s on (see `Store.published_steps`).
        """
        listed = self.store.published_steps(after)
        run = self.store.manifest()
        if run is None:
            if listed:  # steps without a manifest: not a chain, or a replica that has not got it yet
                raise MissingObjectError(
                    f"{self.store.url} holds no {fmt.RUN_MANIFEST}: not a {fmt.PART_FORMAT} chain "
                    "(or a replicated store has not received it yet)",
                    fmt.RUN_MANIFEST,
                )
            return []
        if after is None:  # a full listing: steps deleted by retention drop out
            self._complete &= set(listed)
        # Newest first: a writer completes steps in commit order (a trainer, a mirror), so a step
        # looked at after a newer one found complete is complete too; oldest first, steps completed
        # during the poll would show a newer one without those before it (a replay would skip them).
        for step in reversed(listed):
            if step not in self._complete and self.store.is_complete(step, run.world_size):
                self._complete.add(step)
        return [s for s in listed if s in self._complete]

    def is_complete(self, step: int) -> bool:
        run = self.store.manifest()
        if run is None:
            return False
        if step not in self._complete and self.store.is_complete(step, run.world_size):
            self._complete.add(step)
        return step in self._complete

    def fetch(self, step: int, rank: int, held: int | None, bar: Any = None) -> Fetched:
        """The parts that rebuild `rank`'s part of `step` from the step `held` (or a base)."""
        refs, blobs = self.fetch_blobs(step, rank, held, bar)
        return Fetched(
            self.parse(refs, blobs, rank), bool(refs) and (refs[-1].bridge or refs[-1].kind == fmt.Kind.BASE)
        )

    def fetch_blobs(
        self, step: int, rank: int, held: int | None, bar: Any = None
    ) -> tuple[list[fmt.PartRef], list[bytes]]:
        """The refs and bytes of the parts on the cheapest path, oldest first, unchecked (`check`
        or `parse` checks them)."""
        world = self.store.run().world_size
        holes: list[int] = []

        def parts_at(at: int) -> list[fmt.PartRef]:
            refs = self.store.part_refs(at, rank, world)
            if not refs:
                holes.append(at)
            return refs

        try:
            path = cheapest_path(step, held, parts_at)[::-1]
        except ChainError as err:  # a hole with no base after it: a marker lost, or not there yet
            if not holes:
                raise
            raise MissingObjectError(str(err), fmt.commit_path(holes[-1], rank, world)) from None
        # Newest first: on a store that fills out of order the newest blob is the likeliest missing,
        # and finding that out first saves reading the others at every poll until it arrives.
        blobs = [self.store.read_object(ref, rank, world) for ref in reversed(path)][::-1]
        if bar is not None:
            bar.update(1)
        return path, blobs

    def check(self, refs: Sequence[fmt.PartRef], blobs: Sequence[bytes | memoryview], rank: int) -> None:
        """Each blob against its marker (size and SHA-256), before anything of it is parsed."""
        for ref, blob in zip(refs, blobs, strict=True):
            with self._located(ref, rank):
                fmt.verify_blob(blob, ref.marker)

    def parse(
        self, refs: Sequence[fmt.PartRef], blobs: Sequence[bytes | memoryview], rank: int, *, checked: bool = False
    ) -> tuple[fmt.Part, ...]:
        """Parts from blobs (fetched here or by another worker of a group): each checked against its
        marker (unless `checked`: the worker that fetched it did, and the group heard of a failure)
        and parsed by `format.parse_part`, and together a chain, oldest first, whose links follow
        the markers."""
        run = self.store.run()
        parts = []
        for ref, blob in zip(refs, blobs, strict=True):
            with self._located(ref, rank):
                if not checked:
                    fmt.verify_blob(blob, ref.marker)
                parts.append(fmt.parse_part(blob, ref, rank, run))
        for older, newer in itertools.pairwise(parts):
            if newer.header.prev_step != older.header.step:
                raise ChainError(f"rank {rank}: step {newer.header.step} does not follow step {older.header.step}")
        return tuple(parts)

    @contextlib.contextmanager
    def _located(self, ref: fmt.PartRef, rank: int) -> Iterator[None]:
        """A part's errors, prefixed with the object they are about."""
        try:
            yield
        except (FormatError, ChecksumError, ChainError) as err:
            where = f"{self.store.url}/{fmt.blob_path(ref.step, rank, self.store.run().world_size, bridge=ref.bridge)}"
            raise type(err)(f"{where}: {err}") from None
