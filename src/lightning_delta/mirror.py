"""A chain mirror: the chain copied to another store (a region, a bucket, a cloud) in commit order.

A region's followers read its mirror, so each step crosses the link to the region once, however
many replicas read it.  A pass copies the run-level objects first (the manifest), then, for each
step the source holds and the mirror does not, step after step: every part's blob, checked against
its commit marker's SHA-256 before it is written, then the markers (a base's bridges before the
parts).  So a step is complete at the mirror only once every object of it is there and every
step before it was copied: each step listed at the mirror loads.

Object names are predictable (docs/FORMAT.md), so a following mirror mostly lists nothing: a pass
GETs the markers and the blobs of the step it expects next (the newest mirrored plus the chain's
stride, every rank, all at once once a step may be near: a step costs one round trip, and a
blob there before its marker is held until the marker checks it), then looks for the step after
it (a backlog), unless the one it copied had just come (found just after a pass that missed it:
the look would be a 404).
Until anything of a step is there, a pass asks for one rank's marker and blob only, then every
rank's (with several ranks, one round trip more a step): a step not there yet costs two small
requests (404s), not two per rank, where a listing pass costs three or more round trips one after
another and grows with the chain.  The source is listed at the first pass, at each pass while the
mirror holds no step (passes then thin out as a warm-up goes on), every `list_seconds`, when the
next step is overdue (it may have another number), after a base (the source's retention
deletes then), and while the mirror is stopped at damage (less often the longer it is stopped:
each `list_seconds` after a minute or so).  Following, it sleeps until shortly
before the next step is due (`cadence`), so a fine `poll_seconds` finds steps sooner without a
request every `poll_seconds` between them; a trainer whose steps jitter is polled through its
spread, and `late_share` trades some steps found late for fewer of those polls.  Objects are
created exclusively and only missing ones are written, so a mirror killed at any moment resumes
where it stopped; an object already at the mirror must be identical.  Each source object is read
once (a damaged one again until it heals).  A damaged source object is never copied: the mirror
stops at its step, says which object, and goes on once the source heals, or from a newer base that
does not need it (a stop below the newest base it holds does not hold back the steps from there
on; damage there is passed over for good, and with it every step below that base not copied yet,
late ones too, until the mirror restarts and lists them again); a damaged bridge is left out,
and its base copied without it (and the bridge after it, if it heals while that base is the newest
copied and the mirror has not restarted).  A blob whose marker is there but which is not (a
replicated source), or the previous part a delta applies to, is waited for, `missing_after`
seconds at most: then it is damage.  A step held for its previous part has no blob read or
written until that part is there (its markers are read first): passed over, it leaves nothing at
the mirror (the steps after one stopped at its own blob have theirs copied: passed over, those
stay without markers).

A mirror needs no key: it copies the trainer's signatures with the objects they sign, and a
region's followers check them against the trainer's key.  Given trusted keys, a mirror also refuses
what they would refuse (an unsigned or foreign run; a part whose signature does not bind it, which
it never copies) and relays the trainer's signed heartbeat, so a follower of a mirror that stopped
can tell steps withheld from no new step yet.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from . import format as fmt
from .cadence import Cadence
from .errors import ChecksumError, ConflictError, FormatError, MissingObjectError, SignatureError, StoreError
from .incomplete import MissingClock
from .retention import cutoff, delete_steps
from .signing import Trust
from .store import Store, as_store

__all__ = ["RUN_OBJECTS", "Mirror", "MirrorMetrics", "MirrorSettings"]

log = logging.getLogger(__name__)

_IDLE_MOST = 5.0
"""The longest a following mirror waits between polls while the trainer keeps no rhythm (a pause,
a warm-up): a step after the pause is found at most that late.  Also the longest between reads of
a signed run's heartbeat (`Mirror._beat_every`)."""

RUN_OBJECTS: tuple[str, ...] = (fmt.RUN_MANIFEST,)
"""The run-level objects a mirror copies before any step, the manifest first (it says whose run a
prefix holds); each is copied as it is, created exclusively.  The heartbeat, rewritten by the
trainer, is relayed after each pass instead."""


