"""The trainer-side engine: cache, diff on the device, upload in the background.

`DeltaPublisher.publish(step)` does on the calling thread only what must see the live weights:
cast the rank's own slices to `dtype` on their device, diff them against the cached copy from the
last publish and write the changed elements into the cache (a base step also takes a device-side
copy; `snapshot`).  Two worker threads do the rest, pipelined (`uploader`): one packs on the
device, copies to the host and compresses, while the other uploads and commits the previous
snapshot.  Their errors are raised on the next `publish` or at `close`.  This module holds the
settings and the publish step's decisions: base or delta, a bridge, a rebase, a step skipped.

At every base step after the first, the rank also publishes a bridge: the same step as a delta
against its previous part, committed before the base, so followers in sync never read a base.

Each rank's parts form their own chain (each delta names the same rank's previous part), so a
rank never waits for another: not to publish, and not to skip a step when its uploads fall behind.
The ranks agree on the run once, when the publisher is made (`claim`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import codec
from . import format as fmt
from .claim import RankLayout, claim
from .errors import PublishError, UnsupportedStrategyError
from .format import DType
from .records import enum_member
from .shards import plan
from .signing import SigningKey
from .snapshot import Group, TensorSource, as_source, described, grouped, snapshot
from .store import Store, as_store
from .uploader import HostSide, Job, Uploader, UploadStats

__all__ = [
    "Backlog",
    "DeltaPublisher",
    "PublishStats",
    "PublisherSettings",
    "UploadStats",
    "step_metrics",
]


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
        self._source = as_source(tensors)
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        layout: RankLayout | BaseException
        self._key: SigningKey | None = None
        try:
            if settings.signing_key is not None:
                self._key = SigningKey.load(settings.signing_key)
            named = described(self._source())
            self._specs = grouped(plan(dict(named), self.rank, self.world_size), named)
            layout = [[(s.name, tuple(s.shape), s.start, s.numel) for s in group] for group in self._specs]
        except (UnsupportedStrategyError, ValueError) as err:
            layout = err
        self.run_id, self._manifest = claim(
            self.store, run_id, layout, settings.dtype, self.rank, process_group, self._key
        )
        self._shapes = {s.name: s.shape for group in self._specs for s in group}
        self._numel = sum(s.numel for group in self._specs for s in group)
        self._cache: list[Group] | None = None
        self._host: HostSide | None = None
        # A resumed run publishes only past what the store holds: a step number is never reused,
        # not even one that retention deleted (a loader may still hold that step).
        published = self.store.published_steps() if run_id is not None else []
        self._last_step: int | None = published[-1] if published else None
        self._last_base: int | None = None
        self.skipped = 0
        self._uploads = Uploader(
            self.store,
            settings,
            rank=self.rank,
            run_id=self.run_id,
            manifest=self._manifest,
            key=self._key,
            numel=self._numel,
            committed=self._last_step,
        )

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
        if self.settings.backlog == Backlog.COALESCE and self._uploads.jobs.full():
            self.skipped += 1
            return PublishStats(step, False, None, 0, 0, 0.0)
        started = time.perf_counter()
        tensors = self._source()
        named = described(tensors)
        shapes = {n: tuple(t.shape) for n, t in named.items()}
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
            devices = [t.device for t in named.values()]
            self._host = HostSide(next((d for d in devices if d.type == "cuda"), torch.device("cpu")))
        try:
            cache = self._cache or [Group(specs, torch.empty(0)) for specs in self._specs]
            dtype, options = self.settings.dtype.torch, self.settings.codec
            pieces, changed_total = snapshot(cache, tensors, dtype, options, is_base, bridge=is_base and not rebase)
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
        bridge_from = self._last_step if is_base and not rebase else None
        job = Job(header, pieces, probed, bridge_from, self._host, self._host.mark())
        self._uploads.jobs.put(job)  # blocks only under Backlog.BLOCK
        self._last_step = step
        if is_base:
            self._last_base = step
        return PublishStats(step, True, kind, changed_total, self._numel, diff_ms)

    @property
    def last_step(self) -> int:
        """The newest step this publisher published, or, resuming, the newest in the store; 0 for none."""
        return self._last_step or 0

    @property
    def last_upload(self) -> UploadStats | None:
        """What the worker threads did for the newest step whose upload finished; None before one has."""
        return self._uploads.last_upload

    @property
    def pending(self) -> int:
        """Snapshots queued for upload and not yet committed."""
        return self._uploads.jobs.unfinished_tasks

    def flush(self) -> None:
        """Wait until every queued snapshot is in the store; raise if an upload failed."""
        self._uploads.jobs.join()
        self._raise_worker_error()

    def close(self) -> None:
        """Flush and stop the worker.  Idempotent."""
        self._uploads.close()
        self._raise_worker_error()

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_worker_error(self) -> None:
        error = self._uploads.take_error()
        if error is not None:
            self._cache = None  # the chain is broken: start over with a base
            raise PublishError(f"uploading to {self.store.url} failed: {error}") from error


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
