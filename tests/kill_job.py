"""A publisher or a collector in a process of its own, for tests that SIGKILL it:

    python tests/kill_job.py publish URL FIRST [RUN_ID]   # publishes FIRST, FIRST + 1, ... until killed
    python tests/kill_job.py gc URL                        # collects with a slowed store until done

Each prints "ready" once it is about to touch the store, so a test can kill it at a random
moment of the work itself; a publisher also prints "committed FIRST" once its first step is.
The weights are a pure function of the step (`states`), so a test knows the truth of every step
without talking to this process.
"""

from __future__ import annotations

import sys
import time

import torch

import jobs
from lightning_delta import DeltaPublisher, PublisherSettings, Store
from lightning_delta.objects import FsspecObjects
from lightning_delta.retention import collect

BASE_EVERY = 5


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "a": torch.randn(20_000, generator=g),
        "b.weight": torch.randn(64, 300, generator=g),
        "norm": torch.ones(64),
    }
    return {k: v.to(torch.bfloat16) for k, v in state.items()}


def evolve(state: dict[str, torch.Tensor], step: int) -> None:
    """Step `step`'s update, in place: ~3% of elements move by one ULP, seeded by the step alone."""
    g = torch.Generator().manual_seed(step)
    for tensor in state.values():
        flat = tensor.view(-1).view(torch.int16)
        flat[torch.rand(flat.numel(), generator=g) < 0.03] += 1


def states(last: int) -> dict[int, dict[str, torch.Tensor]]:
    """The weights after each step up to `last`: the truth a test compares with."""
    state, out = initial(), {}
    for step in range(1, last + 1):
        evolve(state, step)
        out[step] = {k: v.clone() for k, v in state.items()}
    return out


class SlowObjects(FsspecObjects):
    """Each deleting call takes 20 ms, so a kill can land anywhere inside a collection."""

    def delete(self, keys) -> None:
        time.sleep(0.02)
        super().delete(keys)

    def delete_prefix(self, key: str) -> None:
        time.sleep(0.02)
        super().delete_prefix(key)


def main() -> None:
    command, url = sys.argv[1:3]
    if command == "gc":
        store = Store(SlowObjects(url))
        print("ready", flush=True)
        collect(store, keep_bases=1)
        print("done", flush=True)
        return
    step = int(sys.argv[3])
    run_id = sys.argv[4] if len(sys.argv) > 4 else None
    tensors = initial()
    for earlier in range(1, step):
        evolve(tensors, earlier)
    with DeltaPublisher(url, lambda: tensors, PublisherSettings(base_every=BASE_EVERY), run_id=run_id) as publisher:
        print("ready", flush=True)
        first = step
        while True:
            evolve(tensors, step)
            publisher.publish(step)
            if step == first:  # a moment a test can wait for: from here on a kill meets committed steps
                publisher.flush()
                print(f"committed {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main()
    jobs.end()