@dataclass
class MirrorSettings:
    """A mirror's options."""

    keep_bases: int | None = None
    """Keep the K newest complete base steps at the mirror (its own retention); None deletes what
    the source deleted, in the same order."""
    threads: int = 8
    """Objects copied at once (blobs and markers of several steps; markers still land in order)."""
    poll_seconds: float = 1.0
    """Seconds between passes while following (while a step is due; see `paced`)."""
    list_seconds: float = 30.0
    """Seconds between listings of the source while the next step is found by its name (a listing
    notices steps at numbers not guessed, and deletions by the source's retention)."""
    paced: bool = True
    """Following, sleep until shortly before the next step is due (the chain's recent rhythm)
    instead of polling every `poll_seconds` in between: a few requests a step, not one a poll."""
    late_share: float = 0.25
    """Paced, the share of steps found at the first poll after a sleep, late by up to the trainer's
    jitter (`Cadence`'s `late`): 0 wakes at the earliest time the recent steps put the next one at
    and polls through all of the jitter, each poll that finds nothing a request (two with
    `read_ahead`, ~3 KB on S3); more wakes later, with fewer of them."""
    read_ahead: bool = True
    """Found by its names, a step's blobs are read with its markers, at once: a step costs one
    round trip, not two (marker, then blob), and a poll that finds nothing a 404 per object, not
    per marker.  Paced, only once a step may be near (`Cadence.near`): without a rhythm (a
    warm-up, a new pace) polls thin out and those in the first half of the usual gap are misses
    nearly always, so each reads its marker only (one 404, not two).  A blob read before its marker is
    held (at most the largest delta seen of its rank, a quarter more: a base's rest is read once its
    marker is) until the marker is read and checks it."""
    missing_after: float = 120.0
    """Seconds an object a step needs may stay missing at the source (a replicated source that has
    not received it yet) before it counts as damage: a blob whose marker the source holds, or the
    part a delta applies to (the same rank's part at its `prev_step`), neither at the mirror nor
    copied in the same pass (or deleted by the mirror's retention): a delta is never copied before
    it, so every step listed at the mirror loads.  Until then the mirror waits at the step; after,
    it treats the step as damaged.  As for followers (`FollowSettings.missing_after`), it counts
    only while the mirror stands still: from the first pass that finds it missing after the pass
    that last moved the mirror's newest step on (one found missing while the mirror was held at an
    earlier step counts again from then), so only a mirror held that long calls it lost.  An object
    missing below the mirror's newest step (a hole it already serves past) holds back only the
    late steps between it and that step (they may chain through it): copied if it comes in time;
    once lost, passed over for good with every step below the mirror's newest base not copied yet
    (its newest base needs nothing older; a restarted mirror lists them again)."""

    def __post_init__(self) -> None:
        if self.keep_bases is not None and self.keep_bases < 1:
            raise ValueError(f"keep_bases must be >= 1 or None, got {self.keep_bases}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.poll_seconds <= 0:
            raise ValueError(f"poll_seconds must be > 0, got {self.poll_seconds}")
        if self.list_seconds <= 0:
            raise ValueError(f"list_seconds must be > 0, got {self.list_seconds}")
        if not 0 <= self.late_share < 1:
            raise ValueError(f"late_share must be >= 0 and < 1, got {self.late_share}")
        if self.missing_after < 0:
            raise ValueError(f"missing_after must be >= 0, got {self.missing_after}")


@dataclass
class MirrorMetrics:
    """Where a mirror stands after its last pass (what `--follow` prints and a program logs)."""

    source_step: int | None = None
    """The newest step complete at the source."""
    mirror_step: int | None = None
    """The newest step complete at the mirror."""
    mirrored_at: float | None = None
    """When `mirror_step` became complete at the mirror (`time.time()`: its last marker written),
    which may be before the pass ended."""
    steps_behind: int = 0
    """Steps complete at the source and newer than `mirror_step`."""
    lag_seconds: float = 0.0
    """How long the oldest step not yet mirrored has been complete at the source (as this mirror
    saw it); 0 when the mirror is caught up."""
    objects_copied: int = 0
    bytes_copied: int = 0
    """Bytes written to the mirror (blobs, markers, run objects) since this mirror started."""
    bytes_read: int = 0
    """Bytes read from the source since this mirror started."""
    steps_deleted: int = 0
    listings: int = 0
    """Passes that listed the source (the others found steps by their names)."""
    stopped_at: str | None = None
    """The source object the mirror waits at: damaged, or not there yet (a replicated source)."""

    def line(self) -> str:
        """One progress line, the way the CLI's other commands print."""
        at = "-" if self.mirror_step is None else str(self.mirror_step)
        source = "-" if self.source_step is None else str(self.source_step)
        text = (
            f"mirror at step {at} of {source}, {self.steps_behind} behind, "
            f"{self.bytes_copied:,d} bytes copied ({self.objects_copied} objects), lag {self.lag_seconds:.1f} s"
        )
        return text + (f", stopped at {self.stopped_at}" if self.stopped_at else "")


class _Part(NamedTuple):
    """A committed part at the source, by its marker's name."""

    step: int
    rank: int
    world_size: int
    bridge: bool

    @property
    def marker_key(self) -> str:
        return fmt.commit_path(self.step, self.rank, self.world_size, bridge=self.bridge)

    @property
    def blob_key(self) -> str:
        return fmt.blob_path(self.step, self.rank, self.world_size, bridge=self.bridge)

    @property
    def marker_name(self) -> str:
        """The marker's name in its step's folder (what a listing of the folder gives)."""
        return self.marker_key.rsplit("/", 1)[1]

    @property
    def blob_name(self) -> str:
        """The blob's name in its step's folder."""
        return self.blob_key.rsplit("/", 1)[1]


class _Read(NamedTuple):
    """A part's marker, read from the source and checked (given trusted keys); its blob not yet."""

    part: _Part
    data: bytes
    marker: fmt.CommitMarker


class _Ready(NamedTuple):
    """A part whose blob is at the mirror, checked; its marker still to write (unless `there`)."""

    part: _Part
    marker: bytes
    kind: fmt.Kind
    prev: int | None  # the step of the same rank's part a delta applies to
    there: bool  # the marker is at the mirror already


class _Stop(NamedTuple):
    """Why a part cannot be mirrored now."""

    key: str
    reason: str
    damaged: bool  # False: not there (yet) at the source


class Mirror:
    """Copies the chain at `source` to `destination` (fsspec URLs or `Store`s), pass by pass.

    Args:
        source, destination: where the chain is, and where its copy goes (another mirror's
            destination is a source like any other: home -> region -> zone).
        settings: retention, concurrency, polling.
        source_options, destination_options: fsspec storage options of each side.
        trust: the trainer's public keys, if the mirror should refuse what followers would (it
            copies signatures through either way).
    """

    def __init__(
        self,
        source: str | Store,
        destination: str | Store,
        settings: MirrorSettings | None = None,
        *,
        source_options: Mapping[str, Any] | None = None,
        destination_options: Mapping[str, Any] | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.settings = settings or MirrorSettings()
        self.source = as_store(source, source_options, trust=trust)
        self.destination = as_store(destination, destination_options)
        self.metrics = MirrorMetrics()
        self._pool = ThreadPoolExecutor(self.settings.threads, thread_name_prefix="delta-mirror")
        self._lock = threading.Lock()  # the metrics and caches, updated by the copying threads
        self._world: int | None = None  # the run's ranks, once its manifest is at the mirror
        self._markers: dict[str, bytes] = {}  # source markers read, until their step is mirrored
        self._checked: set[str] = set()  # objects at the mirror known to be the source's, until then
        self._done: set[int] = set()  # steps complete at the mirror
        self._seen: dict[int, float] = {}  # steps not yet mirrored -> when first seen at the source
        self._skip_below = 0  # steps older than this are not mirrored (damage before a newer base)
        self._below = 0  # the mirror's newest complete base (at its start, then each it copies): none older needed
        self._floor: int | None = None  # with keep_bases: the mirror's retention cutoff
        self._oldest = 0  # the oldest step the source listed last (following its retention, the mirror's too)
        self._floor_checked = False
        self._said: set[str] = set()  # objects already warned about
        self._left_out: set[_Part] = set()  # damaged bridges of the newest base mirrored, tried again (memory only)
        self._run: fmt.Run | None = None  # the source's run, once its manifest is at the mirror
        self._heartbeat: bytes | None = None  # the heartbeat relayed last
        self._known: set[int] = set()  # steps complete at the source, as last seen
        self._stopped: _Stop | None = None  # why the last pass stopped, if it did
        self._damaged_at: float | None = None  # stopped at damage: since the listing that found it
        self._listed_at: float | None = None  # when the source was last listed (None: list next)
        self._stride = 1  # the gap between the chain's steps: the next step is the newest + this
        self._cadence = Cadence(late=self.settings.late_share, idle_most=_IDLE_MOST)
        self._ahead: dict[_Part, tuple[bytes, int]] = {}  # blobs read with their markers (and the bound), unchecked
        self._largest: dict[int, int] = {}  # rank -> its largest delta seen: what a blob read ahead may be
        self._missed_at: float | None = None  # when the last pass missed the next step (its answer came)
        self._missed_none = False  # and found nothing of it (not a step partly there)
        self._beat_at: float | None = None  # when the heartbeat was last relayed
        self._paced = False  # following with `paced`: a blob is read ahead only when a step may be near
        # how long each blob has been missing; the clock looked up at each call (a test's fake one)
        self._missing = MissingClock(self.settings.missing_after, lambda: time.monotonic())

    def __repr__(self) -> str:
        return f"Mirror({self.source.url!r} -> {self.destination.url!r})"

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown()

    @property
    def has_run(self) -> bool:
        """Whether the source's run is known (its manifest was read and copied)."""
        return self._world is not None

    # ------------------------------------------------------------------ passes

    def follow(self, stop: threading.Event | None = None) -> Iterator[MirrorMetrics]:
        """Mirror until `stop` is set: a pass, its metrics, a pause of `poll_seconds` (longer while
        the next step is not yet due, if `paced`; a signed run's heartbeat relayed during it, once
        `_beat_every`), again."""
        stop = stop or threading.Event()
        self._paced = self.settings.paced
        while not stop.is_set():
            yield self.sync()
            poll = self.settings.poll_seconds
            wait = self._cadence.wait(time.monotonic(), poll) if self.settings.paced else poll
            end = time.monotonic() + wait  # fixed: a heartbeat's read between passes does not delay the next
            while (beat := self._beat_due()) is not None and beat < end and not stop.is_set():
                stop.wait(max(0.0, beat - time.monotonic()))  # the heartbeat between passes
                if not stop.is_set():
                    self._relay_heartbeat()  # due
            if not stop.is_set():
                stop.wait(max(0.0, end - time.monotonic()))

    def sync(self) -> MirrorMetrics:
        """One pass: copy what the source holds and the mirror does not, then apply retention
        (by listing the source, or by the names of the steps expected next; module docstring)."""
        world = self._claim()
        if world is not None:
            now = time.monotonic()
            newest = max(self._done, default=None)
            try:
                if self._listing_due(now):
                    self._list(world, now)
                else:
                    self._probe(world, now)
            finally:  # a pass that copied steps and then raised moved the mirror on too
                if max(self._done, default=None) != newest:  # the mirror moved on: what it finds missing
                    with self._lock:  # from this pass on counts from then (`MirrorSettings.missing_after`)
                        self._missing.restart(before=now)
        with self._lock:
            return replace(self.metrics)

    def _listing_due(self, now: float) -> bool:
        """Whether the pass begun at `now` lists the source.  Stopped at damage (a lost previous part
        included), a listing finds the source healed or a newer base (a step found by its names is
        the one stopped at): at the next pass, then each time as long after the last listing as the
        mirror had been stopped then (`poll_seconds` at least, `list_seconds` at most), so that a
        long stop costs a listing each `list_seconds`, not one each poll (review rmir51 finding 6)."""
        if self._stopped is None or not self._stopped.damaged:
            self._damaged_at = None
        elif self._damaged_at is None:  # the first pass after the stop, found by the listing before
            self._damaged_at = now if self._listed_at is None else self._listed_at  # (or a pass after it)
            return True
        if self._listed_at is None or not self._done:
            return True  # the first pass, a mirror that holds nothing yet (which step is first?)
        since = now - self._listed_at
        if self._damaged_at is not None:  # stopped, no step comes: the cadence's overdue rule would list each usual gap
            stopped = max(self.settings.poll_seconds, self._listed_at - self._damaged_at)
            return since >= min(stopped, self.settings.list_seconds)
        if since >= self.settings.list_seconds:
            return True
        usual = self._cadence.usual_gap()  # an overdue step is looked for once a usual gap at most
        return self._cadence.overdue(now) and (usual is None or since >= usual)

    def _probe(self, world: int, now: float) -> None:
        """A pass by names (begun at `now`): the step expected next, and the ones after it while
        they are there."""
        mirrored_base = copied = backlog = False
        stopped = None
        missed_at, self._missed_at = self._missed_at, None
        exact = self._cadence.exact(now, missed_at, self.settings.poll_seconds)  # it came at about `now`
        # just after a pass that found nothing of it (not across a long wait): the next step is not
        # there yet; else the step may be one of a backlog (or of a source filling out of order), and
        # the pass looks on
        fresh, self._missed_none = exact and self._missed_none, False
        while stopped is None:
            newest = max(self._done, default=None)
            step = (newest if newest is not None else -self._stride) + self._stride
            parts = self._parts_named(step, world, newest)
            if parts is None:  # not committed yet (or damaged: the overdue listing will say)
                self._missed_at = None if copied else time.monotonic()
                self._missed_none = not copied
                break
            if not parts:  # a delta from a step the mirror does not hold: the guess passed one over
                self._listed_at = None  # the next pass lists (the stride changed)
                break
            self._known.add(step)
            self._seen.setdefault(step, time.monotonic())
            stopped, base = self._copy([step], {step: parts}, {step}, world)
            mirrored_base = mirrored_base or base
            if step not in self._done:  # not all there yet (a source filling out of order): a miss
                self._missed_at = time.monotonic()
                break
            if not copied:  # the pass's start: nearer the commit than its end, after the step's bytes
                self._cadence.arrived(now, exact=exact)
            elif not backlog:  # a second step in one pass: the rhythm learned is too slow
                self._cadence.arrived(now, exact=False)
                backlog = True
            copied = True
            if fresh:
                break  # a step that just came: a look for the next now would be a 404
        if mirrored_base and self.settings.keep_bases is None:  # the source's retention deletes at
            self._list(world, time.monotonic())  # a base: a listing finds what it deleted
            return
        if mirrored_base:
            self._retain(None, mirrored_base)
        # about once a step, after its markers (never in its path), whether or not the pass copied
        # one: a mirror that finds every step at its first poll still relays (and a paused trainer's
        # heartbeat stays fresh)
        self._relay_heartbeat(throttled=True)
        if stopped is None and not copied:  # nothing copied: the mirror stands where it stopped (a step
            stopped = self._stopped  # asked for by name that is not there is no news of the one held)
        self._stopped = stopped
        self._update(stopped)

    def _parts_named(self, step: int, world: int, after: int | None) -> list[_Part] | None:
        """`step`'s parts at the source, found by their names: every rank's marker (read at once,
        and kept), and beside a base its bridge if there is one; None until every rank committed;
        none if a delta of it does not follow `after` (copied, it would be a step the mirror lists
        that no reader can reach)."""
        parts = [_Part(step, rank, world, False) for rank in range(world)]
        with self._lock:  # blobs read ahead for another step (the guess moved on) are dropped
            self._ahead = {p: b for p, b in self._ahead.items() if p.step == step}
            unseen = not any(p.marker_key in self._markers for p in parts)
        near = not self._paced or self._cadence.near(time.monotonic())
        # nothing of the step seen yet: one rank's marker (and blob) until it comes, then every
        # rank's at once, so a poll that finds nothing is one or two 404s, not two per rank
        for asked in ([parts[:1]] if unseen and world > 1 else []) + [parts]:
            with self._lock:
                ahead = [  # not a blob a listing already copied (its step waited for an earlier one)
                    p
                    for p in asked
                    if self.settings.read_ahead
                    and near
                    and p not in self._ahead
                    and p.rank in self._largest
                    and p.blob_key not in self._checked
                ]
            jobs = [(self._source_marker, p) for p in asked] + [(self._read_ahead, p) for p in ahead]
            markers = list(self._pool.map(lambda job: job[0](job[1]), jobs))[: len(asked)]
            if any(m is None for m in markers):
                return None
        if any(m is not None and m.kind == fmt.Kind.DELTA and m.prev_step != after for m in markers):
            return []
        bridges = [
            _Part(step, p.rank, world, True)
            for p, m in zip(parts, markers, strict=True)
            if m and m.kind == fmt.Kind.BASE
        ]
        found = list(self._pool.map(self._source_marker, bridges))  # written before the base's marker
        return parts + [b for b, m in zip(bridges, found, strict=True) if m is not None]

    def _list(self, world: int, now: float) -> None:
        """A pass by listing the source: every step it holds that the mirror does not."""
        self._listed_at = now
        with self._lock:
            self.metrics.listings += 1
        before = max(self._done, default=None)
        listed = self.source.published_steps()
        floor = max(self._skip_below, self._floor or 0)
        self._oldest = listed[0] if listed else 0
        names = {s: self._source_parts(s, world) for s in listed if s not in self._done and s >= floor}
        complete = {s for s, parts in names.items() if _ranks(parts) == world}
        start = self._start(complete, names)
        names = {s: parts for s, parts in names.items() if s >= start}
        complete = {s for s in complete if s >= start}
        now = time.monotonic()
        for step in complete:
            self._seen.setdefault(step, now)
        pending = [s for s in sorted(names) if not self._complete_at_mirror(s, world, s in complete)]
        earlier = set(self._left_out)
        stopped, mirrored_base = self._copy(pending, names, complete, world)
        self._heal_bridges(earlier & self._left_out)  # not those a newer base copied made useless
        self._retain(listed, mirrored_base)
        self._forget(set(names))
        self._relay_heartbeat()
        newest = sorted(complete | (self._done & set(listed)))
        if len(newest) >= 2:
            self._stride = newest[-1] - newest[-2]
        if max(self._done, default=None) != before:  # a listing finds steps that came at any time
            self._cadence.arrived(now, exact=False)
        self._known = set(newest)
        self._stopped = stopped
        self._update(stopped)

    def _forget(self, steps: set[int]) -> None:
        """Drop the source markers kept and the objects known checked of every step but `steps`
        (those a listing found to copy) not mirrored and not below the line the mirror passes over
        from: a step passed over, or deleted at the source, is never copied, so its entries would
        stay for good (a step mirrored drops its own as it completes)."""
        floor = max(self._skip_below, self._floor or 0)
        keep = {s for s in steps if s >= floor and s not in self._done}
        with self._lock:
            self._markers = {k: v for k, v in self._markers.items() if fmt.parse_step_key(k) in keep}
            self._checked = {k for k in self._checked if fmt.parse_step_key(k) in keep}

    def _claim(self) -> int | None:
        """Copy the run-level objects; the run's world size, or None while the source has no run.
        `ConflictError` if the mirror holds another run."""
        if self._world is not None:
            return self._world
        data = self._read(fmt.RUN_MANIFEST, fmt.MAX_MANIFEST_BYTES)
        if data is None:  # no run yet (or a replicated source that has not received its manifest)
            return None
        run = fmt.decode_manifest(data)
        if self.source.trust is not None:  # a run the followers would refuse is not mirrored
            self.source.trust.check_run(run, f"{self.source.url}/{fmt.RUN_MANIFEST}")
        held = self.destination.objects.get(fmt.RUN_MANIFEST, 0, fmt.MAX_MANIFEST_BYTES + 1)
        if held is not None:
            self._same_run(held, data, run)
        elif self.destination.objects.list("steps"):
            raise ConflictError(
                f"{self.destination.url} holds steps but no {fmt.RUN_MANIFEST}: not a mirror of {self.source.url}; "
                "give the mirror a prefix of its own"
            )
        for key in RUN_OBJECTS:
            if key == fmt.RUN_MANIFEST:
                if held is None:
                    self._write(key, data, run=run)
            elif (found := self._read(key, fmt.MAX_MANIFEST_BYTES)) is not None:
                self._write(key, found)
        # A step older than the mirror's newest complete base may be one it passed over before a
        # restart (damage that base does not need), or one that came late at the source (a replicated
        # bucket, a slow rank): it is still listed and copied when complete, but a stop there no longer
        # holds back the steps from that base on (`_copy`), which the mirror serves already, and damage
        # there is passed over for good (a running mirror the same, from each base it copies).  A store
        # error is raised (the next pass claims again); damage at the mirror is said.
        try:
            self._below = cutoff(self.destination, 1) or 0
        except (FormatError, ChecksumError, SignatureError) as err:
            log.warning("%s: its newest base could not be read (%s): a stop below it holds what follows", self, err)
            self._below = 0
        self._run, self._world = run, run.world_size
        return self._world

    def _start(self, complete: set[int], names: dict[int, list[_Part]]) -> int:
        """The first step worth copying: with `keep_bases`, a mirror that holds none of them yet
        starts at the source's `keep_bases`-th newest complete base (its markers are read once,
        and kept for the copy)."""
        keep = self.settings.keep_bases
        if keep is None or self._floor is not None or self._done:
            return 0
        found = 0
        for step in sorted(complete, reverse=True):
            kinds = [self._source_marker(p) for p in names[step] if not p.bridge]
            if all(k is not None and k.kind == fmt.Kind.BASE for k in kinds):
                found += 1
                if found == keep:
                    return step
        return 0

    def _source_marker(self, part: _Part) -> fmt.CommitMarker | None:
        """A source marker, read once and kept until its step is mirrored; None if it is gone or
        damaged (`_prepare` says which)."""
        with self._lock:
            data = self._markers.get(part.marker_key)
        if data is None:
            data = self._read(part.marker_key, fmt.MAX_MARKER_BYTES)
        if data is None:
            return None
        try:
            marker = fmt.decode_commit(data)
        except FormatError:
            return None
        with self._lock:
            self._markers[part.marker_key] = data
        return marker

    def _read_ahead(self, part: _Part) -> None:
        """`part`'s blob, read before its marker says what it must be (a thread's job), and held
        until `_prepare` checks it, so that it is read once.  Read with a bound (the rank's largest
        delta seen, a quarter more: a mirror never holds a whole base unchecked); the rest of a
        longer one is read once its marker gives the size."""
        with self._lock:
            bound = self._largest[part.rank] * 5 // 4 + 4096
        try:
            data = self._read(part.blob_key, bound)
        except StoreError:  # not needed yet: read after its marker, whose error then counts
            return
        if data is not None:
            with self._lock:
                self._ahead[part] = (data, bound)

    def _blob(self, part: _Part, marker: fmt.CommitMarker) -> bytes | None:
        """`part`'s blob from the source: what was read ahead (and the rest, if it was cut at its
        bound), else read now; None if it is not there."""
        with self._lock:
            data, bound = self._ahead.pop(part, (None, 0))
        if data is None:
            return self._read(part.blob_key, marker.size)
        if len(data) > bound and marker.size > len(data):  # cut at its bound: the rest of it
            rest = self._read(part.blob_key, marker.size, start=len(data))
            return None if rest is None else data + rest
        return data  # whole (or longer than its marker says: damage, which the check finds)

    def _source_parts(self, step: int, world: int) -> list[_Part]:
        """The parts committed at the source for `step` (of the run's world size), by listing."""
        parts = []
        for name in self.source.objects.list(fmt.step_dir(step)):
            parsed = fmt.parse_part_name(name)
            if parsed is not None and parsed.world_size == world:
                parts.append(_Part(step, parsed.rank, parsed.world_size, parsed.bridge))
        return parts

    def _complete_at_mirror(self, step: int, world: int, complete_at_source: bool) -> bool:
        if complete_at_source and self.destination.is_complete(step, world):
            self._done.add(step)
            return True
        return False

    def _copy(
        self, pending: list[int], names: dict[int, list[_Part]], complete: set[int], world: int
    ) -> tuple[_Stop | None, bool]:
        """Copy the pending steps' blobs concurrently, then their markers step after step; the
        reason the mirror stopped, if it did, and whether it mirrored a base step.  Every marker is
        read first (at once), so that a step the hold rule holds (`_held`) has none of its blobs
        read or written: if it were passed over, they would stay at the mirror without markers."""
        at_mirror = {s: set(self.destination.objects.list(fmt.step_dir(s))) for s in pending}
        read = {p: self._pool.submit(self._marker, p) for s in pending for p in names[s]}
        held = self._held(pending, names, {p: r.result() for p, r in read.items()}, at_mirror)
        futures = {
            s: [self._pool.submit(self._put, read[p].result(), at_mirror[s]) for p in names[s]]
            for s in pending
            if s not in held
        }
        stopped: _Stop | None = None
        stopped_step = 0
        mirrored_base = False
        newest = max(self._done, default=0)
        for step in pending:
            ready: list[_Ready] = []
            stop = held.get(step)
            if stop is None:
                outcomes = [self._unbridged(p, f.result()) for p, f in zip(names[step], futures[step], strict=True)]
                ready = [o for o in outcomes if isinstance(o, _Ready)]
                stop = next((o for o in outcomes if isinstance(o, _Stop)), None)
                stop = stop or self._unchained([(o.part, o.prev) for o in ready], at_mirror)
            if stopped is not None and stopped_step < self._below <= step:  # the mirror's base needs nothing below it
                if stopped.damaged:  # passed over for good, as a running mirror does at a newer base
                    self._skip_below = max(self._skip_below, self._below)
                    log.warning(
                        "%s: mirroring on from its base %d, which does not need %s", self, self._below, stopped.key
                    )
                stopped = None
            if stopped is not None and stopped_step < newest < step:  # a hole below the steps the mirror
                stopped = None  # serves holds back only those between it and them, which chain through it
            if stopped is not None:
                if not (stopped.damaged and stop is None and step in complete and _base(ready, world)):
                    continue
                self._skip_below = step  # a base that does not need the damaged object
                log.warning("%s: mirroring again from base step %d, which does not need %s", self, step, stopped.key)
                stopped = None
            if stop is not None:
                stopped, stopped_step = stop, step
                self._say(stop)
                continue
            for bridge in (True, False):  # a base's bridges before the parts that make the step complete
                writes = [o for o in ready if o.part.bridge == bridge and not o.there]
                for done in [self._pool.submit(self._write, o.part.marker_key, o.marker) for o in writes]:
                    done.result()
            at_mirror.setdefault(step, set()).update(o.part.marker_name for o in ready)
            with self._lock:
                self._checked.update(o.part.marker_key for o in ready)
                for part in names[step] if step in complete else ():  # done with for good
                    self._markers.pop(part.marker_key, None)
                    self._checked -= {part.marker_key, part.blob_key}
            if step in complete:
                self._done.add(step)
                self._seen.pop(step, None)
                if step == max(self._done):
                    with self._lock:
                        self.metrics.mirrored_at = time.time()
                if _base(ready, world):  # a bridge left out before it is of no use any more
                    self._left_out = {p for p in self._left_out if p.step >= step}
                    self._below = max(self._below, step)  # as a restart would find it (`_claim`)
                    mirrored_base = True
        if stopped is not None and stopped_step < self._below:  # no step from that base on was pending
            if stopped.damaged:
                self._skip_below = max(self._skip_below, self._below)
            stopped = None
        if stopped is not None and stopped_step < max(self._done, default=0):  # a hole below the steps
            stopped = None  # the mirror serves: it holds nothing back (copied when it comes, at a listing)
        return stopped, mirrored_base

    def _held(
        self,
        pending: list[int],
        names: dict[int, list[_Part]],
        read: dict[_Part, _Read | _Stop],
        at_mirror: dict[int, set[str]],
    ) -> dict[int, _Stop]:
        """The pending steps the hold rule holds (`_unchained`), and why, told from their markers
        (`read`) before any blob is read: a step counts as copied in this pass unless a marker of
        it could not be read (a damaged bridge aside: its base is copied without it) or it is held.
        It may still stop at a blob, after which `_copy` holds the steps that chain through it."""
        coming: dict[int, set[str]] = {}  # the marker names of the steps the pass may copy
        held = {}
        for step in pending:
            found = [(p, read[p]) for p in names[step]]
            stop = self._unchained(
                [(p, r.marker.prev_step) for p, r in found if isinstance(r, _Read)], at_mirror, coming
            )
            if stop is not None:
                held[step] = stop
            elif all(isinstance(r, _Read) or (p.bridge and r.damaged) for p, r in found):
                coming[step] = {p.marker_name for p, r in found if isinstance(r, _Read)}
        return held

    def _unchained(
        self,
        parts: list[tuple[_Part, int | None]],
        at_mirror: dict[int, set[str]],
        coming: Mapping[int, set[str]] | None = None,
    ) -> _Stop | None:
        """Why a step whose parts (each with the step its delta applies to) are ready is held: a
        delta part whose previous part (the same rank's, at its `prev_step`) is neither at the
        mirror nor copied in this pass (in `at_mirror`, or `coming`: a source that fills out of
        order), or is below what the mirror's retention keeps, so that every step listed at the
        mirror loads.  That part is missing as a blob whose marker the source holds
        is (`MirrorSettings.missing_after`), on the same clock.
        Following the source's retention, a part below the source's oldest step is deleted at the
        mirror once it holds a newer base, which the source holds and the mirror copies (in this
        pass or a later one).  With `keep_bases`, no delta the mirror lists applies to a step below
        its cutoff (a base at or above it comes between)."""
        kept = self._oldest if self.settings.keep_bases is None else 0
        for part, prev_step in parts:
            if part.bridge or prev_step is None or (prev_step in self._done and prev_step >= kept):
                continue
            prev = _Part(prev_step, part.rank, part.world_size, False)
            if prev_step < kept:  # at the mirror maybe, but its retention deletes it (`_retain`)
                return self._not_there(prev.marker_key)
            if prev_step not in at_mirror:  # not pending in this pass: what the mirror holds of it
                at_mirror[prev_step] = set(self.destination.objects.list(fmt.step_dir(prev_step)))
            if prev.marker_name not in at_mirror[prev_step] | (coming or {}).get(prev_step, set()):
                return self._not_there(prev.marker_key)
        return None

    def _unbridged(self, part: _Part, outcome: _Ready | _Stop) -> _Ready | _Stop | None:
        """`outcome`, or None for a damaged bridge: it is optional (its base's parts load without it,
        and a follower without a bridge marker reads the base), so its step is copied without it,
        neither its blob nor its marker, and the mirror goes on (said once)."""
        if not (part.bridge and isinstance(outcome, _Stop) and outcome.damaged):
            return outcome
        self._left_out.add(part)  # tried again at each listing while its base is the newest (`_heal_bridges`)
        if self._first_time(outcome.key):
            log.warning(
                "%s: %s/%s is damaged (%s); it is never copied, and step %d is mirrored without its bridge "
                "(followers there load the base)",
                self,
                self.source.url,
                outcome.key,
                outcome.reason,
                part.step,
            )
        return None

    def _heal_bridges(self, parts: set[_Part]) -> None:
        """Copy `parts`, bridges left out as damaged at an earlier pass, once good at the source (its
        blob, then its marker: it is visible only when its objects are there), while its base is the
        newest the mirror copied: followers that hold the step before it then read the bridge, not
        the base.  Held in memory only: a restarted mirror does not try them (bandwidth only)."""
        for part in sorted(parts):  # one the source deleted is not there: tried until a newer base
            outcome = self._prepare(part, set(self.destination.objects.list(fmt.step_dir(part.step))))
            with self._lock:  # read again at the next try
                self._markers.pop(part.marker_key, None)
                self._checked -= {part.marker_key, part.blob_key}
            if isinstance(outcome, _Ready):
                if not outcome.there:
                    self._write(part.marker_key, outcome.marker)
                self._left_out.discard(part)
                log.info("%s: %s/%s is good now, and copied", self, self.source.url, part.blob_key)

    def _prepare(self, part: _Part, at_mirror: set[str]) -> _Ready | _Stop:
        """Read `part`'s marker, and put its blob at the mirror, checked first."""
        return self._put(self._marker(part), at_mirror)

    def _marker(self, part: _Part) -> _Read | _Stop:
        """`part`'s marker from the source (read once: kept until its step is mirrored), checked
        (a thread's job)."""
        with self._lock:
            data = self._markers.get(part.marker_key)
        if data is None:
            data = self._read(part.marker_key, fmt.MAX_MARKER_BYTES)
            if data is None:  # deleted by the source's retention since it was listed
                return _Stop(part.marker_key, "is not at the source", damaged=False)
        try:
            marker = fmt.decode_commit(data)
            if self.source.trust is not None:
                assert self._run is not None  # claimed before any step
                place = fmt.PartPlace(part.step, part.rank, part.world_size, part.bridge)
                self.source.trust.check_part(self._run, marker, place, f"{self.source.url}/{part.marker_key}")
        except (FormatError, SignatureError) as err:
            return _Stop(part.marker_key, str(err), damaged=True)
        with self._lock:
            self._markers[part.marker_key] = data
            if marker.kind == fmt.Kind.DELTA and not part.bridge:  # a base read ahead is cut at a delta's size
                self._largest[part.rank] = max(marker.size, self._largest.get(part.rank, 0))
        return _Read(part, data, marker)

    def _put(self, read: _Read | _Stop, at_mirror: set[str]) -> _Ready | _Stop:
        """Put the blob of a part whose marker was read at the mirror, checked against the marker
        first (a thread's job); a part whose marker could not be read stays where it stopped."""
        if isinstance(read, _Stop):
            return read
        part, data, marker = read
        with self._lock:
            checked = part.blob_key in self._checked
            there = part.marker_key in self._checked
        if there or part.marker_name in at_mirror:  # by commit order its blob was written and checked first
            if not there:
                self._same(part.marker_key, data)
            return _Ready(part, data, marker.kind, marker.prev_step, there=True)
        if not checked:
            if part.blob_name in at_mirror:
                self._check_copy(part.blob_key, marker)
            else:
                blob = self._blob(part, marker)
                if blob is None:
                    return self._not_there(part.blob_key)
                try:
                    fmt.verify_blob(blob, marker)
                except (FormatError, ChecksumError) as err:
                    return _Stop(part.blob_key, str(err), damaged=True)
                self._write(part.blob_key, blob, marker=marker)
            with self._lock:
                self._checked.add(part.blob_key)
        return _Ready(part, data, marker.kind, marker.prev_step, there=False)

    def _not_there(self, key: str) -> _Stop:
        """A blob whose marker the source holds, or the part a delta applies to, missing: not there
        yet, or lost once it has been missing for `missing_after` (damage then: the mirror stops
        there, or passes it over)."""
        with self._lock:
            lost = self._missing.lost(MissingObjectError(key, key))
        if lost:
            return _Stop(key, f"has been missing for {self.settings.missing_after:g} s or more", damaged=True)
        return _Stop(key, "is not at the source yet", damaged=False)

    # ------------------------------------------------------------------ objects

    def _read(self, key: str, limit: int, start: int = 0) -> bytes | None:
        """A source object (from `start`), read with a bound (to one byte past `limit`: a larger
        object is damage, never read whole)."""
        data = self.source.objects.get(key, start, limit + 1)
        if data is not None:
            with self._lock:
                self.metrics.bytes_read += len(data)
        return data

    def _write(
        self, key: str, data: bytes, *, run: fmt.Run | None = None, marker: fmt.CommitMarker | None = None
    ) -> None:
        """Create `key` at the mirror; if it is there already it must be the same object."""
        if self.destination.objects.create(key, data):
            with self._lock:
                self.metrics.objects_copied += 1
                self.metrics.bytes_copied += len(data)
            return
        if marker is not None:
            self._check_copy(key, marker)
        elif run is not None:
            self._same_run(self.destination.objects.get(key, 0, fmt.MAX_MANIFEST_BYTES + 1), data, run)
        else:
            self._same(key, data)

    def _beat_every(self) -> float:
        """Seconds between reads of the source's heartbeat: once a usual step gap, not at every
        poll, and at least every `_IDLE_MOST`, so that through a trainer's pause, or between steps
        longer than that, the heartbeat at the mirror is at most that much older than the source's
        (for a follower whose `max_heartbeat_age` is below the step gap)."""
        return min(max(self.settings.poll_seconds, self._cadence.usual_gap() or _IDLE_MOST), _IDLE_MOST)

    def _beat_due(self) -> float | None:
        """When (`time.monotonic()`) the heartbeat is next read, in a signed run relayed before."""
        if self._beat_at is None or self._run is None or self._run.manifest.signer is None:
            return None
        return self._beat_at + self._beat_every()

    def _relay_heartbeat(self, throttled: bool = False) -> None:
        """Rewrite the mirror's heartbeat with the source's, if it changed (checked first, given
        trusted keys: a forged heartbeat would hide steps withheld).  Only a signed run has one.
        `throttled`: read it once `_beat_every` at most, not at every poll."""
        assert self._run is not None  # claimed before
        if self._run.manifest.signer is None:
            return
        now = time.monotonic()
        if throttled and (due := self._beat_due()) is not None and now < due:
            return
        self._beat_at = now
        data = self._read(fmt.HEARTBEAT, fmt.MAX_MARKER_BYTES)
        if data is None or data == self._heartbeat:
            return
        if self.source.trust is not None:
            where = f"{self.source.url}/{fmt.HEARTBEAT}"
            try:
                self.source.trust.check_heartbeat(self._run, fmt.decode_heartbeat(data), where)
            except (FormatError, SignatureError) as err:
                if self._first_time(fmt.HEARTBEAT):
                    log.warning("%s: not relaying %s: %s", self, where, err)
                return
        self.destination.objects.put(fmt.HEARTBEAT, data)
        self._heartbeat = data
        with self._lock:
            self.metrics.objects_copied += 1
            self.metrics.bytes_copied += len(data)

    def _same(self, key: str, data: bytes) -> None:
        found = self.destination.objects.get(key, 0, len(data) + 1)
        if found != data:
            raise ConflictError(
                f"{self.destination.url}/{key} differs from the source's: the mirror holds another chain, or a "
                "damaged copy; give the mirror a prefix of its own"
            )

    def _same_run(self, found: bytes | None, data: bytes, run: fmt.Run) -> None:
        if found == data:
            return
        try:
            other = fmt.decode_manifest(found or b"").run_id
        except FormatError:
            other = "unreadable"
        raise ConflictError(
            f"{self.destination.url} belongs to run {other}, not to run {run.run_id} of {self.source.url}: "
            "give the mirror a prefix of its own"
        )

    def _check_copy(self, key: str, marker: fmt.CommitMarker) -> None:
        found = self.destination.objects.get(key, 0, marker.size + 1)
        try:
            fmt.verify_blob(found or b"", marker)
        except (FormatError, ChecksumError) as err:
            raise ConflictError(
                f"{self.destination.url}/{key} is at the mirror but not the source's object ({err}): "
                "the mirror holds another chain, or a damaged copy"
            ) from None

    def _first_time(self, key: str) -> bool:
        """Whether `key` has not been warned about yet (it is from now on)."""
        first = key not in self._said
        self._said.add(key)
        return first

    def _say(self, stop: _Stop) -> None:
        if not stop.damaged:
            log.debug("%s: waiting for %s/%s, which %s", self, self.source.url, stop.key, stop.reason)
        elif self._first_time(stop.key):
            log.warning(
                "%s: stopped: %s/%s is damaged (%s); it is never copied, and mirroring goes on when the source "
                "heals or from a newer base",
                self,
                self.source.url,
                stop.key,
                stop.reason,
            )

    # ------------------------------------------------------------------ retention and metrics

    def _retain(self, listed: list[int] | None, mirrored_base: bool) -> None:
        """Delete what the source deleted (`listed`: the steps it holds; None: not listed this
        pass), or keep the mirror's own `keep_bases`; in retention's order, and never past the
        mirror's newest complete base (its readers' way in)."""
        keep = self.settings.keep_bases
        held = self.destination.published_steps()
        if keep is not None:
            if mirrored_base or not self._floor_checked:
                self._floor, self._floor_checked = cutoff(self.destination, keep), True
            doomed = [s for s in held if self._floor is not None and s < self._floor]
        else:
            gone = [s for s in held if listed and s < listed[0]]  # what the source's retention deleted
            newest_base = cutoff(self.destination, 1) if gone else None
            doomed = [s for s in gone if newest_base is not None and s < newest_base]
        delete_steps(self.destination, doomed)
        self._done -= set(doomed)
        with self._lock:
            self.metrics.steps_deleted += len(doomed)

    def _update(self, stopped: _Stop | None) -> None:
        source = max(self._known, default=None)
        mirrored = max(self._done, default=None)
        behind = [s for s in self._known if mirrored is None or s > mirrored]
        now = time.monotonic()
        self._seen = {s: t for s, t in self._seen.items() if s in self._known and s not in self._done}
        with self._lock:
            self.metrics.source_step = source
            self.metrics.mirror_step = mirrored
            self.metrics.steps_behind = len(behind)
            late = [t for s, t in self._seen.items() if mirrored is None or s > mirrored]  # a hole below: not lag
            self.metrics.lag_seconds = now - min(late) if late else 0.0
            self.metrics.stopped_at = None if stopped is None else f"{self.source.url}/{stopped.key}"


def _ranks(parts: list[_Part]) -> int:
    return len({p.rank for p in parts if not p.bridge})


def _base(ready: list[_Ready], world: int) -> bool:
    """Whether every rank's part of a step is a base: nothing before it is needed from there on."""
    return len({r.part.rank for r in ready if not r.part.bridge and r.kind == fmt.Kind.BASE}) == world
