"""Two gloo processes, first as the trainer's ranks, then as the workers of one rollout replica:

    python -m torch.distributed.run --nproc-per-node 2 tests/replica_job.py STORE OUT

Both ranks train identical TinyLM replicas (same seed, same data) and publish their halves of the
chain.  Then both load steps through one `DeltaLoader(process_group=...)`, each fetching about
half of the objects, and follow the chain together.  Then each binds a module of its own
(`modules`): a patch worker 1 cannot reproduce from its module is refused by both workers before
either writes, and both follow with the same catch-up decisions although worker 1 lists fewer
steps.  Each writes OUT/rank-R.json: what it fetched, and whether every tensor it rebuilt equals
its own trainer state bit for bit.  Then both follow past a hole (`hole`): trainer rank 1's blob
of step 3 is not there yet, once until it comes, once until `missing_after`; trainer rank 0's blob
of step 7 never comes (6 lies below it); each worker misses a blob of its own share, of different
steps, until they come.  Last, one value of
step 7 is forged (tests/forge.py) and both workers must refuse it by the trainer's checksum.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
import time

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
from lightning_delta import follow as follow_module
from lightning_delta import format as fmt
from lightning_delta.incomplete import MissingClock
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


class Logged(logging.Handler):
    """The messages logged at `level` (WARNING) or above, and their levels, as they come."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.messages: list[str] = []
        self.levels: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.levels.append(record.levelno)


def held(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in named_tensors(module).items()}


def modules(store: str, truth: dict[int, dict[str, torch.Tensor]], rank: int) -> dict:
    """Module-bound workers of one replica: refusal before any write, then shared catch-up."""
    report: dict = {}
    warnings = Logged()
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


class Filling(FsspecObjects):
    """The chain as a store that fills out of order shows it: `hole` is not there before the
    `back`-th listing of the steps (None: never); at each listing, the bytes read before it and the
    keys read since the previous one."""

    def __init__(self, url: str, hole: str, back: int | None) -> None:
        super().__init__(url)
        self.hole, self.back = hole, back
        self.polls: list[tuple[int, list[str]]] = []
        self.keys: list[str] = []

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        if key == self.hole and (self.back is None or len(self.polls) < self.back):
            return None
        self.keys.append(key)
        return super().get(key, start, end)

    def list(self, key: str) -> list[str]:
        if key == "steps":
            self.polls.append((self.bytes_read, self.keys))
            self.keys = []
        return super().list(key)


def hole(store: str, truth: dict[int, dict[str, torch.Tensor]], hidden: str, back: int | None, bound: float) -> dict:
    """A fresh replica follower holding step 2 while the blob `hidden`, which this worker alone
    fetches (or which it never reads: it meets only the other's message), is not there yet, and
    steps 3 to 7 are listed.  The missing clock counts listings of the steps; `bound` is this
    worker's `missing_after` in listings (group rank 0's verdict counts), and the blob comes at the
    `back`-th listing.  What the first `next()` handed out ("timed out" where the follower ended
    without a step: the case's test fails, not every test of the job), the keys and bytes read
    between the first 7 listings (or the hand-out) with the bytes those keys hold in
    the store, the steps logged as not complete yet, and the warnings."""
    started = time.monotonic()
    objects = Filling(store, hidden, back)
    follow_module.MissingClock = lambda after: MissingClock(after, clock=lambda: len(objects.polls))  # type: ignore[assignment,misc]
    said, follows = Logged(logging.DEBUG), logging.getLogger("lightning_delta.follow")
    logging.getLogger("lightning_delta").addHandler(said)
    level = follows.level
    follows.setLevel(logging.DEBUG)
    loader = DeltaLoader(Store(objects), process_group=dist.group.WORLD)
    loader.state_dict(2)
    objects.polls[:] = []
    follower = loader.follow(FollowSettings(poll_seconds=0.001, timeout=60, missing_after=bound))  # timeout: a lost run
    handed: list | str = "timed out"
    try:
        followed = next(follower)
        handed = [followed.step, list(followed.skipped), followed.report.parts_read]
        handed.append(exact(followed.tensors, truth[followed.step]))
    except StopIteration:
        pass
    else:  # the reads of the step handed out end here, unless a listing ended them already
        objects.polls.append((objects.bytes_read, objects.keys))
    finally:
        follower.close()
        follows.setLevel(level)
        logging.getLogger("lightning_delta").removeHandler(said)
        follow_module.MissingClock = MissingClock  # type: ignore[misc]
    polls = objects.polls[:7]
    return {
        "handed": handed,
        "read": [
            [b - a, keys, sum(os.path.getsize(os.path.join(store, k)) for k in keys)]
            for (a, _), (b, keys) in itertools.pairwise(polls)
        ],
        "not_yet": [int(m[1]) for m in map(re.compile(r"step (\d+) is not complete yet").match, said.messages) if m],
        "warnings": [m for m, level in zip(said.messages, said.levels, strict=True) if level >= logging.WARNING],
        "seconds": time.monotonic() - started,
    }


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
    # trainer rank 1's blob of step 3 (worker 1's share) comes at the 7th listing (worker 1 alone
    # would call it lost at once); then it never comes, and worker 0's bound is 6 listings (worker 1
    # alone would wait 1000)
    report["back"] = hole(store, truth, fmt.blob_path(3, 1, 2), 7, 1000.0 if rank == 0 else 0.0)
    report["bound"] = hole(store, truth, fmt.blob_path(3, 1, 2), None, 6.0 if rank == 0 else 1000.0)
    # trainer rank 0's blob of step 7 never comes: 6, complete below the hole, is handed out
    report["below"] = hole(store, truth, fmt.blob_path(7, 0, 2), None, 1000.0)
    # each worker misses a blob of its own, worker 0 of step 6, worker 1 of step 3: both come at the 7th
    report["two"] = hole(store, truth, fmt.blob_path(6, 0, 2) if rank == 0 else fmt.blob_path(3, 1, 2), 7, 1000.0)
    report["forged"] = forged(store, rank)
    jobs.report(out, rank, report)


if __name__ == "__main__":
    main()
    jobs.end()
