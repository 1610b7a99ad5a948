"""The trainer-side engine: cache, diff on the device, upload in the background.

`DeltaPublisher.publish(step)` does on the calling thread only what must see the live weights:
cast the rank's own slices to `dtype` on their device, diff them against the cached copy from the
last publish and write the changed elements into the cache (a base step also takes a device-side
copy).  Two worker threads do the rest, pipelined: one packs on the device (a few bytes per
changed element; a base's byte planes and checksum), copies to the host (pinned memory, on a side
stream on CUDA, so the training stream never waits) and compresses, several payloads at once,
while the other uploads and commits the previous snapshot (s3fs sends large blobs as concurrent
multipart parts).  Their errors are raised on the next `publish` or at `close`.

At every base step after the first, the rank also publishes a bridge: the same step as a delta
against its previous part, committed before the base, so followers in sync never read a base.

Each rank's parts form their own chain (each delta names the same rank's previous part), so a
rank never waits for another: not to publish, and not to skip a step when its uploads fall behind.
The ranks agree on the run once, when the publisher is made (`claim`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import codec
from . import format as fmt
from .checksum import checksum, checksum_update
from .claim import RankLayout, claim
from .errors import PublishError, UnsupportedStrategyError
from .format import DType
from .merged import MergedTensors, is_peft_model, merged_tensors
from .records import enum_member
from .retention import collect
from .shards import OwnedSlice, check_readable, named_tensors, plan, read_slice
from .signing import SigningKey
from .store import Store, as_store

__all__ = [
    "Backlog",
    "DeltaPublisher",
    "PublishStats",
    "PublisherSettings",
    "UploadStats",
    "step_metrics",
]

log = logging.getLogger(__name__)

TensorSource = nn.Module | Mapping[str, Tensor] | Callable[[], Mapping[str, Tensor]]


class Backlog(str, Enum):
    """What `publish` does when `max_pending` snapshots are already waiting for upload."""

    BLOCK = "block"  # wait for the upload queue (every step is published)
    COALESCE = "coalesce"  # skip this step; the next published one diffs against the last published


@dataclass
class PublisherSettings:
    """A publisher's options, defined once: `DeltaPublisher`, both callbacks and Hydra's `delta`
    group take this dataclass (choices may be spelt as their names or values, as config files do)."""

    base_every: int = 25
    """A full base every this many steps, deltas in between; each base after the first comes with
    a bridge delta, so followers that are in sync never download a base."""
    dtype: DType = DType.bfloat16
    """The 16-bit type shipped; the trainer's masters are never touched."""
    codec: codec.CodecOptions = field(default_factory=codec.CodecOptions)
    backlog: Backlog = Backlog.BLOCK
    """What `publish` does when `max_pending` snapshots already wait for upload."""
    max_pending: int = 2
    """Snapshots that may wait for upload before `backlog` applies."""
    keep_bases: int | None = None
    """Retention: rank 0 deletes the steps older than the `keep_bases`-th newest complete base
    after each base it commits (`retention.collect`); None keeps every step."""
    signing_key: str | None = None
    """Path of the Ed25519 private key (`lightning-delta keygen`) that signs the run manifest, every
    commit marker and the heartbeat, so that followers holding its `.pub` load only this trainer's
    weights; never written to the chain.  None publishes an unsigned chain."""
    heartbeat_seconds: float = 10.0
    """With `signing_key`: rank 0 rewrites the signed heartbeat (newest step, time) this often, and
    after each commit, so followers tell a quiet trainer from withheld steps."""

    def __post_init__(self) -> None:
        try:
            dtype = DType.of(self.dtype) if isinstance(self.dtype, torch.dtype) else enum_member(DType, self.dtype)
        except ValueError:
            dtype = DType.int16  # not shipped either
        if not dtype.shipped:
            raise ValueError(f"dtype must be one of {[d.value for d in DType if d.shipped]}, got {self.dtype}")
        options = self.codec
        if isinstance(options, Mapping):  # a config's nested section
            options = codec.CodecOptions(**options)
        self.dtype = dtype
        self.codec = options
        self.backlog = enum_member(Backlog, self.backlog)
        if self.base_every < 1:
            raise ValueError(f"base_every must be >= 1, got {self.base_every}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.keep_bases is not None and self.keep_bases < 1:
            raise ValueError(f"keep_bases must be >= 1 or None, got {self.keep_bases}")
        if self.heartbeat_seconds <= 0:
            raise ValueError(f"heartbeat_seconds must be > 0, got {self.heartbeat_seconds}")


@dataclass(frozen=True)
class PublishStats:
    """What one `publish` call did on the calling thread."""

    step: int
    published: bool
    kind: fmt.Kind | None
    changed: int  # elements of this rank's slices that changed
    numel: int  # elements of this rank's slices
    diff_ms: float  # calling-thread time: cast, diff, cache update (a base: copy, checksum, pack)


@dataclass(frozen=True)
class UploadStats:
    """What the worker threads did for one published step."""

    step: int
    stored_bytes: int  # objects written for the step: blob, marker, and the bridge and its marker
    dense_bytes: int  # the same slices as plain `dtype`
    upload_ms: float  # from the start of packing to the commit (pack, copy, compress, hash, write)


_SMALL = 1 << 18
"""Slices of at most this many elements share one payload: one diff and one codec call for all.
Each codec call has a fixed cost of ~1 ms on a CPU, as much as 256K elements' diff and pack."""


@dataclass
class _Group:
    """The slices of one payload: a large slice alone, or all the small ones on one device."""

    specs: list[OwnedSlice]
    bits: Tensor  # `dtype` copy of the slices as last published, concatenated, on their device


@dataclass(frozen=True)
class _Piece:
    """One group of a snapshot as it leaves the training thread: only what must see the live
    weights is done there (the diff, and for a base a device-side copy); the worker packs."""

    snapshot: Tensor | None = None  # base: the group's values, a copy no later step writes to
    change: codec.Change | None = None  # delta, or a base's bridge
    whole: Tensor | None = None  # delta that may be stored RAW: the group's new values, unshared


@dataclass(frozen=True)
class _Job:
    header: fmt.PartHeader
    pieces: list[_Piece]
    probe: tuple[float, ...] | None
    bridge_from: int | None  # a base's bridge: the delta against this rank's previous part
    ready: torch.cuda.Event | None  # recorded on the training stream after the snapshot (CUDA)


@dataclass(frozen=True)
class _Blob:
    header: fmt.PartHeader  # complete
    data: bytes


@dataclass(frozen=True)
class _Encoded:
    part: _Blob
    bridge: _Blob | None  # committed before the base, so a complete step has it if it was written
    started: float  # when its encoding began (perf_counter)


_FAILED = _Encoded(_Blob(fmt.PartHeader("0" * 64, 0, None, fmt.Kind.BASE, 0, 1, 0.0, 0), b""), None, 0.0)
"""Stage one's word to stage two that a snapshot was lost: deltas wait for the next base."""


class _HostSide:
    """Where the worker packs and copies to the host without holding up the training stream.

    On CUDA the worker runs on a side stream that first waits for the snapshot's event, copies
    into pinned host memory asynchronously, and synchronizes only its own stream before the
    bytes are read.  On the CPU all of this is plain, synchronous torch code.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def mark(self) -> torch.cuda.Event | None:
        """On the training thread: an event that completes once the snapshot's kernels have run."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def stream(self, ready: torch.cuda.Event | None) -> Iterator[None]:
        """On the worker thread: the model's device (a thread starts on device 0) and the side
        stream, once the snapshot's kernels have run."""
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self.device):
            if ready is not None:
                self._stream.wait_event(ready)
            with torch.cuda.stream(self._stream):
                yield

    def copy(self, packed: codec.Packed) -> codec.Packed:
        if self._stream is None:
            return packed.cpu()
        sections = tuple(
            torch.empty(s.shape, dtype=s.dtype, pin_memory=True).copy_(s, non_blocking=True) for s in packed.sections
        )
        alternative = self.copy(packed.alternative) if packed.alternative else None
        return replace(packed, sections=sections, alternative=alternative)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class DeltaPublisher:
    """Publish a rank's share of a model's weights as a chain of bases and deltas.

    Args:
        store: fsspec URL (a local path works) or a `Store`.
        tensors: a module (its parameters and persistent float buffers; for a PEFT LoRA model
            the merged weights under the base model's names), a mapping of name to tensor, or a
            callable returning one; DTensor parameters are read shard by shard.
            Its names and shapes are the run's layout, fixed at construction.
        settings: schedule, dtype, codec, backlog and retention (`PublisherSettings`).
        storage_options: passed to fsspec with a URL.
        process_group: the ranks that share the upload; default the world group if initialised.
        run_id: continue this run (resume): the prefix's run manifest must name it.  Without it
            a fresh run claims the prefix, and a prefix another run owns is refused.

    Construction is collective: every rank of `process_group` builds its publisher together, and a
    failure on any rank (a store it cannot write, a layout that does not fit) is raised on all of
    them as the same `DeltaError`.
    """

    def __init__(
        self,
        store: str | Store,
        tensors: TensorSource,
        settings: PublisherSettings | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        run_id: str | None = None,
    ) -> None:
        self.settings = settings = settings or PublisherSettings()
        if run_id is not None:
            fmt.check_run_id(run_id)  # on every rank, before any collective
        self.store = as_store(store, storage_options)
        self._source = _as_source(tensors)
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        layout: RankLayout | BaseException
        self._key: SigningKey | None = None
        try:
            if settings.signing_key is not None:
                self._key = SigningKey.load(settings.signing_key)
            described = _described(self._source())
            self._specs = _grouped(plan(dict(described), self.rank, self.world_size), described)
            layout = [[(s.name, tuple(s.shape), s.start, s.numel) for s in group] for group in self._specs]
        except (UnsupportedStrategyError, ValueError) as err:
            layout = err
        self.run_id, self._manifest = claim(
            self.store, run_id, layout, settings.dtype, self.rank, process_group, self._key
        )
        self._shapes = {s.name: s.shape for group in self._specs for s in group}
        self._numel = sum(s.numel for group in self._specs for s in group)
        self._cache: list[_Group] | None = None
        self._host: _HostSide | None = None
        self._checksums: list[int] = []  # encode thread: each payload's checksum as last packed
        self._pool = ThreadPoolExecutor(settings.codec.threads, thread_name_prefix="delta-compress")
        # A resumed run publishes only past what the store holds: a step number is never reused,
        # not even one that retention deleted (a loader may still hold that step).
        published = self.store.published_steps() if run_id is not None else []
        self._last_step: int | None = published[-1] if published else None
        self._last_base: int | None = None
        self.skipped = 0
        self.last_upload: UploadStats | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()  # two worker threads: the first failure is the one raised
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=settings.max_pending)
        self._encoded: queue.Queue[_Encoded | None] = queue.Queue(maxsize=1)
        self._workers = [
            threading.Thread(target=self._encode_loop, name="delta-encode", daemon=True),
            threading.Thread(target=self._commit_loop, name="delta-upload", daemon=True),
        ]
        self._committed: int | None = self._last_step  # rank 0's newest committed step: the heartbeat's
        self._beat_due, self._beat_stop = threading.Event(), False
        self._heart: threading.Thread | None = None
        if self._key is not None and self.rank == 0:
            self._heart = threading.Thread(target=self._beat_loop, args=(self._key,), name="delta-beat", daemon=True)
            self._heart.start()
        for worker in self._workers:
            worker.start()

    # ------------------------------------------------------------------ calling thread

    def publish(self, step: int, probe: Tensor | None = None) -> PublishStats:
        """Snapshot the current weights as `step` and queue their upload.

        `probe`, if given, is stored with the step (flattened, as fp32): the model's
        log-probabilities of a fixed probe batch, which a rollout worker can recompute after
        swapping the step in, to catch an engine that loaded the right bytes but uses them wrongly.
        """
        self._raise_worker_error()
        probed = None if probe is None else tuple(probe.detach().float().flatten().cpu().tolist())
        if probed is not None and not all(math.isfinite(v) for v in probed):
            raise ValueError("probe values must be finite")
        if probed is not None and len(probed) > fmt.MAX_PROBE:
            raise ValueError(f"a probe holds at most {fmt.MAX_PROBE} values, got {len(probed)}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"steps must increase: {step} after {self._last_step} (published, or in the store)")
        if self.settings.backlog == Backlog.COALESCE and self._jobs.full():
            self.skipped += 1
            return PublishStats(step, False, None, 0, 0, 0.0)
        started = time.perf_counter()
        tensors = self._source()
        described = _described(tensors)
        shapes = {n: tuple(t.shape) for n, t in described.items()}
        changed_shape = [n for n, shape in self._shapes.items() if shapes.get(n) != shape]
        if changed_shape:
            raise UnsupportedStrategyError(
                f"the run's layout is fixed at construction; {changed_shape[:3]} changed or vanished since: "
                "publish a model of another shape as a new run, under a prefix of its own"
            )
        rebase = self._cache is None  # the first publish, or after a failure: no bridge
        if rebase:
            self._last_base = None
        is_base = self._last_base is None or step - self._last_base >= self.settings.base_every
        if self._host is None:
            devices = [t.device for t in described.values()]
            self._host = _HostSide(next((d for d in devices if d.type == "cuda"), torch.device("cpu")))
        try:
            cache = self._cache or [_Group(specs, torch.empty(0)) for specs in self._specs]
            pieces, changed_total = self._snapshot(cache, tensors, is_base, bridge=is_base and not rebase)
        except BaseException:
            self._cache = None  # some slices may hold a step that was never published: rebase
            raise
        self._cache = cache
        kind = fmt.Kind.BASE if is_base else fmt.Kind.DELTA
        header = fmt.PartHeader(
            manifest=self._manifest,
            step=step,
            prev_step=None if is_base else self._last_step,
            kind=kind,
            rank=self.rank,
            world_size=self.world_size,
            created=time.time(),
            probe=len(probed or ()),
        )
        diff_ms = (time.perf_counter() - started) * 1e3
        job = _Job(header, pieces, probed, self._last_step if is_base and not rebase else None, self._host.mark())
        self._jobs.put(job)  # blocks only under Backlog.BLOCK
        self._last_step = step
        if is_base:
            self._last_base = step
        return PublishStats(step, True, kind, changed_total, self._numel, diff_ms)

    @property
    def last_step(self) -> int:
        """The newest step this publisher published, or, resuming, the newest in the store; 0 for none."""
        return self._last_step or 0

    @property
    def pending(self) -> int:
        """Snapshots queued for upload and not yet committed."""
        return self._jobs.unfinished_tasks

    def _snapshot(
        self, cache: list[_Group], tensors: Mapping[str, Tensor], is_base: bool, bridge: bool
    ) -> tuple[list[_Piece], int]:
        """Diff every group against the cache on its device and bring the cache up to date.

        A delta (and a base's bridge) writes only the changed elements into the cache; a base
        also hands the worker a device-side copy of the group to pack.  On an accelerator the
        calling thread waits for the device once per call: every group's count of changes is
        taken first, in one transfer, and each group's positions then without a sync.
        """
        dtype = self.settings.dtype.torch

        def values(group: _Group) -> tuple[Tensor, bool]:
            parts = [read_slice(tensors[spec.name], spec).to(dtype) for spec in group.specs]
            # A lone slice may be a view of the live weights (already `dtype`); a concatenation is ours.
            return (parts[0], True) if len(parts) == 1 else (torch.cat(parts), False)

        pieces: list[_Piece] = []
        if is_base and not bridge:
            for group in cache:
                new, shared = values(group)
                group.bits = new.clone() if shared else new
                # The worker packs a copy of its own: the next step writes its changes into the cache.
                pieces.append(_Piece(snapshot=group.bits.clone()))
            return pieces, self._numel
        masks = [
            None if group.bits.is_cpu else group.bits.view(torch.int16) != values(group)[0].view(torch.int16)
            for group in cache
        ]
        sums = [mask.sum() for mask in masks if mask is not None]
        counts = iter(torch.stack([c.to(sums[0].device) for c in sums]).tolist() if sums else [])  # the one sync
        changed_total = 0
        for group, mask in zip(cache, masks, strict=True):
            new, shared = values(group)  # a view, or a cast again: cheaper than holding every group's
            exponents = self.settings.codec.conditions(new.device)
            if mask is None:
                change = codec.diff(group.bits, new, exponents=exponents)
            else:
                change = codec.diff_counted(group.bits, new, mask, next(counts), exponents=exponents)
            whole = (new.clone() if shared else new) if codec.may_pack_raw(change) else None
            group.bits.view(torch.int16).index_copy_(0, change.index, change.new)
            snapshot = group.bits.clone() if is_base else None  # the cache changes at the next step
            pieces.append(_Piece(snapshot=snapshot, change=change, whole=whole))
            changed_total += new.numel() if is_base else change.index.numel()
        return pieces, changed_total

    def flush(self) -> None:
        """Wait until every queued snapshot is in the store; raise if an upload failed."""
        self._jobs.join()
        self._raise_worker_error()

    def close(self) -> None:
        """Flush and stop the worker.  Idempotent."""
        if self._workers[0].is_alive():
            self._jobs.put(None)
        for worker in self._workers:
            worker.join()
        if self._heart is not None and self._heart.is_alive():
            self._beat_stop = True
            self._beat_due.set()
            self._heart.join()
            assert self._key is not None
            self._beat(self._key)
        self._pool.shutdown()
        self._raise_worker_error()

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, error: BaseException) -> None:
        """Keep a worker's failure for the trainer thread: the first one, which caused the rest."""
        with self._error_lock:
            if self._error is None:
                self._error = error

    def _raise_worker_error(self) -> None:
        with self._error_lock:
            error, self._error = self._error, None
        if error is not None:
            self._cache = None  # the chain is broken: start over with a base
            raise PublishError(f"uploading to {self.store.url} failed: {error}") from error

    # ------------------------------------------------------------------ worker threads

    def _beat_loop(self, key: SigningKey) -> None:
        """Rank 0's heartbeat: now, after each commit and every `heartbeat_seconds` (`close` writes
        the last one, once every step is committed)."""
        while not self._beat_stop:
            self._beat(key)
            self._beat_due.wait(self.settings.heartbeat_seconds)
            self._beat_due.clear()

    def _beat(self, key: SigningKey) -> None:
        beat = fmt.Heartbeat(self.run_id, self._manifest, self._committed, time.time())
        try:
            self.store.beat(beat, key)
        except Exception as err:  # a missed beat is not a failed step; followers see its age
            log.warning("heartbeat to %s failed: %s", self.store.url, err)

    def _encode_loop(self) -> None:
        """Stage one: pack, copy to the host, compress; blobs go to the commit stage in order."""
        while True:
            job = self._jobs.get()
            if job is None:
                self._encoded.put(None)
                return
            try:
                item: _Encoded | None = self._encode(job)
            except Exception as err:  # surfaced on the trainer thread by _raise_worker_error
                log.exception("delta encode failed")
                item = _FAILED
                self._fail(err)
            del job  # its device tensors (the change, a base's snapshot) go now, not at the next job
            self._encoded.put(item)

    def _commit_loop(self) -> None:
        """Stage two: upload and commit, while stage one compresses the next snapshot."""
        broken = False  # after a failure, deltas would link to a part that is not there
        while True:
            item = self._encoded.get()
            try:
                if item is None:
                    return
                if item is _FAILED:
                    broken = True
                elif not broken or item.part.header.kind == fmt.Kind.BASE:
                    self._commit(item, with_bridge=not broken)
                    broken = False
            except Exception as err:  # surfaced on the trainer thread by _raise_worker_error
                log.exception("delta upload failed")
                broken = True
                self._fail(err)
            finally:
                self._jobs.task_done()

    def _encode(self, job: _Job) -> _Encoded:
        started = time.perf_counter()
        full, delta, checksums = self._pack(job)
        if full is None:
            changes = [p.change.index.numel() for p in job.pieces if p.change is not None]
            return _Encoded(self._blob(job.header, delta, changes, checksums, job.probe), None, started)
        part = self._blob(job.header, full, [p.n for p in full], checksums, job.probe)
        bridge = None
        if job.bridge_from is not None:
            header = replace(job.header, kind=fmt.Kind.DELTA, prev_step=job.bridge_from)
            changes = [p.change.index.numel() for p in job.pieces if p.change is not None]
            bridge = self._blob(header, delta, changes, checksums, job.probe)
        return _Encoded(part, bridge, started)

    def _blob(
        self,
        header: fmt.PartHeader,
        packed: list[codec.Packed],
        changed: list[int],
        checksums: list[int],
        probe: tuple[float, ...] | None,
    ) -> _Blob:
        """A part's bytes: its payloads compressed a few at a time (zstd releases the GIL)."""
        payloads = list(self._pool.map(lambda p: codec.serialize(p, self.settings.codec), packed))
        entries = [fmt.PayloadEntry(len(p), c, v) for p, c, v in zip(payloads, changed, checksums, strict=True)]
        return _Blob(header, fmt.encode_blob(header, entries, payloads, probe))

    def _commit(self, item: _Encoded, with_bridge: bool) -> None:
        header = item.part.header
        stored = 0
        for blob, bridge in ((item.bridge, True), (item.part, False)):
            if blob is not None and (with_bridge or not bridge):
                stored += self.store.commit_part(
                    blob.header, blob.data, bridge=bridge, signer=self._key, run_id=self.run_id
                )
        self._committed = header.step
        self._beat_due.set()
        keep = self.settings.keep_bases
        if keep and self.rank == 0 and header.kind == fmt.Kind.BASE:
            collect(self.store, keep)  # only once a newer base is complete on every rank
        dense = self._numel * self.settings.dtype.torch.itemsize
        elapsed = (time.perf_counter() - item.started) * 1e3
        self.last_upload = UploadStats(header.step, stored, dense, elapsed)

    def _pack(self, job: _Job) -> tuple[list[codec.Packed] | None, list[codec.Packed], list[int]]:
        """The base packing (bases only), the delta packing (deltas and bridges) and each
        payload's checksum, all on the host.

        A base's checksum is computed in full; a delta's is folded from the change.
        """
        assert self._host is not None
        full: list[codec.Packed] | None = [] if job.header.kind == fmt.Kind.BASE else None
        delta, checksums = [], []
        with self._host.stream(job.ready):
            for i, piece in enumerate(job.pieces):
                if piece.change is not None:
                    delta.append(self._host.copy(codec.pack_delta(piece.change, piece.whole)))
                if piece.snapshot is not None:
                    assert full is not None
                    full.append(self._host.copy(codec.pack_full(piece.snapshot)))
                    checksums.append(checksum(piece.snapshot.view(torch.int16)))
                else:
                    change = piece.change
                    assert change is not None
                    checksums.append(checksum_update(self._checksums[i], change.index, change.old, change.new))
            self._host.synchronize()
        self._checksums = checksums
        return full, delta, checksums


