"""One step prepared against the state an engine follower holds, writing nothing: each payload of
each rank's chain routed to what writes it, and verified where it can be before a write.

- SPARSE payloads from the state held are walked in place by `write` (`plan.walkable`): with
  `verify`, the first step of each is checked here (`apply.check`); each is checked again as it
  is walked in;
- a base step's RAW payloads are walked whole (`plan.whole_walkable`, or sent decoded by the worker
  that read them: `scatter`), checked as they are written;
- the rest are decoded with torch a chunk at a time (`torch_path`) and verified here by the partial
  sums over the changes each worker owns, summed over the group.

A worker decodes against its own state and may fail alone: its error rides with the partial sums,
so every worker raises it.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence

from torch import Tensor

from . import apply as walks
from . import format as fmt
from .errors import ChainError, ChecksumError
from .group import Decisions
from .patch import RankState
from .plan import Plan
from .torch_path import TorchPath

__all__ = ["route_and_verify"]


def route_and_verify(
    plan: Plan,
    torch_path: TorchPath,
    walker: walks.Walker,
    decisions: Decisions,
    params: Mapping[str, Tensor],
    step: int,
    chains: Sequence[tuple[fmt.Part, ...]],
    held: Sequence[RankState] | None,
    scattered: Collection[tuple[int, int]],
    verify: bool,
) -> tuple[list[RankState], frozenset[tuple[int, int]], frozenset[tuple[int, int]], int]:
    """Every rank's state at `step` once `chains` (from `held`; None: from a base) are written, the
    payloads `write` walks in place and whole, and the elements it writes; `ChecksumError` (on
    every worker) where a payload verified here does not reproduce the trainer's checksum.  The
    payloads walked in place are checked only with `verify`, and of several steps only the first;
    those `scattered` travel decoded, from the worker that read them."""
    states: list[RankState] = []
    partials: list[int] = []
    expected: list[tuple[int, int, int, int]] = []
    outcome: Exception | None = None
    changed, local, walked, whole = 0, False, set[tuple[int, int]](), set[tuple[int, int]]()
    checked: list[walks.Payload] = []  # the walked payloads to check, all at once
    try:
        for rank, parts in enumerate(chains):
            first = parts[0].header if parts else None
            if (
                first is not None
                and first.kind == fmt.Kind.DELTA
                and (held is None or first.prev_step != held[rank].header.step)
            ):
                raise ChainError(f"rank {rank}: the chain does not reach a base or the step held")
            if parts and parts[-1].header.step != step:
                raise ChainError(f"rank {rank}: the chain ends at step {parts[-1].header.step}, not {step}")
            state = held[rank] if held else None
            for i in range(len(plan.run.payloads[rank])):  # one payload's patch at a time
                if state is not None and plan.walkable(rank, i, parts):
                    walked.add((rank, i))
                    changed += sum(part.entries[i].changed for part in parts)
                    if verify:  # the first step of the chain; each later one as it is walked
                        local = True
                        checked.append(plan.payload(rank, i, parts[0], state.checksums[i]))
                    continue
                if state is None and ((rank, i) in scattered or plan.whole_walkable(rank, i, parts)):
                    whole.add((rank, i))
                    if not verify:
                        changed += plan.views[rank][i].numel
                        continue
                local = True
                for patch in torch_path.patches(rank, i, parts, state, params, partials, expected):
                    changed += patch.changed
            if parts:
                state = RankState(parts[-1].header, parts[-1].probe, tuple(e.checksum for e in parts[-1].entries))
            assert state is not None  # no parts: the step is the one held
            states.append(state)
        if checked:
            partials += walks.check(walker, checked, functools.partial(plan.target, params))
            expected += [(*p.key, chains[p.key[0]][0].header.step, p.moved) for p in checked]
    except Exception as err:  # whatever it is (an out-of-memory, a bad index), the group hears of it
        outcome = err
    if outcome is not None and (decisions.group is None or not local):
        raise outcome  # from the bytes every worker holds (or no group): the same everywhere
    # decoded against its own state, a worker may fail alone: its error rides with the partial sums
    sums = decisions.sum(partials, outcome) if local else []
    for (rank, index, part_step, want), got in zip(expected, sums, strict=True):
        if got != want:
            raise ChecksumError(
                f"{plan.where(rank, index, part_step)} does not reproduce the trainer's checksum from the "
                "values the engine holds"
            )
    return states, frozenset(walked), frozenset(whole), changed
