"""A base step's whole payloads written by a follower's group in one pass each (`whole_walk`):
decoded, written and hashed together, on threads side by side (the walk and zstd release the GIL).

In a group, the worker that read a part decodes its payloads alone and sends each peer the elements
the peer's segment table holds (`scatter`), so each payload is decompressed once in the group.
Every worker's outcome is exchanged before any element moves, and the owned shares of each
payload's checksum are summed over the group against the trainer's: a failure on any worker raises
on every worker.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

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

    def __init__(self, plan: Plan, decisions: Decisions) -> None:
        self.plan, self.decisions = plan, decisions
        self.peers: dict[Key, list[whole_walk.Segments]] = {}
        """Every worker's tables, for the payloads this worker decodes for the others."""
        if decisions.group is not None and plan.walks_whole:  # the same on every worker: one exchange or none
            self.peers = scatter.peer_tables(plan.tables, decisions.group)

    def write(
        self, whole: Collection[Key], chains: Sequence[tuple[fmt.Part, ...]], step: int, params: Mapping[str, Tensor]
    ) -> bool:
        """Walk the payloads `whole` of base step `step` (`chains`: every rank's part) into the
        engine, side by side on threads, and check them: partial sums over the owned elements,
        summed over the group.  A failure on any worker raises on all of them (the caller then
        holds no step).  Returns whether a kept copy changed."""
        if not whole:
            return False
        jobs, expected, partials, kept = [], [], list[int](), False
        sending: list[tuple[int, int, np.ndarray]] = []  # (peer, tag, elements)
        receiving: list[tuple[int, int, np.ndarray]] = []  # (worker that decodes it, tag, buffer)
        arrays: dict[str | int, np.ndarray] = {}
        failure: Exception | None = None
        try:
            for at, (rank, i) in enumerate(sorted(whole)):  # `at` tags its transfers too
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
                elif source != self.decisions.rank and holds:
                    receiving.append((source, at, np.empty(holds, dtype=np.int16)))
            partials = [0] * len(expected)
            with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), _threads()))) as pool:
                futures = [
                    (at, pool.submit(self.walk, rank, i, chains[rank][0], params, arrays)) for at, rank, i in jobs
                ]
                for at, future in futures:
                    partials[at], gathered = future.result()
                    sending += [(peer, at, values) for peer, values in gathered]
        except Exception as err:
            failure = err
        if self.decisions.group is not None:
            # past it, every worker sends and receives
            transfers = scatter.agree(failure, sending, receiving, self.decisions.group)
            try:
                transfers.run()
                sending.clear()
                keys = sorted(whole)
                with ThreadPoolExecutor(max_workers=max(1, min(len(receiving), _threads()))) as pool:
                    writes = [
                        (at, pool.submit(self.scattered, *keys[at], values, params, arrays))
                        for _, at, values in receiving
                    ]
                    for at, written in writes:
                        partials[at] = written.result()
            except Exception as err:
                failure = err
        for (rank, i, want), got in zip(expected, self.decisions.sum(partials, failure), strict=True):
            if got != want:
                raise ChecksumError(
                    f"{self.plan.where(rank, i, step)} does not reproduce the trainer's checksum; the engine "
                    "holds no step of the chain until it is loaded from a base"
                )
        return kept

    def walk(
        self, rank: int, i: int, part: fmt.Part, params: Mapping[str, Tensor], arrays: dict[str | int, np.ndarray]
    ) -> tuple[int, list[tuple[int, np.ndarray]]]:
        """Payload `i` of `rank`'s whole walk: this worker's share of its checksum, and the
        elements each peer holds of it (in a group, where this worker read the part)."""
        view, table = self.plan.views[rank][i], self.plan.table(rank, i)
        assert table is not None
        packed = codec.parse(part.payloads[i], view.numel)
        if packed.dtype != view.dtype:
            where = f"{self.plan.url} rank {rank} step {part.header.step}: payload {i}"
            raise fmt.FormatError(f"{where} is {packed.dtype}, expected {view.dtype}")
        walk = whole_walk.WholeWalk(packed, table[0], self._targets(table[1], params, arrays))
        share = walk.apply()
        peers = self.peers.get((rank, i), []) if self.decisions.group is not None else []
        return share, [
            (q, walk.gather(t)) for q, t in enumerate(peers) if q != self.decisions.rank and whole_walk.count(t)
        ]

    def scattered(
        self, rank: int, i: int, values: np.ndarray, params: Mapping[str, Tensor], arrays: dict[str | int, np.ndarray]
    ) -> int:
        """Payload `i` of `rank`'s elements this worker holds, as the worker that read it sent them:
        written, and this worker's share of its checksum."""
        table = self.plan.table(rank, i)
        assert table is not None
        return whole_walk.Scattered(values, table[0], self._targets(table[1], params, arrays)).apply()

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
