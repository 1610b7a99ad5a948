"""A base step's whole payloads written by a follower's group in one pass each (`whole_walk`):
decoded, written and hashed together, on threads side by side (the walk and zstd release the GIL).

In a group, the worker that read a part decodes its payloads alone and sends each peer the elements
the peer's segment table holds (`scatter`), piece by piece as each payload is decoded, so each
payload is decompressed once in the group and the transfers overlap the decoding.  Every worker's
plan of transfers is exchanged before any element moves, and the owned shares of each payload's
checksum are summed over the group against the trainer's: a failure on any worker raises on every
worker.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice

import numpy as np
from torch import Tensor

from . import codec, scatter, whole_walk
from . import format as fmt
from .errors import ChecksumError
from .group import Decisions
from .plan import Plan, held_bits

__all__ = ["WholeWriter"]

Key = tuple[int, int]
"""(trainer rank, payload)."""


class WholeWriter:
    """One worker's writes of base steps walked whole (`Plan.whole_walkable`, or sent decoded by
    the worker that read them), over its plan and with its group."""

    def __init__(self, plan: Plan, decisions: Decisions, settings: scatter.ScatterSettings | None = None) -> None:
        self.plan, self.decisions = plan, decisions
        self.settings = settings or scatter.ScatterSettings()
        self.peers: dict[Key, list[whole_walk.Segments]] = {}
        """Every worker's tables, for the payloads this worker decodes for the others."""
        if decisions.group is not None and plan.walks_whole:  # the same on every worker: one exchange or none
            self.peers = scatter.peer_tables(plan.tables, decisions.group)
        self._counts: dict[Key, list[tuple[int, int]]] = {}
        self.wrote = False
        """Whether the last `write` got past its plan (then it may have written elements, even if it
        raised): a failure while planning, on any worker, writes nothing."""

    def write(
        self, whole: Collection[Key], chains: Sequence[tuple[fmt.Part, ...]], step: int, params: Mapping[str, Tensor]
    ) -> bool:
        """Walk the payloads `whole` of base step `step` (`chains`: every rank's part) into the
        engine, side by side on threads, and check them: partial sums over the owned elements,
        summed over the group.  In a group, each payload's elements go to the peers that hold them
        piece by piece as it is decoded, and each piece received is written as it arrives
        (`scatter`).  A failure on any worker raises on all of them (the caller then holds no
        step).  Returns whether a kept copy changed."""
        self.wrote = False
        if not whole:
            return False
        keys = sorted(whole)
        jobs, expected, kept = [], [], False
        sending: list[scatter.Transfer] = []  # (peer, tag, elements)
        receiving: list[scatter.Transfer] = []  # (worker that decodes it, tag, elements)
        arrays: dict[str | int, np.ndarray] = {}
        failure: Exception | None = None
        try:
            for at, (rank, i) in enumerate(keys):  # `at` tags its transfers too
                table = self.plan.table(rank, i)
                assert table is not None
                expected.append((rank, i, chains[rank][0].entries[i].checksum))
                holds = whole_walk.count(table[0])
                for name in table[1] if holds else ():
                    if isinstance(name, int):
                        kept = True
                        self.plan.keep(name)
                source = scatter.reader(rank, self.decisions.size)
                if source == self.decisions.rank and (holds or self.decisions.group is not None):
                    jobs.append((at, rank, i))
                    sending += [(peer, at, n) for peer, n in self.sends(rank, i)]
                elif source != self.decisions.rank and holds:
                    receiving.append((source, at, holds))
        except Exception as err:
            failure = err
        partials = [0] * len(keys)
        group = self.decisions.group
        # in a group, past the agreement every worker posts every piece it agreed to
        scattering = scatter.agree(failure, sending, receiving, self.settings, group) if group is not None else None
        self.wrote = failure is None

        def write_piece(at: int, start: int, values: np.ndarray) -> None:
            partials[at] += self.scattered(*keys[at], values, params, arrays, start)

        threads = max(1, _threads())
        with ThreadPoolExecutor(max_workers=threads + 1) as pool:
            received = pool.submit(scattering.receive, write_piece) if scattering is not None else None
            ahead: deque[tuple[int, int, int, Future[tuple[int, whole_walk.WholeWalk]]]] = deque()
            try:
                queue = iter(jobs if failure is None else ())
                for job in islice(queue, threads):  # planes held: `threads` decoding, one sending
                    ahead.append((*job, pool.submit(self.walk, *job[1:], chains[job[1]][0], params, arrays)))
                while ahead:
                    at, rank, i, future = ahead.popleft()
                    partials[at], walk = future.result()
                    for job in islice(queue, 1):  # decoded while this one's pieces are gathered and sent
                        ahead.append((*job, pool.submit(self.walk, *job[1:], chains[job[1]][0], params, arrays)))
                    for peer, _ in self.sends(rank, i):
                        assert scattering is not None  # a worker without a group sends nothing
                        scattering.send(at, peer, functools.partial(walk.gather, self.peers[rank, i][peer]))
                    del walk, future  # its planes
            except Exception as err:
                failure = failure or err
                for *_, future in ahead:
                    future.cancel()
            if scattering is not None:
                try:
                    scattering.close()  # what is left unsent, marked failed
                except Exception as err:
                    failure = failure or err
            if received is not None:
                try:
                    failure = failure or received.result()
                except Exception as err:
                    failure = failure or err
        for (rank, i, want), got in zip(expected, self.decisions.sum(partials, failure), strict=True):
            if got != want:
                raise ChecksumError(
                    f"{self.plan.where(rank, i, step)} does not reproduce the trainer's checksum; the engine "
                    "holds no step of the chain until it is loaded from a base"
                )
        return kept

    def sends(self, rank: int, i: int) -> list[tuple[int, int]]:
        """(peer, elements) of each peer that holds elements of payload `i` of `rank` (which this
        worker reads), from the peers' tables: known before any part is decoded."""
        if self.decisions.group is None:
            return []
        if (rank, i) not in self._counts:
            self._counts[rank, i] = [
                (q, n)
                for q, t in enumerate(self.peers.get((rank, i), []))
                if q != self.decisions.rank and (n := whole_walk.count(t))
            ]
        return self._counts[rank, i]

    def walk(
        self, rank: int, i: int, part: fmt.Part, params: Mapping[str, Tensor], arrays: dict[str | int, np.ndarray]
    ) -> tuple[int, whole_walk.WholeWalk]:
        """Payload `i` of `rank`'s whole walk: this worker's share of its checksum, and the walk,
        which gathers what each peer holds of it (in a group, where this worker read the part)."""
        view, table = self.plan.views[rank][i], self.plan.table(rank, i)
        assert table is not None
        packed = codec.parse(part.payloads[i], view.numel)
        if packed.dtype != view.dtype:
            where = f"{self.plan.url} rank {rank} step {part.header.step}: payload {i}"
            raise fmt.FormatError(f"{where} is {packed.dtype}, expected {view.dtype}")
        walk = whole_walk.WholeWalk(packed, table[0], self._targets(table[1], params, arrays))
        return walk.apply(), walk

    def scattered(
        self,
        rank: int,
        i: int,
        values: np.ndarray,
        params: Mapping[str, Tensor],
        arrays: dict[str | int, np.ndarray],
        start: int,
    ) -> int:
        """A piece of payload `i` of `rank`'s elements this worker holds, from the `start`-th, as
        the worker that read it sent them: written, and its share of this worker's checksum."""
        table = self.plan.table(rank, i)
        assert table is not None
        return whole_walk.Scattered(values, table[0], self._targets(table[1], params, arrays), start).apply()

    def _targets(
        self, names: list[str | int], params: Mapping[str, Tensor], arrays: dict[str | int, np.ndarray]
    ) -> list[np.ndarray]:
        """The arrays a table names: a parameter, or the kept copy of a refused tensor."""
        for name in names:
            if name not in arrays:  # threads may both fill it: the same array either way
                arrays[name] = (
                    held_bits(params[name], name).numpy() if isinstance(name, str) else self.plan.kept[name].numpy()
                )
        return [arrays[name] for name in names]


def _threads() -> int:
    """Payloads walked whole at once: the cores this process may run on (the walk and zstd release the GIL)."""
    return len(os.sched_getaffinity(0))
