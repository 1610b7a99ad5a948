"""A base step decompressed once in a tensor-parallel group: the worker that read a part decodes
it, and sends each worker only the elements that worker holds.

Each worker of a group reads and hashes a share of the trainer's parts (`EngineFollower._fetch`).
A RAW payload's planes are single zstd frames that a worker cannot enter at its slice, so a group
whose workers each walked every part would decompress the model once per worker.  Instead the
worker that read a part decompresses it alone, walks its own slices (`whole_walk.WholeWalk`), and
gathers for each peer the elements the peer's segment table holds, in the order the peer's walk
visits them (`WholeWalk.gather`, 2 bytes each); the peer writes them (`whole_walk.Scattered`) and
hashes the ones it owns as its own walk would have, so the group's sum of the owned shares still
checks every owned element, the transfer included.  (A replicated element, or a kept copy of a
refused tensor, written by a worker that does not own it is not hashed there: as before, when it
decoded its own copy, it rests on the decode, here on the gather's order.)  At TP=t a worker
receives about N/t elements, not every compressed part, however large t is.  (Broadcasting the
decoded planes would keep the walk as it was, at 1.5x the compressed bytes, but send every worker
everything.)

Gloo has no all_to_all, and a worker must not wait in a send for a peer that failed before it:
`agree` first exchanges every worker's outcome (any failure raises the same `DeltaError` on all),
and only then do the elements travel, point to point, in sizes every worker computed from the
same tables (`send_receive`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import codec
from .plan import Table
from .replica import exchange, exchange_bytes
from .sparse_walk import SEGMENT_FIELDS, Segments

__all__ = ["Key", "agree", "peer_tables", "reader", "send_receive"]

Key = tuple[int, int]
"""A payload: (trainer rank, index in the rank's layout)."""

_HOST = torch.device("cpu")  # a gloo group moves host memory


def reader(rank: int, size: int) -> int:
    """The worker of a group of `size` that reads trainer rank `rank`'s parts (as `_fetch` shares them)."""
    return rank % size


def peer_tables(tables: Mapping[Key, Table], group: dist.ProcessGroup) -> dict[Key, list[Segments]]:
    """Every worker's segment table of each payload, by group rank (every worker holds tables for
    the same payloads, `plan.segment_tables`): exchanged once, when the follower starts, so that
    the reader of a part knows what each peer holds of it."""
    keys = sorted(tables)
    mine: list[torch.Tensor] | Exception
    try:
        rows = [np.array(tables[key][0].calls[:-1], dtype=np.int64) for key in keys]  # the last: a sentinel
        mine = [codec.byte_view(r.tobytes()) for r in rows]
    except Exception as err:
        mine = err
    every = exchange(mine, group, _HOST)
    return {
        key: [
            Segments(np.frombuffer(bytes(pieces[j].numpy()), dtype=np.int64).reshape(-1, len(SEGMENT_FIELDS)), n)
            for pieces in every
        ]
        for j, key in enumerate(keys)
        for n in [tables[key][0].n]
    }


def agree(failure: BaseException | None, group: dist.ProcessGroup) -> None:
    """Every worker's outcome before any element travels: if one failed (decoding, gathering, or
    allocating what it receives), every worker raises its error, as the same `DeltaError`."""
    exchange_bytes(failure or b"", group, _HOST)


def send_receive(
    sending: Sequence[tuple[int, int, np.ndarray]],
    receiving: Sequence[tuple[int, int, np.ndarray]],
    group: dist.ProcessGroup,
) -> None:
    """Send each (peer, tag, elements) and fill each (source, tag, buffer), point to point; every
    worker posts all of its receives and sends before it waits for any, so none waits for another
    to reach a send.  Tags tell a pair's transfers apart (a payload's place in the step)."""
    requests = []
    for source, tag, buffer in receiving:
        requests.append(
            dist.irecv(torch.from_numpy(buffer), src=dist.get_global_rank(group, source), group=group, tag=tag)
        )
    for peer, tag, values in sending:
        requests.append(
            dist.isend(torch.from_numpy(values), dst=dist.get_global_rank(group, peer), group=group, tag=tag)
        )
    for request in requests:
        assert request is not None  # None only for a rank outside `group`, which this one is not
        request.wait()
