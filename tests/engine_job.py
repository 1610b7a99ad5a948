"""Two processes, first the trainer's two ranks, then two tensor-parallel workers of the stand-in
engine (tests/fused.py) following the chain they wrote:

    python -m torch.distributed.run --nproc-per-node 2 tests/engine_job.py STORE OUT CONTEXT [APPLY]

Rank 0 damages a payload of step 7 between the two.  Each worker learns its view map, follows
steps 1, 2, 3, 6, 7, 8 and writes OUT/rank-R.json: whether its parameters equal its slices of the
trainer's tensors after each step, what it fetched, and the errors it met (and, with CONTEXT
`NONE` alone, `not_complete_yet`'s case).  CONTEXT `EXPONENT`:
CLASSED deltas, prepared (decoded and checked) then written; `NONE`: SPARSE deltas through
`update`, which walks each step in sync into the parameters, checked as it is written
(`sparse_walk`, or with APPLY `DEVICE` the device walk's Triton kernels under the interpreter),
and takes the walk back when the group's check fails.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import jobs
from conftest import replace_blob
from fused import Engine
from lightning_delta import DeltaError, DeviceError, Store, device_walk, replica, sparse_walk, torch_path
from lightning_delta import apply as walkers
from lightning_delta import format as fmt
from lightning_delta.apply import ApplyBackend
from lightning_delta.codec import Context
from lightning_delta.engine import EngineFollower, EngineStep
from lightning_delta.fetch import fetch_step
from test_engine import follower as following
from test_engine import publish


def main() -> None:
    store_url, out, context = sys.argv[1], sys.argv[2], Context[sys.argv[3]]
    apply = ApplyBackend[sys.argv[4]] if len(sys.argv) > 4 else None
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    truth = publish(store_url, context)  # as the trainer's two ranks, each its half
    dist.barrier()
    store = Store(store_url)
    if rank == 0:  # a payload bit of rank 1's part of step 7 that only its checksum can catch
        part = store.read_part(7, 1, 2)
        blob = bytearray(store.objects.get(fmt.blob_path(7, 1, 2)))
        blob[len(blob) - part.entries[-1].length // 2] ^= 0x01
        replace_blob(store, 7, 1, 2, bytes(blob))
    dist.barrier()
    torch_path._CHUNK = 64  # a step in sync in many chunks of changes, each checked, then written
    engine = Engine(rank, size)
    report: dict = {"exact": [], "parts": [], "errors": [], "untouched": []}
    if apply == ApplyBackend.DEVICE:  # worker 1's proof broke its device: both workers raise, none waits
        made = walkers.walker

        def broken(backend: Any, device: torch.device) -> Any:
            if rank == 1:
                raise DeviceError("the kernels' proof broke this worker's device (a stand-in)")
            return made(backend, device)

        walkers.walker = broken  # type: ignore[assignment]
        try:
            following(store_url, engine, apply, group=dist.group.WORLD)
        except DeltaError as err:
            report["init"] = [type(err).__name__, str(err)]
        walkers.walker = made
    follower = following(store_url, engine, apply, group=dist.group.WORLD)
    report["refused"] = sorted(follower.map.refused)
    warnings = warnings_of("lightning_delta.engine")
    report["walked"], report["on_device"] = 0, 0
    for cls in (sparse_walk.Walk, device_walk.DeviceWalk):

        def counted(walk: object, apply: Any = cls.apply) -> Any:
            report["walked"] += 1
            report["on_device"] += isinstance(walk, device_walk.DeviceWalk)
            return apply(walk)

        cls.apply = counted  # type: ignore[method-assign]
    report["walked_by_step"] = {}
    for step in (1, 2, 3, 6, 7, 8):
        before, walked = {k: v.clone() for k, v in engine.state().items()}, report["walked"]
        try:
            if context == Context.EXPONENT:
                prepared = follower.prepare(step)
                follower.write(prepared)
            elif apply == ApplyBackend.DEVICE and step == 3:
                prepared = audited_update(follower, step, report)
            else:
                prepared, _, _ = follower.update(step)
        except DeltaError as err:
            report["walked_by_step"][step] = report["walked"] - walked
            report["errors"].append([step, type(err).__name__])
            report["untouched"].append(all(torch.equal(before[k], v) for k, v in engine.state().items()))
            continue
        report["walked_by_step"][step] = report["walked"] - walked
        report["exact"].append(exact(engine, truth[step]))
        report["parts"].append(prepared.report.parts_read)
    follower.verify()
    engine.qkv.data.view(-1)[rank] += 1  # behind the follower's back, on every worker
    try:
        follower.verify()
    except DeltaError as err:
        report["tampered"] = type(err).__name__
    report["warned"] = sum("exponent context" in w for w in warnings)
    if context == Context.NONE and apply is None:
        report["not_yet"] = not_complete_yet(store_url, rank, size, truth)
    jobs.report(out, rank, report)


def not_complete_yet(store_url: str, rank: int, size: int, truth: dict[int, dict[str, torch.Tensor]]) -> list[list]:
    """A fresh follower holding step 3 while worker 1's blob of step 4 (trainer rank 1's part,
    which worker 1 alone fetches) is not there yet, its missing clock a fake one on each worker
    (group rank 0's verdict counts: worker 1's bound is 0): what each update did ([step asked,
    outcome, step held, engine untouched or exact, warnings, bytes this worker read])."""
    engine = Engine(rank, size)
    follower = following(store_url, engine, group=dist.group.WORLD)
    follower.update(3)
    now, bound = [0.0], follower.missing.missing_after
    follower.missing.clock = lambda: now[0]
    if rank == 1:  # alone, worker 1 would call the blob lost at once
        follower.missing.missing_after = 0.0
    warnings = warnings_of("lightning_delta")
    hole = os.path.join(store_url, fmt.blob_path(4, 1, 2))
    if rank == 0:
        os.rename(hole, hole + ".away")
    dist.barrier()
    seen: list[list] = []

    def update(step: int | None) -> None:
        before, read, said = {k: v.clone() for k, v in engine.state().items()}, follower.store.bytes_read, len(warnings)
        try:
            prepared, _, _ = follower.update(step)
            outcome, same = str(prepared.step), exact(engine, truth[prepared.step])
        except DeltaError as err:
            outcome, same = type(err).__name__, all(torch.equal(before[k], v) for k, v in engine.state().items())
        seen.append([step, outcome, follower.held_step, same, len(warnings) - said, follower.store.bytes_read - read])

    update(None)  # 8 (through 4) not complete yet, and nothing older than 4 newer than 3
    update(8)
    now[0] += bound / 2
    update(4)
    now[0] += bound / 2  # missing for missing_after: damage, tried from its base
    update(4)
    dist.barrier()
    if rank == 0:
        os.rename(hole + ".away", hole)
    dist.barrier()
    update(4)
    return seen


def warnings_of(logger: str) -> list[str]:
    """The messages of the warnings `logger` logs from now on (the list fills as they come)."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(logger).addHandler(handler)
    return said


