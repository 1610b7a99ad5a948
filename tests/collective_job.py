"""Two gloo processes in which one rank fails while the other waits in a collective, once for every
collective of the library:

    python -m torch.distributed.run --nproc-per-node 2 tests/collective_job.py WORKDIR

* claim: both ranks build a publisher on a prefix under a regular file, which rank 0 cannot write;
* load: the workers of a replica load a step, and rank 1's store fails;
* follow: the same replica follows, and rank 1's store fails at its second step;
* engine: two tensor-parallel workers of the stand-in engine prepare a step, rank 1's store fails;
* walk: the same workers walk a step into the engine in place, and rank 1's walk fails halfway;
  then rank 1 forgets the step it holds, and both load the next step from its base;
* raw_prepare, raw_init: rank 1's store raises an error it does not classify (not a `DeltaError`);
* keyerror: rank 1's engine no longer registers a parameter the walk writes;
* params_prepare, params_write: rank 1's engine cannot list its parameters, in a prepare, or only
  in the write that follows it;
* oom_write: rank 1 runs out of memory writing a step from its base, after the walk (as it walks
  the base's payloads whole, where it loads from a base part alone);
* damaged: rank 1 reads a base part with a byte flipped, which only it fetches;
* prefetch: rank 1's prefetcher fails to list the chain, while rank 0's finds a step; then the
  full check while the prefetchers poll the group.

Each rank writes WORKDIR/rank-R.json: per case, the error type it raised and the seconds it took;
and whether `exchange` hands every rank what each sent, for items that fit in the first broadcast's
head, that just fit, that just do not, more items than the head holds sizes for, and items large
enough to travel alone ("many").
"""

from __future__ import annotations

import itertools
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
from lightning_delta import (
    DeltaLoader,
    DeltaPublisher,
    FollowSettings,
    FormatError,
    PublisherSettings,
    Store,
    StoreError,
    sparse_walk,
)
from lightning_delta import apply as walks
from lightning_delta import format as fmt
from lightning_delta.engine import EngineFollower
from lightning_delta.objects import FsspecObjects
from lightning_delta.replica import exchange
from lightning_delta.torch_path import TorchPath
from lightning_delta.viewmap import ViewMap
from lightning_delta.whole_write import WholeWriter
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