def _grouped(specs: list[OwnedSlice], tensors: Mapping[str, Tensor]) -> list[list[OwnedSlice]]:
    """Large slices alone, then the small ones of each device together: the payloads."""
    large = [[spec] for spec in specs if spec.numel > _SMALL]
    small: dict[torch.device, list[OwnedSlice]] = {}
    for spec in specs:
        if spec.numel <= _SMALL:
            small.setdefault(tensors[spec.name].device, []).append(spec)
    return large + list(small.values())


def step_metrics(publisher: DeltaPublisher, stats: PublishStats) -> dict[str, float]:
    """A publish call's numbers for a trainer's loggers: this rank's own, so logging needs no
    collective.  The upload figures are of the newest step whose upload finished, usually an
    earlier one, and are absent until one has."""
    metrics = {
        "delta/changed_fraction": stats.changed / stats.numel if stats.numel else 0.0,
        "delta/diff_ms": stats.diff_ms,
        "delta/queue_depth": float(publisher.pending),
        "delta/skipped_steps": float(publisher.skipped),
    }
    upload = publisher.last_upload
    if upload is not None:
        metrics["delta/last_published_step"] = float(upload.step)
        metrics["delta/stored_bytes"] = float(upload.stored_bytes)
        metrics["delta/compression_ratio"] = upload.dense_bytes / max(upload.stored_bytes, 1)
        metrics["delta/upload_ms"] = upload.upload_ms
    return metrics


def _as_source(tensors: TensorSource) -> Callable[[], Mapping[str, Tensor]]:
    if isinstance(tensors, nn.Module):
        check_readable(tensors)
    if isinstance(tensors, nn.Module) and is_peft_model(tensors):  # the merged policy, base model's names
        return lambda: merged_tensors(tensors)
    if isinstance(tensors, nn.Module):
        return lambda: named_tensors(tensors)
    if isinstance(tensors, Mapping):
        return lambda: tensors
    if callable(tensors):
        return tensors
    raise TypeError(f"tensors must be an nn.Module, a mapping or a callable, got {type(tensors).__name__}")


def _described(tensors: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """Tensors with the names, shapes, devices and placements of `tensors`, read at no cost: a
    PEFT policy's base weights stand for its merged ones, which cost a merge each to read."""
    return tensors.unmerged() if isinstance(tensors, MergedTensors) else tensors
