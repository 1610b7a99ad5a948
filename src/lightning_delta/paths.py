"""Which parts a reader fetches to reach a step: the cheapest path through one rank's chain.

A rank's parts form a line: each delta applies to the rank's previous part, and at a base step
after its first the rank writes both a base and a *bridge* (a delta against its previous part).
So a reader reaches step `t` either from a state it holds, through every delta after it, or from
a base `b <= t`, through the deltas after `b`; this module picks the cheaper by the parts' sizes,
which commit markers carry, so no payload is fetched to decide.  Pure functions: no I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .errors import ChainError
from .format import Kind, PartRef

__all__ = ["cheapest_path"]


def cheapest_path(target: int, held: int | None, parts_at: Callable[[int], Sequence[PartRef]]) -> list[PartRef]:
    """The parts to fetch, newest first, to rebuild `target` from `held` (a step whose state the
    reader has, or None) at the fewest bytes; empty when `target` is held.

    `parts_at(step)` lists the rank's committed parts at `step` (empty if there are none).  The
    walk goes back along the deltas from `target` and stops at `held`, at a hole, once the deltas
    alone cost more than the best path found, or, for a reader that holds nothing on the way, at
    the newest base: so a late joiner reads at most one base and the deltas after it.  ChainError
    if no path exists.
    """
    best: list[PartRef] | None = None
    best_cost = cost = 0
    path: list[PartRef] = []
    at = target
    while True:
        if at == held:
            return path if best is None or cost < best_cost else best
        parts = parts_at(at)
        base = min((p for p in parts if p.kind == Kind.BASE), key=lambda p: p.size, default=None)
        delta = min((p for p in parts if p.kind == Kind.DELTA), key=lambda p: p.size, default=None)
        if base is not None and (best is None or cost + base.size < best_cost):
            best, best_cost = [*path, base], cost + base.size
        if delta is None or (base is not None and (held is None or at < held)):
            break
        cost += delta.size
        if best is not None and cost >= best_cost:
            break
        assert delta.prev_step is not None and delta.prev_step < at  # markers are checked
        path.append(delta)
        at = delta.prev_step
    if best is None:
        link = f"step {path[-1].step} is a delta against step {at}, which" if path else f"step {at}"
        raise ChainError(f"{link} is not in the store (deleted, or its upload never finished) and no base after it is")
    return best
