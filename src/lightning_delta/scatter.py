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
piece of a transfer, taken by its sender and checked by its receiver before it writes, covers those
too (a gather's order is the one every owned element already proves).  At TP=t a worker
receives about N/t elements, not every compressed part, however large t is.  (Broadcasting the
decoded planes would keep the walk as it was, at 1.5x the compressed bytes, but send every worker
everything.)

Gloo has no all_to_all, and a worker must not wait in a send for a peer that failed before it,
nor in a receive no peer sends.  The transfers are known before any part is decoded (every count
comes from the segment tables), so `agree` first exchanges every worker's outcome, which names each
transfer it will post (peer, tag, count): any failure so far, or a transfer one end does not agree
on, raises the same `DeltaError` on all before any element moves.  Then the elements travel point
to point in pieces of at most `ScatterSettings.piece_bytes` (`Scatter`): a reader sends each piece
as soon as it gathered it, payload by payload, while it decodes the next, and a receiver writes
each piece as soon as it arrived and its CRC-32 checks, so the memory a base step holds beyond the
engine for its transfers is `depth` pieces each way, not a share of the model.

Why it cannot hang: every piece has a number, the same on every worker (from the agreed plan,
ordered by payload, sender, receiver, piece), and every worker posts its sends in that order and
its receives in that order, each at most `depth` ahead of the oldest it has not finished.  The
smallest unfinished piece then has its send posted (its sender finished all its smaller ones, and
decoding waits for no peer) and its receive posted (likewise): it completes, and so does every
piece, by induction.  A reader that fails half-way (decoding, gathering) still posts every piece it
agreed to, each marked failed (`Scatter.close`); a receiver that fails writing keeps receiving and
drops the rest.  Only the transport failing can stop a worker's posts, as in any collective.

Why no wrong element is written or kept: a piece is written only if its CRC-32, over its elements
and its failure mark, is the one its sender took; a failed reader's error reaches every worker in
the checksum exchange that follows (`Decisions.sum`), so the whole group raises and holds no step;
and a base step's writes stand only once the group's checksums match.
"""

from __future__ import annotations

import json
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np
import torch
import torch.distributed as dist

from . import codec
from .errors import ChecksumError, ModelMismatchError
from .plan import Table
from .replica import exchange, exchange_bytes
from .sparse_walk import SEGMENT_FIELDS, Segments

__all__ = ["Key", "Scatter", "ScatterSettings", "Transfer", "agree", "peer_tables", "reader"]

Key = tuple[int, int]
"""A payload: (trainer rank, index in the rank's layout)."""

_HOST = torch.device("cpu")  # a gloo group moves host memory
_TRAILER = 4  # int16s after a piece's elements: its CRC-32 and its failure mark, a uint32 each
_SENT, _FAILED = 0, 1


@dataclass(frozen=True)
class ScatterSettings:
    """How a base step's decoded elements travel between a group's workers."""

    piece_bytes: int = 16 << 20
    """The most bytes of one piece of a transfer (its 8-byte trailer included).  A worker holds at
    most `depth` pieces it sends and `depth` it receives, however large the model: 2 x 2 x 16 MB."""
    depth: int = 2
    """Pieces each way in flight at once: the next is gathered (or written) while one travels."""

    def __post_init__(self) -> None:
        if self.piece_bytes < 2 * (_TRAILER + 1):
            raise ValueError(f"piece_bytes must hold an element and the trailer (>= 10), got {self.piece_bytes}")
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")

    @property
    def elements(self) -> int:
        """The elements of a full piece."""
        return self.piece_bytes // 2 - _TRAILER


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


Transfer = tuple[int, int, int]
"""(the worker at the other end, tag, elements): what a worker sends to a peer, or receives from the
worker that decodes them.  Tags tell a pair's transfers apart (a payload's place in the step)."""


@dataclass(frozen=True)
class _Piece:
    """Elements [start, start + count) of a transfer of tag `tag` between `sender` and `receiver`;
    `number`: its place in the group's order, and its gloo tag."""

    number: int
    tag: int
    sender: int
    receiver: int
    start: int
    count: int


class Scatter:
    """This worker's pieces of the transfers the group agreed on (`agree`), sent (`send`, `close`)
    and received (`receive`) in the group's order."""

    def __init__(self, sends: list[_Piece], receives: list[_Piece], depth: int, group: dist.ProcessGroup) -> None:
        self._sends, self._receives, self._depth, self._group = sends, receives, depth, group
        self._next = 0  # the next piece to send
        self._flight: deque[tuple[dist.Work, np.ndarray]] = deque()

    def send(self, tag: int, peer: int, fill: Callable[[int, np.ndarray], object]) -> None:
        """Send the pieces of transfer `tag` to `peer`, each filled by `fill(start, elements)` as it
        goes (the transfers in the order `agree` gave, each only once: out of order, the pieces
        skipped would be posted marked failed by `close` while no worker failed, so it raises)."""
        if not self._is_next(tag, peer):
            raise ValueError(f"transfer {tag} to worker {peer} is not the next one agreed: send in `agree`'s order")
        while self._is_next(tag, peer):
            piece = self._sends[self._next]
            self._free_slot()  # before its buffer: `depth` pieces sent at most are held
            buffer = np.empty(piece.count + _TRAILER, dtype=np.int16)
            fill(piece.start, buffer[: piece.count])
            self._post(piece, buffer, _SENT)

    def _is_next(self, tag: int, peer: int) -> bool:
        return self._next < len(self._sends) and (self._sends[self._next].tag, self._sends[self._next].receiver) == (
            tag,
            peer,
        )

    def _free_slot(self) -> None:
        if len(self._flight) >= self._depth:
            self._flight.popleft()[0].wait()

    def close(self) -> None:
        """Post every piece not sent yet, marked failed (this worker's failure reaches the group in
        the exchange after the transfers), and wait until every piece is sent."""
        while self._next < len(self._sends):
            piece = self._sends[self._next]
            self._free_slot()
            self._post(piece, np.zeros(piece.count + _TRAILER, dtype=np.int16), _FAILED)
        while self._flight:
            self._flight.popleft()[0].wait()

    def receive(self, write: Callable[[int, int, np.ndarray], None]) -> Exception | None:
        """Receive every piece sent to this worker, in order, and `write(tag, start, elements)` each
        one that arrived as its sender took it; returns the first failure (`ChecksumError` for a
        piece that did not), after which the rest are received and dropped, so no sender waits for
        a receive that never comes.  A piece its failed sender marked is dropped too: the sender's
        error reaches every worker after the transfers."""
        failure: Exception | None = None
        pending: deque[tuple[_Piece, np.ndarray, dist.Work]] = deque()
        pieces = iter(self._receives)
        for piece in islice(pieces, self._depth):
            pending.append(self._post_receive(piece))
        while pending:
            piece, buffer, request = pending.popleft()
            request.wait()
            if failure is None:
                failure = _written(piece, buffer, write)
            del buffer, request  # before the next is posted: `depth` pieces received at most are held
            following = next(pieces, None)
            if following is not None:
                pending.append(self._post_receive(following))
        return failure

    def _post(self, piece: _Piece, buffer: np.ndarray, mark: int) -> None:
        trailer = buffer[piece.count :].view(np.uint32)
        trailer[1] = mark
        trailer[0] = _crc(buffer[: piece.count], trailer[1])
        peer = dist.get_global_rank(self._group, piece.receiver)
        request = dist.isend(torch.from_numpy(buffer), dst=peer, group=self._group, tag=piece.number)
        assert request is not None  # None only for a rank outside `group`, which this one is not
        self._flight.append((request, buffer))
        self._next += 1

    def _post_receive(self, piece: _Piece) -> tuple[_Piece, np.ndarray, dist.Work]:
        buffer = np.empty(piece.count + _TRAILER, dtype=np.int16)
        source = dist.get_global_rank(self._group, piece.sender)
        request = dist.irecv(torch.from_numpy(buffer), src=source, group=self._group, tag=piece.number)
        assert request is not None
        return piece, buffer, request


def _written(piece: _Piece, buffer: np.ndarray, write: Callable[[int, int, np.ndarray], None]) -> Exception | None:
    """Write a received piece if it arrived as its sender took it (and it did not fail); why not."""
    try:
        elements, (crc, mark) = buffer[: piece.count], buffer[piece.count :].view(np.uint32)
        if _crc(elements, mark) != crc:
            raise ChecksumError(
                f"the elements worker {piece.sender} decoded for this worker (transfer {piece.tag}, from "
                f"its {piece.start}-th element) did not arrive as it sent them; the engine holds no step "
                "until it loads a base"
            )
        if mark == _SENT:
            write(piece.tag, piece.start, elements)
    except Exception as err:
        return err
    return None


def _crc(elements: np.ndarray, mark: np.uint32) -> int:
    """A piece's CRC-32: its elements, then its failure mark."""
    return zlib.crc32(np.uint32(mark).tobytes(), zlib.crc32(elements.data))


def agree(
    failure: BaseException | None,
    sending: Sequence[Transfer],
    receiving: Sequence[Transfer],
    settings: ScatterSettings,
    group: dist.ProcessGroup,
) -> Scatter:
    """Every worker's outcome before any part is decoded: if one failed (planning its transfers),
    every worker raises its error, as the same `DeltaError`.  The outcome is every transfer each
    worker will post, (peer, tag, count), and the size of its pieces, so every worker checks the
    same pairing: a receive no peer sends (it would wait forever), or a send of another size than
    its receiver expects, raises `ModelMismatchError` on every worker, before any element moves."""
    outcome: BaseException | bytes = failure or b""
    if failure is None:
        try:
            sends = [[peer, tag, count] for peer, tag, count in sending]
            receives = [[source, tag, count] for source, tag, count in receiving]
            outcome = json.dumps([sends, receives, settings.elements]).encode()
        except Exception as err:
            outcome = err
    plans = [json.loads(b) for b in exchange_bytes(outcome, group, _HOST)]
    _pair(plans)
    me, pieces = dist.get_rank(group), list[_Piece]()
    for tag, sender, receiver, count in sorted(
        (tag, worker, peer, count) for worker, (sends, _, _) in enumerate(plans) for peer, tag, count in sends
    ):
        size = max(1, plans[sender][2])
        for start in range(0, count, size):
            pieces.append(_Piece(len(pieces), tag, sender, receiver, start, min(size, count - start)))
    return Scatter(
        [p for p in pieces if p.sender == me], [p for p in pieces if p.receiver == me], settings.depth, group
    )


def _pair(plans: list[list[list[list[int]]]]) -> None:
    """Every worker's sends against every worker's receives (the same check on every worker)."""
    sent = [((worker, peer, tag), n) for worker, (sends, _, _) in enumerate(plans) for peer, tag, n in sends]
    expected = [
        ((source, worker, tag), n) for worker, (_, receives, _) in enumerate(plans) for source, tag, n in receives
    ]
    if len(dict(sent)) != len(sent) or len(dict(expected)) != len(expected):
        raise ModelMismatchError("a worker of the group posts two transfers of one tag to one peer")
    if dict(sent) != dict(expected):
        (worker, peer, tag), n = min(set(sent) ^ set(expected))
        what = "sends" if ((worker, peer, tag), n) in sent else "is expected to send"
        raise ModelMismatchError(
            f"worker {worker} {what} {n} elements of transfer {tag} to worker {peer}, which the other end does not "
            "agree on: the group's workers disagree on what each holds; restart the group"
        )
