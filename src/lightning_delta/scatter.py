"""A base step decompressed once in a tensor-parallel group: the worker that read a part decodes
it, and sends each worker only the elements that worker holds.

Each worker of a group reads and hashes a share of the trainer's parts (`EngineFollower._fetch`).
A RAW payload's planes are single zstd frames that a worker cannot enter at its slice, so a group
whose workers each walked every part would decompress the model once per worker.  Instead the
worker that read a part decompresses it alone, walks its own slices (`whole_walk.WholeWalk`), and
gathers for each peer the elements the peer's segment table holds, in the order the peer's walk
visits them (`WholeWalk.gather`, 2 bytes each); the peer writes them (`whole_walk.Scattered`) and
hashes the ones it owns as its own walk would have, so the group's sum of the owned shares still
checks every owned element, the transfer included.  A replicated element, or a kept copy of a
refused tensor, written by a worker that does not own it is not in that sum: the CRC-32 of each
transfer, taken by its sender and checked by its receiver before it writes, covers those too (a
gather's order is the one every owned element already proves).  At TP=t a worker
receives about N/t elements, not every compressed part, however large t is.  (Broadcasting the
decoded planes would keep the walk as it was, at 1.5x the compressed bytes, but send every worker
everything.)

Gloo has no all_to_all, and a worker must not wait in a send for a peer that failed before it,
nor in a receive no peer sends: `agree` first exchanges every worker's outcome, which names each
transfer it will post (peer, tag, count), so any failure, or any transfer one end does not agree
on, raises the same `DeltaError` on all; only then do the elements travel, point to point
(`Transfers.run`), from buffers allocated before the agreement.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import codec
from .errors import ChecksumError, ModelMismatchError
from .plan import Table
from .replica import exchange, exchange_bytes
from .sparse_walk import SEGMENT_FIELDS, Segments

__all__ = ["Key", "Transfer", "Transfers", "agree", "peer_tables", "reader"]

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


Transfer = tuple[int, int, np.ndarray]
"""(the worker at the other end, tag, elements): what a worker sends to a peer, or the buffer it
fills from the worker that decoded them.  Tags tell a pair's transfers apart (a payload's place in
the step)."""


class Transfers:
    """The transfers the group agreed on (`agree`): this worker's, each one paired with the other
    end's, and the CRC-32 of each buffer as its sender gathered it."""

    def __init__(
        self,
        sending: Sequence[tuple[int, int, torch.Tensor]],
        receiving: Sequence[tuple[int, int, np.ndarray, torch.Tensor]],
        sums: Mapping[tuple[int, int], int],
        group: dist.ProcessGroup,
    ) -> None:
        self._sending, self._receiving, self._sums, self._group = sending, receiving, sums, group

    def run(self) -> None:
        """Send each buffer and fill each one received, point to point; `ChecksumError` if one
        did not arrive as its sender gathered it.  Every worker posts all of its receives and sends
        before it waits for any, so none waits for another to reach a send; every buffer was
        allocated and every tensor made before the agreement, so only the transport can fail here."""
        requests = [
            dist.irecv(tensor, src=dist.get_global_rank(self._group, source), group=self._group, tag=tag)
            for source, tag, _, tensor in self._receiving
        ] + [
            dist.isend(tensor, dst=dist.get_global_rank(self._group, peer), group=self._group, tag=tag)
            for peer, tag, tensor in self._sending
        ]
        for request in requests:
            assert request is not None  # None only for a rank outside `group`, which this one is not
            request.wait()
        self._sending = []  # sent: the caller frees its buffers
        for source, tag, buffer, _ in self._receiving:
            if zlib.crc32(buffer.data) != self._sums[source, tag]:
                raise ChecksumError(
                    f"the elements worker {source} decoded for this worker (transfer {tag}) did not arrive as it "
                    "sent them; the engine holds no step until it loads a base"
                )


def agree(
    failure: BaseException | None,
    sending: Sequence[Transfer],
    receiving: Sequence[Transfer],
    group: dist.ProcessGroup,
) -> Transfers:
    """Every worker's outcome before any element travels: if one failed (decoding, gathering, or
    allocating what it receives), every worker raises its error, as the same `DeltaError`.  The
    outcome is every transfer each worker will post, (peer, tag, count) and a sent buffer's CRC-32,
    so every worker checks the same pairing: a receive no peer sends (it would wait forever), or a
    send of another size than its receiver expects, raises `ModelMismatchError` on every worker,
    before any element moves.  The CRC-32 checks, at the receiver, every element a worker writes
    from a transfer, those it does not own (a replicated one, a kept copy), which the group's
    checksum does not count, included."""
    outcome: BaseException | bytes = failure or b""
    posts: tuple[list[tuple[int, int, torch.Tensor]], list[tuple[int, int, np.ndarray, torch.Tensor]]] = ([], [])
    if failure is None:
        try:
            sends = [[peer, tag, len(values), zlib.crc32(values.data)] for peer, tag, values in sending]
            receives = [[source, tag, len(buffer)] for source, tag, buffer in receiving]
            posts[0].extend((peer, tag, torch.from_numpy(values)) for peer, tag, values in sending)
            posts[1].extend((source, tag, buffer, torch.from_numpy(buffer)) for source, tag, buffer in receiving)
            outcome = json.dumps([sends, receives]).encode()
        except Exception as err:
            outcome = err
    plans = [json.loads(b) for b in exchange_bytes(outcome, group, _HOST)]
    _pair(plans)
    me = dist.get_rank(group)
    sums = {(worker, tag): crc for worker, (sends, _) in enumerate(plans) for peer, tag, _, crc in sends if peer == me}
    return Transfers(*posts, sums, group)


def _pair(plans: list[list[list[list[int]]]]) -> None:
    """Every worker's sends against every worker's receives (the same check on every worker)."""
    sent = [((worker, peer, tag), n) for worker, (sends, _) in enumerate(plans) for peer, tag, n, _ in sends]
    expected = [((source, worker, tag), n) for worker, (_, receives) in enumerate(plans) for source, tag, n in receives]
    if len(dict(sent)) != len(sent) or len(dict(expected)) != len(expected):
        raise ModelMismatchError("a worker of the group posts two transfers of one tag to one peer")
    if dict(sent) != dict(expected):
        (worker, peer, tag), n = min(set(sent) ^ set(expected))
        what = "sends" if ((worker, peer, tag), n) in sent else "is expected to send"
        raise ModelMismatchError(
            f"worker {worker} {what} {n} elements of transfer {tag} to worker {peer}, which the other end does not "
            "agree on: the group's workers disagree on what each holds; restart the group"
        )
