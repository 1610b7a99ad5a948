"""Tensor-parallel workers of the stand-in engine (tests/fused.py) joining a chain by its base
steps, each base decoded once in the group and scattered by owner (`lightning_delta.scatter`):

    python -m torch.distributed.run --nproc-per-node N tests/scatter_job.py STORE OUT

Ranks 0 and 1 publish as the trainer's two ranks (bases at steps 1, 3, 5 and 7), so N workers
share two parts: with N = 3 the last worker reads none and receives everything it holds.  Worker 0
damages a byte of rank 1's part of step 3 (its SHA-256 no longer matches its marker), and the last
byte of rank 1's part of step 5 with the marker re-signed (a store that lies consistently: only
the trainer's checksums catch it, after the elements were decoded and sent).  Each worker then
loads step 1; step 3; step 5; step 7 with the last worker failing as it writes what it received,
after the transfer; step 7 with worker 0 failing as it gathers its peers' elements, before it;
step 7 again; step 7 with every transfer changed in an element its receiver does not own; step 7
with worker 0 sending nothing of its first transfer; step 7 again; step 7 on one decoding thread,
each payload's pieces held back until the next payload's decode has begun.  Each writes
OUT/rank-R.json: whether its parameters equal its slices of the trainer's tensors, the error of
each failed load and the step held after it, and the trainer ranks whose payloads it decompressed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import fused
import jobs
from conftest import replace_blob
from lightning_delta import DeltaError, Store, snapshot, whole_walk, whole_write
from lightning_delta import format as fmt
from lightning_delta.codec import CodecOptions, Context
from lightning_delta.publisher import DeltaPublisher, PublisherSettings
from lightning_delta.scatter import ScatterSettings
from lightning_delta.sparse_walk import SEGMENT_FIELDS, Segments
from lightning_delta.whole_write import WholeWriter
from test_engine import follower as following

fused.HIDDEN = 48  # rows that 2 and 3 workers split evenly
# q, k, v and o a payload each, the norm and the rope one together: a part of several payloads,
# decoded one after another, one of them spanning two tensors
snapshot.SMALL = fused.DIM
PIECE = 1024
"""Bytes of a transfer's piece: a few pieces a transfer (a tensor of 48 x 48 elements, 4.6 KB)."""
PIPELINED = 30.0
"""Seconds a gathered piece waits for the next payload's decode to begin before it goes on unpipelined
(once: every later piece goes on at once)."""


def publish(url: str, group: dist.ProcessGroup) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 1-7 (bases at 1, 3, 5, 7), as the trainer's two ranks (group ranks 0 and 1)."""
    state, truth = fused.checkpoint(), {}
    settings = PublisherSettings(base_every=2, codec=CodecOptions(context=Context.NONE))
    with DeltaPublisher(url, lambda: state, settings, process_group=group) as publisher:
        for step in range(1, 8):
            g = torch.Generator().manual_seed(step)
            for tensor in state.values():
                bits = tensor.view(torch.int16).view(-1)
                bits[torch.rand(bits.numel(), generator=g) < 0.3] += 1
            truth[step] = {k: v.clone() for k, v in state.items()}
            publisher.publish(step)
    return truth


def unowned(segments: Segments | None) -> int | None:
    """Where in a peer's transfer (`segments`, its table) the first element it does not own is."""
    at = 0
    for row in segments.calls[:-1] if segments is not None else ():
        n = whole_walk.count(Segments(np.array([row], dtype=np.int64), segments.n))
        if n and not row[SEGMENT_FIELDS.index("owned")]:
            return at
        at += n
    return None


