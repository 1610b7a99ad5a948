"""Two gloo processes, first as the trainer's ranks, then as the workers of one rollout replica:

    python -m torch.distributed.run --nproc-per-node 2 tests/replica_job.py STORE OUT

Both ranks train identical TinyLM replicas (same seed, same data) and publish their halves of the
chain.  Then both load steps through one `DeltaLoader(process_group=...)`, each fetching about
half of the objects, and follow the chain together.  Then each binds a module of its own
(`modules`): a patch worker 1 cannot reproduce from its module is refused by both workers before
either writes, and both follow with the same catch-up decisions although worker 1 lists fewer
steps.  Each writes OUT/rank-R.json: what it fetched, and whether every tensor it rebuilt equals
its own trainer state bit for bit.  Last, one value of step 7 is forged (tests/forge.py) and both
workers must refuse it by the trainer's checksum.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import jobs
from forge import forge_value
from lightning_delta import (
    DeltaLoader,
    DeltaPublisher,
    FollowSettings,
    FullCheck,
    LoaderSettings,
    PublisherSettings,
    Store,
    StoreError,
)
from lightning_delta import format as fmt
from lightning_delta.objects import FsspecObjects
from lightning_delta.shards import named_tensors
from tinylm import TinyLM


def exact(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> bool:
    return got.keys() == truth.keys() and all(
        torch.equal(got[k].view(torch.int16), truth[k].view(torch.int16)) for k in truth
    )


class Unreachable(FsspecObjects):
    """A store whose base at step 1 cannot be read while `broken` is set."""

    broken = False

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        if self.broken and any(key.endswith(fmt.blob_path(1, r, 2)) for r in range(2)):
            raise StoreError(f"{self.url}: the endpoint is unreachable while reading {key}")
        return super().get(key, start, end)


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def held(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in named_tensors(module).items()}


def modules(store: str, truth: dict[int, dict[str, torch.Tensor]], rank: int) -> dict:
    """Module-bound workers of one replica: refusal before any write, then shared catch-up."""
    report: dict = {}
    warnings = Warnings()
    logging.getLogger("lightning_delta").addHandler(warnings)
    objects = Unreachable(store)
    loader = DeltaLoader(Store(objects), LoaderSettings(full_check=FullCheck.ON_DEMAND), process_group=dist.group.WORLD)
    torch.manual_seed(10 + rank)  # each worker's module starts elsewhere: only the chain makes it exact
    module = TinyLM()
    loader.apply_to(module, 3)
    report["module_3"] = loader.holds_module and exact(held(module), truth[3])

    # Worker 1's module differs from the trainer's at every position step 4 changes in the tensors
    # that lie wholly in trainer rank 0's share, which worker 0 decodes: only worker 1 can see it.
    manifest = Store(store).run().manifest
    whole = [
        manifest.tensors[s.tensor].name
        for payload in manifest.ranks[0]
        for s in payload
        if s.start == 0 and s.numel == manifest.tensors[s.tensor].numel
    ]
    changed = {k: truth[4][k].view(torch.int16) != truth[3][k].view(torch.int16) for k in whole}
    report["tampered"] = sum(int(c.sum()) for c in changed.values())
    if rank == 1:
        with torch.no_grad():
            for name, tensor in named_tensors(module).items():
                if name in changed:
                    tensor[changed[name]] = -tensor[changed[name]] - 1
    before = held(module)
    objects.broken = rank == 1  # and worker 1 cannot read the base that would rebuild step 4
    try:
        loader.apply_to(module, 4)
        report["refused"] = "ok"
    except Exception as err:
        report["refused"] = type(err).__name__
    report["untouched"] = exact(held(module), before)
    report["untouched_exact_3"] = exact(held(module), truth[3])
    objects.broken = False  # now the base rebuilds step 4 and heals worker 1's module
    warnings.messages.clear()
    loader.apply_to(module, 4)
    report["healed_exact_4"] = exact(held(module), truth[4])
    report["refusals_seen"] = sum("does not reproduce the trainer's checksum" in m for m in warnings.messages)

    # Worker 1 lists only up to step 6 (a listing that lags, as an object store's may): both
    # workers still take worker 0's decisions, catch up past step 5 and hand out step 6.
    if rank == 1:
        listed = loader.steps
        loader.steps = lambda after=None: [s for s in listed(after) if s < 7]  # type: ignore[method-assign]
    for followed in loader.follow(FollowSettings(poll_seconds=0.01, jump=False, max_staleness=1, catch_up=True)):
        followed.apply_to(module)
        report["caught_up"] = [followed.step, followed.behind]
        report["caught_up_exact"] = exact(held(module), truth[followed.step])
        break
    logging.getLogger("lightning_delta").removeHandler(warnings)
    return report


def forged(store: str, rank: int) -> list[str]:
    """One value of trainer rank 0's part of step 7 changed under a re-signed marker
    (tests/forge.py): both workers raise the trainer's checksum's error, whichever decoded it."""
    dist.barrier()  # every earlier read is done
    if rank == 0:
        forge_value(Store(store), 7, 0, 2)
    dist.barrier()
    try:
        DeltaLoader(store, process_group=dist.group.WORLD).state_dict(7)
    except Exception as err:
        return [type(err).__name__, str(err)]
    return ["ok", ""]


def main() -> None:
    store, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(1)
    truth = {}
    with DeltaPublisher(store, model, PublisherSettings(base_every=4)) as publisher:
        for step in range(1, 8):
            model(torch.randint(0, 97, (2, 9), generator=data)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            truth[step] = {k: v.detach().to(torch.bfloat16).clone() for k, v in named_tensors(model).items()}
            publisher.publish(step)
    dist.barrier()  # both halves of every step are committed

    replica = DeltaLoader(store, process_group=dist.group.WORLD)
    replica.steps()  # reads the run manifest: what follows counts parts and markers only
    report = {"exact": [], "bytes": [], "parts": []}
    for step in (3, 7):  # 3: from the base at 1; 7: from 3, through the bridge at 5
        got_step, tensors = replica.state_dict(step)
        report["exact"].append(got_step == step and exact(tensors, truth[step]))
        report["bytes"].append(replica.last_report.bytes_read)
        report["parts"].append(replica.last_report.parts_read)
    alone = DeltaLoader(store)  # one worker fetching everything, for comparison
    alone.steps()
    alone.state_dict(3)
    report["alone_bytes"] = alone.last_report.bytes_read
    following = DeltaLoader(store, process_group=dist.group.WORLD)
    report["followed"], report["followed_exact"] = [], []
    for followed in following.follow(FollowSettings(poll_seconds=0.01)):  # the newest, 7, then the end
        report["followed"].append(followed.step)
        report["followed_exact"].append(exact(followed.tensors, truth[followed.step]))
        break
    report["modules"] = modules(store, truth, rank)
    report["forged"] = forged(store, rank)
    jobs.report(out, rank, report)


if __name__ == "__main__":
    main()
    jobs.end()
