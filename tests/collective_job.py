"""Two gloo processes in which one rank fails while the other waits in a collective, once for every
collective of the library:

    python -m torch.distributed.run --nproc-per-node 2 tests/collective_job.py WORKDIR

* claim: both ranks build a publisher on a prefix under a regular file, which rank 0 cannot write;
* load: the workers of a replica load a step, and rank 1's store fails;
* follow: the same replica follows, and rank 1's store fails at its second step;
* engine: two tensor-parallel workers of the stand-in engine prepare a step, rank 1's store fails.

Each rank writes WORKDIR/rank-R.json: per case, the error type it raised and the seconds it took;
and whether `exchange` hands every rank what each sent where a rank sends more items than the
first broadcast's head holds sizes for ("many").
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import jobs
from fused import Engine
from lightning_delta import DeltaLoader, DeltaPublisher, FollowSettings, PublisherSettings, Store, StoreError
from lightning_delta.engine import EngineFollower
from lightning_delta.objects import FsspecObjects
from lightning_delta.replica import exchange
from lightning_delta.viewmap import ViewMap
from tinylm import TinyLM


class Failing(FsspecObjects):
    """A store whose part objects stop answering after `answers` reads of them."""

    def __init__(self, url: str, answers: int) -> None:
        super().__init__(url)
        self.answers = answers

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        if key.endswith(".ldelta"):
            self.answers -= 1
            if self.answers < 0:
                raise StoreError(f"{self.url}: the endpoint is unreachable while reading {key}")
        return super().get(key, start, end)


def outcome(call: Callable[[], object]) -> list:
    started = time.monotonic()
    try:
        call()
    except Exception as err:
        return [type(err).__name__, time.monotonic() - started, str(err)[:200]]
    return ["ok", time.monotonic() - started, ""]


def main() -> None:
    work = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {}
    blocked = os.path.join(work, "file")
    if rank == 0:
        with open(blocked, "w") as f:
            f.write("a regular file, not a folder")
    dist.barrier()
    report["claim"] = outcome(lambda: DeltaPublisher(os.path.join(blocked, "store"), TinyLM()))

    chain = os.path.join(work, "chain")
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(chain, model, PublisherSettings(base_every=10)) as publisher:  # two trainer ranks
        for step in range(1, 5):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3 * torch.randn_like(p))
            publisher.publish(step)
    dist.barrier()

    def store(answers: int) -> Store:  # rank 1's fails after `answers` part reads
        return Store(Failing(chain, answers)) if rank == 1 else Store(chain)

    report["load"] = outcome(lambda: DeltaLoader(store(0), process_group=dist.group.WORLD).state_dict(2))

    def follow() -> None:
        loader = DeltaLoader(store(2), process_group=dist.group.WORLD)
        for followed in loader.follow(FollowSettings(poll_seconds=0.01, jump=False)):
            if followed.step == 4:
                return

    report["follow"] = outcome(follow)

    from test_engine import publish

    fused = os.path.join(work, "fused")
    publish(fused)  # as two trainer ranks
    dist.barrier()
    engine = Engine(rank, 2)
    specs = {t.name: (t.shape, torch.bfloat16) for t in Store(fused).run().manifest.tensors}
    view_map = ViewMap.learn(specs, engine.load_weights, dict(engine.named_parameters()))
    live = EngineFollower(
        Store(Failing(fused, 0)) if rank == 1 else Store(fused),
        view_map,
        lambda: dict(engine.named_parameters()),
        None,
        group=dist.group.WORLD,
    )
    report["engine"] = outcome(lambda: live.prepare(2))

    def items(of: int) -> list[torch.Tensor]:  # rank 0 sends 3 items, rank 1 forty, of every size
        return [torch.full((i * 7 % 11,), of * 100 + i, dtype=torch.uint8) for i in range(3 if of == 0 else 40)]

    received = exchange(items(rank), dist.group.WORLD, torch.device("cpu"))
    report["many"] = [[torch.equal(a, b) for a, b in zip(got, items(r), strict=True)] for r, got in enumerate(received)]
    with open(os.path.join(work, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    jobs.end()
