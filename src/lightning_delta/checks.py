"""An engine follower's checks of the engine's weights against the trainer's checksums outside a
write, through the torch reference: each worker hashes what it owns, and the group sums the
partial sums in one exchange (`group.Decisions.sum`), which carries any worker's failure to all.

- `check_held`: the full check, every element held (`FullCheck`, `EngineFollower.verify`);
- `changes_differ`: a step verified ahead, while the engine served, against the values its changes
  will be written over now (a weight changed behind the follower's back meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from torch import Tensor

from . import format as fmt
from .errors import ChecksumError
from .group import Decisions
from .patch import RankState
from .plan import Plan
from .torch_path import PayloadPatch, TorchPath

__all__ = ["check_held", "changes_differ"]

_MASK64 = (1 << 64) - 1


def check_held(
    torch_path: TorchPath,
    plan: Plan,
    decisions: Decisions,
    params: Callable[[], Mapping[str, Tensor]],
    held: Sequence[RankState],
) -> None:
    """Rehash every payload the engine holds against the checksums of the states `held`: raises
    `ChecksumError` on every worker if any differs."""
    partials, expected, failure = [], [], None
    try:
        engine = params()
        for rank, state in enumerate(held):
            for i, view in enumerate(plan.views[rank]):
                partials.append(torch_path.owned_sum(view, engine))
                expected.append((rank, i, state.header.step, state.checksums[i]))
    except Exception as err:
        failure = err
    for (rank, i, step, want), got in zip(expected, decisions.sum(partials, failure), strict=True):
        if got != want:
            raise ChecksumError(
                f"rank {rank} payload {i}: the engine's weights no longer match the trainer's checksum of step "
                f"{step}: they were changed behind the follower's back; the next step is written whole"
            )


def changes_differ(
    torch_path: TorchPath,
    plan: Plan,
    decisions: Decisions,
    params: Callable[[], Mapping[str, Tensor]],
    chains: Sequence[tuple[fmt.Part, ...]],
    states: Sequence[RankState],
    held: Sequence[RankState],
    walked: Collection[tuple[int, int]],
) -> tuple[int, int] | None:
    """The first payload (trainer rank, payload) whose changes (`chains` from `held` to `states`)
    do not take the values the engine holds now to the trainer's checksums, on every worker, or
    None: partial sums over the owned changes, summed over the group.  The payloads `walked` are
    skipped (checked as they are written), and so are payloads shipped whole (checked by their own
    checksum).  A worker's failure raises on every worker."""
    partials, expected, failure = [], [], None
    try:
        engine = params()
        for rank, (parts, state, before) in enumerate(zip(chains, states, held, strict=True)):
            for i, view in enumerate(plan.views[rank]):
                if (rank, i) in walked:
                    continue
                moved, whole = 0, False
                for patch in torch_path.patches(rank, i, parts, before, engine):
                    if patch.index is None or patch.step is None:
                        whole = True
                        continue
                    moved += torch_path.partial(view, PayloadPatch(), patch.index, patch.step, engine)
                if not whole:
                    partials.append(moved & _MASK64)
                    expected.append((rank, i, (state.checksums[i] - before.checksums[i]) & _MASK64))
    except Exception as err:
        failure = err
    for (rank, i, want), got in zip(expected, decisions.sum(partials, failure), strict=True):
        if got != want:
            return rank, i
    return None
