"""The publisher's upload workers: two threads, pipelined, behind a bounded queue of snapshots.

Stage one packs each snapshot on the device (a few bytes per changed element; a base's byte
planes and checksum), copies to the host (pinned memory, on a side stream on CUDA, so the
training stream never waits) and compresses, several payloads at once; stage two uploads and
commits the previous snapshot (s3fs sends large blobs as concurrent multipart parts).  The first
failure is kept for the training thread (`take_error`).  Rank 0 of a signed run also keeps the
heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from . import codec
from . import format as fmt
from .checksum import checksum, checksum_update
from .retention import collect
from .signing import SigningKey
from .snapshot import Piece
from .store import Store

if TYPE_CHECKING:
    from .publisher import PublisherSettings

__all__ = ["HostSide", "Job", "UploadStats", "Uploader"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadStats:
    """What the worker threads did for one published step."""

    step: int
    stored_bytes: int  # objects written for the step: blob, marker, and the bridge and its marker
    dense_bytes: int  # the same slices as plain `dtype`
    upload_ms: float  # from the start of packing to the commit (pack, copy, compress, hash, write)


@dataclass(frozen=True)
class Job:
    header: fmt.PartHeader
    pieces: list[Piece]
    probe: tuple[float, ...] | None
    bridge_from: int | None  # a base's bridge: the delta against this rank's previous part
    host: HostSide
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


class HostSide:
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


class Uploader:
    """The two worker threads of a publisher, and rank 0's heartbeat when the run is signed.

    `jobs` is the queue `publish` puts snapshots into (`max_pending` of them at most); `close`
    ends the threads once every queued snapshot is committed.
    """

    def __init__(
        self,
        store: Store,
        settings: PublisherSettings,
        *,
        rank: int,
        run_id: str,
        manifest: str,
        key: SigningKey | None,
        numel: int,
        committed: int | None,
    ) -> None:
        self.store, self.settings = store, settings
        self.rank, self.run_id, self._manifest, self._key = rank, run_id, manifest, key
        self._numel = numel
        self._checksums: list[int] = []  # encode thread: each payload's checksum as last packed
        self._pool = ThreadPoolExecutor(settings.codec.threads, thread_name_prefix="delta-compress")
        self.last_upload: UploadStats | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()  # two worker threads: the first failure is the one raised
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=settings.max_pending)
        self._encoded: queue.Queue[_Encoded | None] = queue.Queue(maxsize=1)
        self._workers = [
            threading.Thread(target=self._encode_loop, name="delta-encode", daemon=True),
            threading.Thread(target=self._commit_loop, name="delta-upload", daemon=True),
        ]
        self._committed = committed  # rank 0's newest committed step: the heartbeat's
        self._beat_due, self._beat_stop = threading.Event(), False
        self._heart: threading.Thread | None = None
        if key is not None and rank == 0:
            self._heart = threading.Thread(target=self._beat_loop, args=(key,), name="delta-beat", daemon=True)
            self._heart.start()
        for worker in self._workers:
            worker.start()

    def close(self) -> None:
        """Commit every queued snapshot, then stop the threads (and write the last heartbeat).  Idempotent."""
        if self._workers[0].is_alive():
            self.jobs.put(None)
        for worker in self._workers:
            worker.join()
        if self._heart is not None and self._heart.is_alive():
            self._beat_stop = True
            self._beat_due.set()
            self._heart.join()
            assert self._key is not None
            self._beat(self._key)
        self._pool.shutdown()

    def _fail(self, error: BaseException) -> None:
        """Keep a worker's failure for the trainer thread: the first one, which caused the rest."""
        with self._error_lock:
            if self._error is None:
                self._error = error

    def take_error(self) -> BaseException | None:
        """The first failure since the last call, if any."""
        with self._error_lock:
            error, self._error = self._error, None
        return error

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
            job = self.jobs.get()
            if job is None:
                self._encoded.put(None)
                return
            try:
                item: _Encoded | None = self._encode(job)
            except Exception as err:  # surfaced on the trainer thread by take_error
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
            except Exception as err:  # surfaced on the trainer thread by take_error
                log.exception("delta upload failed")
                broken = True
                self._fail(err)
            finally:
                self.jobs.task_done()

    def _encode(self, job: Job) -> _Encoded:
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

    def _pack(self, job: Job) -> tuple[list[codec.Packed] | None, list[codec.Packed], list[int]]:
        """The base packing (bases only), the delta packing (deltas and bridges) and each
        payload's checksum, all on the host.

        A base's checksum is computed in full; a delta's is folded from the change.
        """
        host = job.host
        full: list[codec.Packed] | None = [] if job.header.kind == fmt.Kind.BASE else None
        delta, checksums = [], []
        with host.stream(job.ready):
            for i, piece in enumerate(job.pieces):
                if piece.change is not None:
                    delta.append(host.copy(codec.pack_delta(piece.change, piece.whole)))
                if piece.snapshot is not None:
                    assert full is not None
                    full.append(host.copy(codec.pack_full(piece.snapshot)))
                    checksums.append(checksum(piece.snapshot.view(torch.int16)))
                else:
                    change = piece.change
                    assert change is not None
                    checksums.append(checksum_update(self._checksums[i], change.index, change.old, change.new))
            host.synchronize()
        self._checksums = checksums
        return full, delta, checksums
