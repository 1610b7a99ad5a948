"""Retention: delete the steps no kept base leads to, in an order that never strands a reader."""

from __future__ import annotations

from . import format as fmt
from .store import Store

__all__ = ["collect", "cutoff", "delete_steps", "is_base_step"]


def is_base_step(store: Store, step: int, world_size: int) -> bool:
    """Whether `step` is complete and every rank's part of it is a base: a chain starts there."""
    return store.is_complete(step, world_size) and all(
        store.read_marker(step, rank, world_size).kind == fmt.Kind.BASE for rank in range(world_size)
    )


def collect(store: Store, keep_bases: int, *, dry_run: bool = False) -> list[int]:
    """Delete every step older than the `keep_bases`-th newest complete base step.

    Nothing a reader can still rebuild from the kept bases is touched: every part after a complete
    base chains back no further than it.  Steps go newest first, each one's markers before anything
    else, so if the deleter dies at any moment every step that is still complete still rebuilds
    (what it leads back to is all older).  Returns the deleted steps (with `dry_run`, those it
    would delete, deleting nothing).
    """
    found = cutoff(store, keep_bases)
    doomed = [s for s in store.published_steps() if found is not None and s < found]
    if not dry_run:
        delete_steps(store, doomed)
    return doomed


def cutoff(store: Store, keep_bases: int) -> int | None:
    """The `keep_bases`-th newest complete base step, before which retention deletes everything;
    None while there are fewer."""
    if keep_bases < 1:
        raise ValueError(f"keep_bases must be >= 1, got {keep_bases}")
    run = store.manifest()
    if run is None:
        return None
    found = 0
    for step in reversed(store.published_steps()):
        if is_base_step(store, step, run.world_size):
            found += 1
            if found == keep_bases:
                return step
    return None


def delete_steps(store: Store, steps: list[int]) -> None:
    """Delete `steps` (ascending) in the order that never strands a reader: newest first, each
    one's markers before anything else (a mirror deletes what its source deleted this way too)."""
    for step in reversed(steps):
        folder = fmt.step_dir(step)
        store.objects.delete(f"{folder}/{n}" for n in store.objects.list(folder) if n.endswith(".commit"))
        store.objects.delete_prefix(folder)