class Flaky(FsspecObjects):
    """A store whose next `lists` listings fail as an unreachable endpoint does, whose reads raise
    an error the library does not classify (a bug, an unknown client error) while `raw` is set, and
    whose reads of the object `damaged` names come back with their last byte flipped."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.lists, self.raw, self.damaged = 0, False, ""

    def list(self, key: str) -> list[str]:
        if self.lists > 0:
            self.lists -= 1
            raise StoreError(f"{self.url}: the endpoint is unreachable while listing {key}")
        return super().list(key)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        if self.raw:
            raise RuntimeError(f"an unclassified failure reading {key}")
        data = super().get(key, start, end)
        if key == self.damaged and data:
            data = data[:-1] + bytes([data[-1] ^ 1])
        return data


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

    # rank 1 fails alone in the walk, after writing its second payload (as a malformed payload
    # would stop it), while rank 0 walks them all and waits in the walk's exchange: both raise,
    # and both take every walk back
    def reload(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            engine.load_weights(name, tensor)

    walker = EngineFollower(
        Store(fused), view_map, lambda: dict(engine.named_parameters()), reload, group=dist.group.WORLD
    )
    walker.update(1)
    before = {name: t.clone() for name, t in engine.state().items()}
    apply, calls = sparse_walk.Walk.apply, [0]

    def failing(walk: sparse_walk.Walk) -> int:
        moved = apply(walk)
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise FormatError("tensor payload holds fewer changes than its header says")
        return moved

    sparse_walk.Walk.apply = failing  # type: ignore[method-assign]
    report["walk"] = outcome(lambda: walker.update(2))
    sparse_walk.Walk.apply = apply  # type: ignore[method-assign]
    report["walk_calls"] = calls[0]
    report["walk_untouched"] = all(torch.equal(before[k], t) for k, t in engine.state().items())
    prepared, _, _ = walker.update(2)
    walker.verify()
    report["walk_then"] = [len(prepared.walked), prepared.step]
    if rank == 1:  # as a worker restarted alone would: it holds nothing, the other step 2
        walker._held = None
    prepared, _, _ = walker.update(3)
    walker.verify()
    report["differ_then"] = [prepared.held is None, prepared.step]  # both loaded step 3 from its base

    # worker 1's walk fails and so does its undo: it holds part of step 4, so both drop step 3 and
    # re-sync step 4 from its base together (worker 0 alone dropping nothing would leave 1 waiting)
    undo, undone = walks._CpuWalk.undo, [0]

    def broken_undo(walk: walks._CpuWalk) -> None:
        undone[0] += 1
        if rank == 1 and undone[0] == 1:
            raise RuntimeError("out of memory in the undo")
        undo(walk)

    calls[0] = 0
    sparse_walk.Walk.apply = failing  # type: ignore[method-assign]
    walks._CpuWalk.undo = broken_undo  # type: ignore[method-assign]
    report["undo"] = outcome(lambda: walker.update(4))
    sparse_walk.Walk.apply, walks._CpuWalk.undo = apply, undo  # type: ignore[method-assign]
    walker.verify()
    report["undo_then"] = [undone[0] > 0, walker.held_step]

    # the faults of one worker that are not `DeltaError`s, or that met a background thread: every
    # worker reaches the same decision, and then goes on
    flaky = Flaky(fused)

    def params() -> dict[str, torch.Tensor]:
        return dict(engine.named_parameters())

    mixed = EngineFollower(Store(flaky), view_map, params, reload, group=dist.group.WORLD)
    mixed.update(2)
    flaky.raw = rank == 1  # worker 1's reads fail with an error the store does not classify
    report["raw_prepare"] = outcome(lambda: mixed.prepare(3))
    other = Store(flaky) if rank == 1 else Store(fused)
    report["raw_init"] = outcome(lambda: EngineFollower(other, view_map, params, None, group=dist.group.WORLD))
    flaky.raw = False

    if rank == 1:  # a parameter the engine no longer registers: a KeyError in a walk
        mixed._params = lambda: {k: v for k, v in params().items() if k != "o"}
    report["keyerror"] = outcome(lambda: mixed.update(3))
    mixed._params = params
    report["keyerror_then"] = [outcome(lambda: mixed.update(4))[0], mixed.held_step, outcome(mixed.verify)[0]]

    # worker 1's engine cannot list its parameters (its weights released, say), in the write alone
    # (its second call; the step's walk is taken back on both), then from the prepare on (which
    # falls back to the base, written in part on worker 0: both then hold no step); neither may
    # leave worker 0 waiting in an exchange, or pair its exchanges with others
    for case, fails_from in (("params_write", 2), ("params_prepare", 1)):
        asked = [0]

        def unlisted(fails_from: int = fails_from, asked: list[int] = asked) -> dict[str, torch.Tensor]:
            asked[0] += 1
            if rank == 1 and asked[0] >= fails_from:
                raise RuntimeError("the engine's weights were released")
            return params()

        mixed._params = unlisted
        before = {name: t.clone() for name, t in engine.state().items()}
        report[case] = outcome(lambda: mixed.update(5))
        report[case + "_untouched"] = all(torch.equal(before[k], t) for k, t in engine.state().items())
        report[case + "_asked"] = asked[0]
        report[case + "_held"] = mixed.held_step
        mixed._params = params
    report["params_then"] = [outcome(lambda: mixed.update(4))[0], mixed.held_step, outcome(mixed.verify)[0]]

    write_slice, walk_whole, oom_calls = TorchPath.write_slice, WholeWriter.walk, [0, 0]

    def out_of_memory(self: TorchPath, *args: object) -> bool:
        oom_calls[0] += 1
        raise torch.OutOfMemoryError("out of memory while writing a whole payload")

    def out_of_memory_walking(self: WholeWriter, *args: object) -> int:  # on one of the walk's threads
        oom_calls[1] += 1
        raise torch.OutOfMemoryError("out of memory while walking a base's payload")

    if rank == 1:  # torch's write of a whole payload, and the one-pass walk of a base's
        TorchPath.write_slice = out_of_memory  # type: ignore[method-assign]
        WholeWriter.walk = out_of_memory_walking  # type: ignore[method-assign]
    mixed._held = None  # both load step 5 from its base: every payload is written whole
    report["oom_write"] = outcome(lambda: mixed.update(5))
    TorchPath.write_slice, WholeWriter.walk = write_slice, walk_whole  # type: ignore[method-assign]
    report["oom_calls"] = oom_calls
    report["oom_held"] = mixed.held_step
    report["oom_then"] = [outcome(lambda: mixed.update(6))[0], mixed.held_step, outcome(mixed.verify)[0]]

    # a base step whose rank-1 part worker 1 alone reads damaged (a byte of a value, which the walk
    # would write before its checksum could refuse it): the SHA-256 of the worker that read it
    # refuses it on both, before anything is written; worker 0 never hashes that part
    flaky.damaged = fmt.blob_path(5, 1, 2) if rank == 1 else ""
    mixed._held = None
    before = {name: t.clone() for name, t in engine.state().items()}
    report["damaged"] = outcome(lambda: mixed.update(5))
    report["damaged_untouched"] = all(torch.equal(before[k], t) for k, t in engine.state().items())
    flaky.damaged = ""
    report["damaged_then"] = [outcome(lambda: mixed.update(6))[0], mixed.held_step, outcome(mixed.verify)[0]]

    if rank == 1:  # its prefetcher's first listing fails, while worker 0's finds step 8
        flaky.lists = 1
    mixed.prefetch(0.01)
    report["prefetch"] = outcome(lambda: mixed.update(None))
    report["prefetch_then"] = [mixed.held_step, outcome(mixed.verify)[0], flaky.lists]
    mixed.prefetch(0.001)  # no newer step: its prefetcher polls the group, a decision each time
    report["verify_prefetching"] = [outcome(mixed.verify)[0] for _ in range(20)]
    mixed.close()

    # `exchange` at the edges of its head (128 int64 slots: status, count, sizes, then the items
    # where they fit) and of the items that travel alone (1 MiB and more), with and without small
    # ones: every pair of these item sizes, one rank sending each
    shapes = [[], [3] * 3, [1000], [8 * 125], [8 * 125 + 1], [1] * 40, [1] * 126, [0] * 127, [5] * 200]
    shapes += [[1 << 20], [7, (1 << 20) + 3, 1 << 20, 9]]

    def items(shape: list[int], of: int) -> list[torch.Tensor]:
        return [(torch.arange(n) * (of + 3) + i).to(torch.uint8) for i, n in enumerate(shape)]

    report["many"] = []
    for mine, theirs in itertools.product(shapes, repeat=2):
        sent = [mine, theirs]
        received = exchange(items(sent[rank], rank), dist.group.WORLD, torch.device("cpu"))
        report["many"].append(
            all(
                len(got) == len(sent[r]) and all(torch.equal(a, b) for a, b in zip(got, items(sent[r], r), strict=True))
                for r, got in enumerate(received)
            )
        )
    jobs.report(work, rank, report)


if __name__ == "__main__":
    main()
    jobs.end()
