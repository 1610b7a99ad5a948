"""Run under `torchrun --nproc-per-node=3` by tests/test_replica.py: `exchange` where two of three
ranks fail with different errors.  The first failing rank (by group rank) raises its own error,
every other rank that one, the later failing rank included, whatever order the errors arrive in.

Each rank writes WORKDIR/rank-R.json: per case, the error type it raised and its message.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import jobs
from lightning_delta import DeltaError, FormatError, StoreError
from lightning_delta.replica import exchange


def outcome(mine: list[torch.Tensor] | BaseException) -> list[str]:
    try:
        exchange(mine, dist.group.WORLD, torch.device("cpu"))
    except DeltaError as err:
        return [type(err).__name__, str(err)]
    return ["ok", ""]


def main() -> None:
    work = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fine = [torch.arange(5, dtype=torch.uint8)]
    report = {
        # ranks 1 and 2 fail; ranks 0 and 2 raise rank 1's error, not the last one received or their own
        "first": outcome([fine, StoreError("the endpoint is unreachable"), FormatError("part is truncated")][rank]),
        # ranks 0 and 2 fail: ranks 1 and 2 raise rank 0's
        "zero": outcome([FormatError("part is truncated"), fine, StoreError("the endpoint is unreachable")][rank]),
        "then": outcome(fine),  # no rank is left behind: the next exchange meets every rank
    }
    jobs.report(work, rank, report)


if __name__ == "__main__":
    main()
    jobs.end()
