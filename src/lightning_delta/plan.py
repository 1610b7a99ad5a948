"""The plan of an engine follower's walks: which payloads the group walks in place, and this
worker's segment table of each (`sparse_walk.SEGMENT_FIELDS`), made once when the follower starts.

A table maps a payload's positions to where this worker holds them: a run of a parameter, or a
block of rows and columns of a 2-D one (a tensor-parallel slice), and the kept copy of a refused
tensor.  Every worker of a group walks the same payloads, or its partial sums would not line up:
a payload is walked only where every worker has a table for it and its walker takes it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch.distributed as dist

from . import sparse_walk
from .apply import Walker
from .group import gather_json
from .patch import PayloadView
from .viewmap import ViewMap

__all__ = ["Table", "segment_table", "segment_tables"]

log = logging.getLogger(__name__)

Table = tuple[sparse_walk.Segments, list[str | int]]
"""A payload's segment table and the arrays its rows name: a parameter by name, or the kept copy
of a refused tensor by its index in the manifest."""


def segment_tables(
    views: Sequence[Sequence[PayloadView]],
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    view_map: ViewMap,
    owned: Mapping[str, Sequence[bool]],
    rank: int,
    walker: Walker | None,
    group: dist.ProcessGroup | None,
) -> dict[tuple[int, int], Table]:
    """The payloads (trainer rank, payload) every worker of the group walks, with this worker's
    tables (none without a walker; every worker calls this together)."""
    tables = {}
    mine: list[tuple[int, int]] | Exception
    try:
        if walker is not None:
            for trainer, payloads in enumerate(views):
                for i, view in enumerate(payloads):
                    table = segment_table(view, names, shapes, view_map, owned, rank)
                    if table is not None and walker.takes(table[1]):
                        tables[trainer, i] = table
        mine = sorted(tables)
    except Exception as err:
        mine = err
    walkable = set(tables)
    theirs = gather_json(group, mine)
    for listed in theirs:
        walkable &= {(trainer, i) for trainer, i in listed}
    if tables and not walkable:
        log.warning(
            "lightning_delta: workers %s of the group walk no payload (no walker there: a device walk that failed its "
            "proof says so in that worker's log): every worker writes with torch (exact, slower)",
            [worker for worker, listed in enumerate(theirs) if not listed],
        )
    return {key: tables[key] for key in sorted(walkable)}


def segment_table(
    view: PayloadView,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    view_map: ViewMap,
    owned: Mapping[str, Sequence[bool]],
    rank: int,
) -> Table | None:
    """`view`'s table on this worker (group rank `rank`), or None where a tensor is held in a
    way a walk cannot address (neither runs nor 2-D blocks, or blocks side by side)."""
    rows: list[list[int]] = []
    arrays: dict[str | int, int] = {}
    for s, offset in zip(view.slices, view.offsets, strict=False):
        name, shape = names[s.tensor], shapes[s.tensor]
        if name not in view_map.boxes:  # the kept copy: counted once, by group rank 0
            kept = arrays.setdefault(s.tensor, len(arrays))
            rows.append([offset, offset + s.numel, kept, s.start, 0, 0, 0, 0, 0, 0, 0, int(rank == 0)])
            continue
        for box, mine in zip(view_map.boxes[name], owned[name], strict=True):
            param, first = arrays.setdefault(box.param, len(arrays)), box.run_start(shape)
            if first is not None:  # a run of the tensor
                lo, hi = max(first, s.start), min(first + box.numel, s.start + s.numel)
                geometry = [box.offset + lo - first, 0, 0, 0, 0, 0, 0, 0]
            elif len(shape) == 2 and box.strides[1] == 1:  # a block of rows and columns
                columns, row = shape[1], box.start[0]
                lo, hi = max(row * columns, s.start), min((row + box.shape[0]) * columns, s.start + s.numel)
                geometry = [box.offset, lo, columns, row, box.shape[0], box.start[1], box.shape[1], box.strides[0]]
            else:
                return None
            if hi > lo:
                rows.append([offset + lo - s.start, offset + hi - s.start, param, *geometry, int(mine)])
    rows.sort()
    if any(a[1] > b[0] for a, b in itertools.pairwise(rows)):
        return None  # several blocks of one tensor side by side: more than one segment a position
    rows_array = np.array(rows, dtype=np.int64).reshape(-1, len(sparse_walk.SEGMENT_FIELDS))
    return sparse_walk.Segments(rows_array, view.numel), list(arrays)
