"""Reading a chain: which steps are complete, which parts lead to one, and those parts, parsed once.

For each trainer rank, the reader plans the cheapest path from the step held (or from a base) by
the sizes in commit markers (`paths.cheapest_path`), fetches only the blobs on it, checks each
against its marker's SHA-256 and parses it with `format.parse_part`, the one parser.  Listings
are hints: a step counts once every rank's marker is there, and parts are never rewritten, so a
step seen complete stays complete until retention deletes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import format as fmt
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
            if listed:
                self.store.run()  # raises: steps without a manifest are not a chain
            return []
        if after is None:  # a full listing: steps deleted by retention drop out
            self._complete &= set(listed)
        for step in listed:
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
        world = self.store.run().world_size
        path = cheapest_path(step, held, lambda s: self.store.part_refs(s, rank, world))
        parts = tuple(self.store.fetch_part(ref, rank) for ref in reversed(path))
        if bar is not None:
            bar.update(1)
        return Fetched(parts, bool(path) and (path[0].bridge or path[0].kind == fmt.Kind.BASE))