def exact(engine: Engine, truth: dict[str, torch.Tensor]) -> bool:
    state = engine.state()
    return all(torch.equal(state[k].view(torch.int16), v.view(torch.int16)) for k, v in engine.expected(truth).items())


def host_only(at: str) -> bool:
    """Whether a read at `file:line` is in code that reads only host memory, by construction: the
    gloo exchange (the follower hands it the CPU) and the fetch that unpacks what it received."""
    file, line = at.rsplit(":", 1)
    for code in (replica.exchange, replica.exchange_bytes, fetch_step):
        lines, first = inspect.getsourcelines(code)
        if os.path.samefile(file, inspect.getsourcefile(code) or "") and first <= int(line) < first + len(lines):
            return True
    return False


def audited_update(follower: EngineFollower, step: int, report: dict) -> EngineStep:
    """`update` of a step in sync through the device walk, under test_kernels' sync audit: what
    waited for the device before the decision, besides the host reads of the group's exchange
    (`host_only`), and how many of those there were."""
    from test_kernels import audited

    settle = walkers.DeviceWalker.settle
    with audited() as syncs:

        def decision(self: walkers.DeviceWalker, payloads: Any, moved: Any) -> list[int]:
            syncs.seen.append(("the decision", ""))
            return settle(self, payloads, moved)

        walkers.DeviceWalker.settle = decision  # type: ignore[method-assign]
        try:
            prepared, _, _ = follower.update(step)
        finally:
            walkers.DeviceWalker.settle = settle  # type: ignore[method-assign]
    before = syncs.seen[: [what for what, _ in syncs.seen].index("the decision")]
    report["waits_before_decision"] = [f"{what} {at}" for what, at in before if not host_only(at)]
    report["host_exchange_reads"] = sum(host_only(at) for _, at in before)
    return prepared


if __name__ == "__main__":
    main()
    jobs.end()
