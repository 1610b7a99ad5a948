"""What the tests' multi-process jobs share (imported from their own folder, by any venv)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn


def end() -> NoReturn:
    """End a job's process without Python's finalization.  A gloo worker thread may still be
    dropping the tensors of the last collective; if it needs the GIL while the interpreter
    finalizes, torch aborts the process (SIGABRT, "terminate called without an active
    exception"; pytorch/pytorch#179291), failing a run whose work all succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(folder: str, rank: int, what: dict[str, Any]) -> None:
    """Write a rank's report (`folder/rank-R.json`, which the test reads) and leave the group."""
    import torch.distributed as dist

    with open(os.path.join(folder, f"rank-{rank}.json"), "w") as f:
        json.dump(what, f)
    dist.destroy_process_group()
