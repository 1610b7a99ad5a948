"""The decisions a tensor-parallel engine's workers take together: every worker reaches the same
one, or the same error.

A worker may fail alone (an out-of-memory, a store error, a payload its own state cannot take),
and the others must not wait for it in a collective it never reaches: every decision is one
exchange over the group's gloo group (`replica.exchange`), host bytes only, in which each worker
sends either its value or its error.  If any worker failed, every worker raises the first
failing worker's error (a `DeltaError` on all of them); otherwise each gets every value.
Without a group, a worker decides alone.  `Decisions` is a worker's handle on them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import DeltaError
from .replica import exchange_bytes

__all__ = ["Agreed", "Decisions", "decide", "gather_json", "sum_partials"]

_MASK64 = (1 << 64) - 1
_HOST = torch.device("cpu")  # a gloo group exchanges host memory


def decide(group: dist.ProcessGroup | None, value: int | BaseException) -> list[int]:
    """Every worker's integer `value`, by group rank."""
    if group is None:
        if isinstance(value, BaseException):
            raise value
        return [value]
    mine = value if isinstance(value, BaseException) else str(value).encode()
    return [int(v) for v in exchange_bytes(mine, group, _HOST)]


def sum_partials(group: dist.ProcessGroup | None, partials: list[int], failure: Exception | None = None) -> list[int]:
    """The group's sums of each partial checksum, mod 2**64; or, on every worker, the error
    `failure` of any worker that could not compute its partials."""
    if group is None:
        if failure is not None:
            raise failure
        return [p & _MASK64 for p in partials]
    mine = failure or np.array([p & _MASK64 for p in partials], dtype=np.uint64).tobytes()
    every = [np.frombuffer(b, dtype=np.uint64) for b in exchange_bytes(mine, group, _HOST)]
    return np.stack(every).sum(axis=0, dtype=np.uint64).tolist() if partials else []  # uint64 sums wrap


def gather_json(group: dist.ProcessGroup | None, value: object) -> list[Any]:
    """Every worker's `value` (JSON), or on every worker the error one met (`value` an exception)."""
    if group is None:
        if isinstance(value, BaseException):
            raise value
        return [value]
    mine = value if isinstance(value, BaseException) else json.dumps(value).encode()
    return [json.loads(b) for b in exchange_bytes(mine, group, _HOST)]


class Agreed(Exception):
    """The group's decision on a failure, reached in an exchange inside a decode (`error`, raised
    on every worker): the outcome exchange that follows it elsewhere is skipped, for a worker that
    failed before the decode has left it already."""

    def __init__(self, error: DeltaError) -> None:
        super().__init__(str(error))
        self.error = error


class Decisions:
    """One worker's decisions with its tensor-parallel group (`group`: a gloo group, or None for
    one worker), each one exchange that carries any worker's failure to all."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1

    def decide(self, value: int | Exception) -> list[int]:
        """Every worker's integer `value`, by group rank (`decide`)."""
        return decide(self.group, value)

    def sum(self, partials: list[int], failure: Exception | None = None) -> list[int]:
        """The group's sums of each partial checksum, mod 2**64; or, on every worker, the error
        `failure` of any worker that could not compute its partials (`sum_partials`)."""
        if isinstance(failure, Agreed):  # the group decided in a decode's exchange: no other exchange
            raise failure.error
        return sum_partials(self.group, partials, failure)

    def gather_json(self, value: object) -> list[Any]:
        """Every worker's `value` (JSON), or on every worker the error one met (`gather_json`)."""
        return gather_json(self.group, value)

    def agree(self, failure: Exception | None) -> None:
        """Every worker's outcome: returns where none failed, else raises on every worker the error
        of the first that did (`failure`, as a `DeltaError` naming it)."""
        if isinstance(failure, Agreed):  # the group decided in a decode's exchange: no other exchange
            raise failure.error
        if self.group is not None:
            exchange_bytes(failure or b"", self.group, _HOST)
        elif failure is not None:
            raise failure
