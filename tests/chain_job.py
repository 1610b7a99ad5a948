"""Two processes as the trainer's two ranks, publishing tests/test_engine.py's chain (8 steps,
bases at 1 and 5, with bridges), and nothing else:

    python -m torch.distributed.run --nproc-per-node 2 tests/chain_job.py STORE
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import jobs
from test_engine import publish


def main() -> None:
    dist.init_process_group("gloo")
    publish(sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    jobs.end()
