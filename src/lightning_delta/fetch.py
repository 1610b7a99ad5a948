"""One step's download, shared by an engine follower's group: each worker fetches the parts of a
share of the trainer ranks, checks them against their markers, and sends the others the blobs, or
the error it met, which every worker then raises, so each blob is hashed once in the group, by
the worker that read it.  A base part's payloads the group walks whole travel decoded instead, from
the worker that read them (`scatter`), not in its blob.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from . import codec
from . import format as fmt
from .errors import ChainError, SnapshotNotFoundError
from .group import Decisions
from .patch import RankState
from .plan import Plan
from .reader import ChainReader
from .replica import exchange

__all__ = ["HeldDiffers", "fetch_step"]


class HeldDiffers(ChainError):
    """The workers of a group hold different steps (every one of them raises it): each fetches
    the step again from its base."""


def fetch_step(
    reader: ChainReader, plan: Plan, decisions: Decisions, step: int, held: Sequence[RankState] | None, thin: bool
) -> tuple[list[tuple[fmt.Part, ...]], int, bool, frozenset[tuple[int, int]]]:
    """Every rank's parts (oldest first), the parts this worker fetched, whether the step is a
    base step, and (with `thin`) the payloads the group walks whole that travel decoded, from
    the worker that read them (`scatter`), not in the blobs; each worker fetches a share and
    sends the others its blobs (without those payloads), and the steps it holds: `ChainError`
    on every worker if they differ (each then fetches from a base)."""
    world = plan.run.world_size
    ours = range(decisions.rank, world, decisions.size)
    fetched: dict[int, tuple[list[fmt.PartRef], Sequence[bytes | memoryview]]] = {}
    scattered: dict[int, list[int]] = {}
    mine: list[Tensor] | BaseException
    try:
        if not reader.is_complete(step):
            raise SnapshotNotFoundError(f"step {step} is not completely published in {plan.url}")
        for rank in ours:
            fetched[rank] = reader.fetch_blobs(step, rank, held[rank].header.step if held else None)
            reader.check(*fetched[rank], rank)  # here only: a failure reaches the others in the exchange
        mine = []
        if decisions.group is not None:  # what the others need: the steps held here, and the blobs
            mine.append(codec.byte_view(json.dumps([s.header.step for s in held] if held else None).encode()))
            for rank, (refs, blobs) in fetched.items():
                if thin and held is None and len(refs) == 1:
                    blobs, scattered[rank] = _thinned(reader, plan, rank, refs, blobs)
                mine.append(codec.byte_view(json.dumps([[asdict(r) for r in refs], scattered.get(rank)]).encode()))
                mine += [codec.byte_view(b) for b in blobs]
    except Exception as err:
        mine = err
    if decisions.group is not None:
        received = exchange(mine, decisions.group, torch.device("cpu"))
        if len({bytes(pieces[0].numpy()) for pieces in received}) > 1:
            raise HeldDiffers("the workers of the group hold different steps")
        for src, pieces in enumerate(received):
            if src == decisions.rank:
                continue
            rest = iter(pieces[1:])
            for rank in range(src, world, decisions.size):
                described, whole = json.loads(bytes(next(rest).numpy()))
                refs = [_ref(r) for r in described]
                fetched[rank] = (refs, [next(rest).numpy().data for _ in refs])  # not copied
                if whole is not None:
                    scattered[rank] = whole
    elif isinstance(mine, BaseException):
        raise mine
    chains = [reader.parse(*fetched[rank], rank, checked=True) for rank in range(world)]
    base_step = any(refs and (refs[-1].bridge or refs[-1].kind == fmt.Kind.BASE) for refs, _ in fetched.values())
    whole = frozenset((rank, i) for rank, indices in scattered.items() for i in indices)
    return chains, sum(len(fetched[r][0]) for r in ours), base_step, whole


def _thinned(
    reader: ChainReader, plan: Plan, rank: int, refs: list[fmt.PartRef], blobs: Sequence[bytes | memoryview]
) -> tuple[list[bytes | memoryview], list[int]]:
    """A base part (checked) as the others receive it: without the payloads the group walks
    whole, which this worker decodes and sends each of them as elements (`scatter`); and
    which those payloads are."""
    (part,) = reader.parse(refs, blobs, rank, checked=True)
    whole = [i for i in range(len(part.payloads)) if plan.whole_walkable(rank, i, (part,))]
    if not whole:
        return list(blobs), whole
    entries = [dataclasses.replace(e, length=0) if i in whole else e for i, e in enumerate(part.entries)]
    payloads = [b"" if i in whole else bytes(p) for i, p in enumerate(part.payloads)]
    return [fmt.encode_blob(part.header, entries, payloads, part.probe)], whole


def _ref(fields: dict[str, Any]) -> fmt.PartRef:
    return fmt.PartRef(
        int(fields["step"]),
        fmt.Kind(fields["kind"]),
        None if fields["prev_step"] is None else int(fields["prev_step"]),
        int(fields["size"]),
        bool(fields["bridge"]),
        str(fields["sha256"]),
    )