@contextlib.contextmanager
def corrupted(report: dict[str, Any]) -> Iterator[None]:
    """Every transfer this worker sends arrives with its first element the receiver does not own
    (a replicated norm) changed, in the piece that holds it, after its sender gathered it and took
    its CRC-32: the group's checksum does not count that element (`report["corrupted"]`: how many
    pieces)."""
    gather, isend = whole_walk.WholeWalk.gather, dist.isend
    gathered: dict[int, tuple[Segments, int, int]] = {}
    held: list[torch.Tensor] = []

    def gathering(self: whole_walk.WholeWalk, segments: Segments, start: int = 0, out: Any = None) -> np.ndarray:
        out = gather(self, segments, start, out)
        gathered[out.ctypes.data] = (segments, start, len(out))
        return out

    def sending(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        segments, start, n = gathered.pop(tensor.data_ptr(), (None, 0, 0))
        at = unowned(segments)
        if at is not None and start <= at < start + n:
            tensor = tensor.clone()
            tensor[at - start] ^= 1
            held.append(tensor)  # alive until the send is done
            report["corrupted"] = report.get("corrupted", 0) + 1
        return isend(tensor, *args, **kwargs)

    whole_walk.WholeWalk.gather, dist.isend = gathering, sending  # type: ignore[method-assign]
    try:
        yield
    finally:
        whole_walk.WholeWalk.gather, dist.isend = gather, isend  # type: ignore[method-assign]


@contextlib.contextmanager
def marked(report: dict[str, Any]) -> Iterator[None]:
    """The first piece worker 0 sends arrives marked failed (its trailer's mark set after its
    CRC-32 was taken), as a damaged trailer would: its receiver must refuse it by the CRC, not drop
    it as a failed sender's piece.  The follower then loads the base again, which goes through
    (`report["marked"]`: whether a piece was marked; `report["marked_log"]`: what was logged)."""
    isend, held = dist.isend, []
    logged = report.setdefault("marked_log", [])
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_delta").addHandler(handler)

    def sending(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 0 and not report.get("marked"):
            tensor = tensor.clone()
            tensor[-2:] = torch.tensor([1, 0], dtype=tensor.dtype)  # the mark, a little-endian uint32: failed
            held.append(tensor)  # alive until the send is done
            report["marked"] = True
        return isend(tensor, *args, **kwargs)

    dist.isend = sending
    try:
        yield
    finally:
        dist.isend = isend
        logging.getLogger("lightning_delta").removeHandler(handler)


@contextlib.contextmanager
def watched(report: dict[str, Any]) -> Iterator[None]:
    """What this worker does with the pieces, in order (`report["events"]`: ["gather", transfer],
    ["send", transfer] as a piece is posted, ["receive", transfer] as a receive is posted,
    ["write", transfer]; a transfer is its segment table's id, a receive's known once its piece is
    written, else None), and the largest piece posted either way (`report["largest"]`, bytes)."""
    gather, write, isend, irecv = whole_walk.WholeWalk.gather, whole_walk.Scattered.apply, dist.isend, dist.irecv
    events = report.setdefault("events", [])
    sending: dict[int, int] = {}  # a gathered piece's buffer -> its transfer
    receiving: dict[int, list[Any]] = {}  # a posted receive's buffer -> its event, until written

    def watching(call: Any, what: str) -> Any:
        def watched(*args: Any, **kwargs: Any) -> Any:
            event: list[Any] = [what, None]
            if isinstance(args[0], torch.Tensor):
                report["largest"] = max(report.get("largest", 0), args[0].numel() * args[0].element_size())
                if what == "send":
                    event[1] = sending.pop(args[0].data_ptr(), None)
                else:
                    receiving[args[0].data_ptr()] = event
            elif what == "gather":
                out = kwargs.get("out", args[3] if len(args) > 3 else None)
                event[1] = id(args[1])
                if out is not None:
                    sending[out.ctypes.data] = event[1]
            else:  # a written piece: its receive's transfer too
                event[1] = id(args[0]._segments)
                received = receiving.pop(args[0]._values.ctypes.data, None)
                if received is not None:
                    received[1] = event[1]
            events.append(event)
            return call(*args, **kwargs)

        return watched

    whole_walk.WholeWalk.gather = watching(gather, "gather")  # type: ignore[method-assign]
    whole_walk.Scattered.apply = watching(write, "write")  # type: ignore[method-assign]
    dist.isend, dist.irecv = watching(isend, "send"), watching(irecv, "receive")
    try:
        yield
    finally:
        whole_walk.WholeWalk.gather, whole_walk.Scattered.apply = gather, write  # type: ignore[method-assign]
        dist.isend, dist.irecv = isend, irecv


@contextlib.contextmanager
def pipelined(report: dict[str, Any]) -> Iterator[None]:
    """Each payload's pieces wait, as they are gathered for sending, until the decode of the payload
    after it has begun (at most `PIPELINED` seconds, a guard against a hang, not a timing): on one
    decoding thread, as a vLLM worker on one core has, that happens only where the next payload is
    decoded while this one's pieces are sent.  `report["overlapped"]`: for each piece, whether it
    waited its turn; `report["decodes"]`: the payloads this worker decoded."""
    walk, gather, threads = WholeWriter.walk, whole_walk.WholeWalk.gather, whole_write._threads
    began = threading.Condition()
    order: dict[int, int] = {}  # a walk's id: its place among this worker's decodes
    decodes = report.setdefault("decodes", [0])
    overlapped = report.setdefault("overlapped", [])

    def decoding(self: WholeWriter, *args: Any) -> Any:
        with began:
            decodes[0] += 1
            began.notify_all()
            at = decodes[0]
        share, walked = walk(self, *args)
        order[id(walked)] = at
        return share, walked

    def gathering(self: whole_walk.WholeWalk, *args: Any) -> np.ndarray:
        at, jobs = order[id(self)], report["jobs"]
        with began:  # after one wait in vain, the rest go on at once: the step ends well within its timeout
            wait = PIPELINED if all(overlapped) else 0
            overlapped.append(began.wait_for(lambda: decodes[0] > at or at == jobs, timeout=wait))
        return gather(self, *args)

    WholeWriter.walk, whole_walk.WholeWalk.gather = decoding, gathering  # type: ignore[method-assign]
    whole_write._threads = lambda: 1
    try:
        yield
    finally:
        WholeWriter.walk, whole_walk.WholeWalk.gather = walk, gather  # type: ignore[method-assign]
        whole_write._threads = threads


def main() -> None:
    store_url, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    trainer = dist.new_group([0, 1])  # every rank takes part in making it
    truth = publish(store_url, trainer) if rank < 2 else {}
    shared = [truth]
    dist.broadcast_object_list(shared, src=0)
    truth = shared[0]
    store = Store(store_url)
    if rank == 0:
        blob = bytearray(store.objects.get(fmt.blob_path(3, 1, 2)))
        blob[len(blob) // 2] ^= 0x01
        store.objects.put(fmt.blob_path(3, 1, 2), bytes(blob))  # its marker's SHA-256 refuses it
        blob = bytearray(store.objects.get(fmt.blob_path(5, 1, 2)))
        blob[-1] ^= 0x01  # the last mantissa byte of its last payload (stored raw)
        replace_blob(store, 5, 1, 2, bytes(blob))
    dist.barrier()
    engine = fused.Engine(rank, size)
    follower = following(store_url, engine, group=dist.group.WORLD, scatter=ScatterSettings(piece_bytes=PIECE))
    report: dict[str, Any] = {"exact": [], "errors": [], "messages": [], "decoded": set()}
    walk_whole = WholeWriter.walk

    calls = [0]

    def decoding(self: WholeWriter, trainer: int, *args: Any) -> Any:
        report["decoded"].add(trainer)
        calls[0] += 1
        return walk_whole(self, trainer, *args)

    WholeWriter.walk = decoding  # type: ignore[method-assign]

    def exact(step: int) -> bool:
        state = engine.state()
        return all(
            torch.equal(state[k].view(torch.int16), v.view(torch.int16))
            for k, v in engine.expected(truth[step]).items()
        )

    def load(step: int) -> None:
        follower.forget()  # a replica joining: it holds nothing
        try:
            follower.update(step)
            report["exact"].append([step, exact(step)])
        except DeltaError as err:
            report["errors"].append([step, type(err).__name__, follower.held_step])
            report["messages"].append(str(err))

    with watched(report):
        load(1)
    load(3)
    load(5)
    scattered_apply, gather = whole_walk.Scattered.apply, whole_walk.WholeWalk.gather
    written = [0]
    if rank == size - 1:  # fails writing what it received, at its second piece: mid-transfer

        def failing_apply(self: whole_walk.Scattered) -> int:
            written[0] += 1
            if written[0] == 2:
                raise MemoryError("out of memory writing the received elements")
            return scattered_apply(self)

        whole_walk.Scattered.apply = failing_apply  # type: ignore[method-assign]
    load(7)
    whole_walk.Scattered.apply = scattered_apply  # type: ignore[method-assign]
    report["written before failing"] = written[0]
    gathered = [0]
    if rank == 0:  # fails gathering its peers' elements, at its second piece: mid-transfer

        def failing_gather(self: whole_walk.WholeWalk, *args: Any) -> np.ndarray:
            gathered[0] += 1
            if gathered[0] == 2:
                raise MemoryError("out of memory gathering a peer's elements")
            return gather(self, *args)

        whole_walk.WholeWalk.gather = failing_gather  # type: ignore[method-assign]
    load(7)
    whole_walk.WholeWalk.gather = gather  # type: ignore[method-assign]
    report["gathered before failing"] = gathered[0]
    load(7)
    with corrupted(report):  # a transfer that arrives changed in elements its receiver does not own
        load(7)
    with marked(report):  # a piece that arrives marked failed, though its sender did not fail
        load(7)
    sends = WholeWriter.sends
    if rank == 0:  # plans to send nothing of its first transfer: its receiver would wait for it forever

        def dropping(self: WholeWriter, trainer: int, i: int) -> list[tuple[int, int]]:
            return sends(self, trainer, i)[1:]

        WholeWriter.sends = dropping  # type: ignore[method-assign]
    load(7)
    WholeWriter.sends = sends  # type: ignore[method-assign]
    before = calls[0]
    load(7)
    report["jobs"] = calls[0] - before  # the payloads this worker decodes in a step of 7
    with pipelined(report):  # a payload's pieces sent while the next one decodes
        load(7)
    report["decoded"] = sorted(report["decoded"])
    jobs.report(out, rank, report)


if __name__ == "__main__":
    main()
    jobs.end()
