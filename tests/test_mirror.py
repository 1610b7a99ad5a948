"""The chain mirror: commit order, resuming after SIGKILL, one read per source object, retention,
refusals, damage at the source, mirrors of mirrors."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT, DictObjects, assert_state, bf16_state, published_run, train
from lightning_delta import (
    ConflictError,
    DeltaLoader,
    DeltaPublisher,
    FollowSettings,
    Mirror,
    MirrorMetrics,
    MirrorSettings,
    PublisherSettings,
    Store,
    StoreError,
)
from lightning_delta import claim as claim_module
from lightning_delta import format as fmt
from lightning_delta import mirror as mirror_module
from lightning_delta.cadence import Cadence
from lightning_delta.cli import main
from lightning_delta.reader import ChainReader
from lightning_delta.retention import delete_steps
from tinylm import TinyLM


class Recording(DictObjects):
    """A dict store that records every write and deletion, in order, and every read, by key."""

    def __init__(self, url: str = "dict://mirror", objects: dict[str, bytes] | None = None) -> None:
        super().__init__(url)
        if objects is not None:
            self.objects = objects  # shared with another view of the same store
        self.events: list[tuple[str, str]] = []
        self.reads: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()  # GETs of an object not there (yet)
        self.hidden: set[str] = set()  # objects not there yet, as in a bucket that fills out of order
        self.lists = 0

    def list(self, key: str) -> list[str]:
        self.lists += 1
        return super().list(key)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        data = None if key in self.hidden else super().get(key, start, end)
        self.reads[key] += data is not None
        self.misses[key] += data is None
        return data

    def create(self, key: str, data: bytes) -> bool:
        created = key not in self.objects
        if created:
            self.objects[key] = bytes(data)
        self.events.append(("create" if created else "exists", key))
        return created

    def put(self, key: str, data: bytes) -> None:
        self.events.append(("put", key))
        super().put(key, data)

    def delete(self, keys) -> None:
        keys = list(keys)
        self.events += [("delete", k) for k in keys]
        super().delete(keys)

    def delete_prefix(self, key: str) -> None:
        self.events.append(("delete", key))
        super().delete_prefix(key)


def publish(objects: DictObjects, steps: int, base_every: int = 4, keep_bases: int | None = None, model=None):
    """A TinyLM trained and published for `steps` steps into `objects`; its true state per step."""
    torch.manual_seed(0)
    model = model or TinyLM()
    settings = PublisherSettings(base_every=base_every, keep_bases=keep_bases)
    with DeltaPublisher(Store(objects), model, settings) as publisher:
        return train(publisher, model, steps)


def on_a_fake_clock(monkeypatch) -> tuple[list[float], DictObjects, Recording, DictObjects]:
    """The mirror's clock (`clock[0]`, seconds, set by the test), a home store, the mirror's view of it
    (`Recording`: hides objects, counts reads) and the mirror's destination."""
    clock = [0.0]
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    shared = DictObjects()
    return clock, shared, Recording("dict://home", shared.objects), DictObjects("dict://m")


def assert_loads(store: Store | str, truth: dict, expected: list[int] | None = None) -> list[int]:
    """Every step listed at `store` loads bit-exactly (each from scratch); the steps listed."""
    steps = DeltaLoader(store).steps()
    if expected is not None:
        assert steps == expected
    for step in steps:
        assert_state(DeltaLoader(store).state_dict(step)[1], truth[step])
    return steps


def test_a_mirror_writes_in_commit_order_and_every_step_is_complete_only_once_all_of_it_is_there():
    source, mirror = DictObjects(), Recording()
    truth = publish(source, 11)  # bases at 1, 5 and 9, with bridges
    with Mirror(Store(source), Store(mirror), MirrorSettings(threads=4)) as m:
        metrics = m.sync()
    assert metrics.mirror_step == 11 and metrics.steps_behind == 0 and metrics.stopped_at is None
    assert [e for e, _ in mirror.events] == ["create"] * len(source.objects)
    written = [k for _, k in mirror.events]
    assert written[0] == fmt.RUN_MANIFEST and sorted(written) == sorted(source.objects)
    # Replay the writes: whenever a step is complete, all of it and every step before it is there.
    replay = DictObjects()
    for key in written:
        replay.put(key, source.objects[key])
        if key.endswith(".ldelta.commit"):
            assert key.removesuffix(".commit") in replay.objects  # the blob before its marker
        for step in ChainReader(Store(replay)).steps():
            older = [k for k in source.objects if k.startswith("steps/") and int(k.split("/")[2]) <= step]
            assert all(k in replay.objects for k in older), (key, step)
    assert_loads(Store(mirror), truth, list(range(1, 12)))


def test_a_mirror_killed_at_random_points_resumes_and_never_writes_an_object_twice(tmp_path):
    """And a follower at the mirror, following through the kills and restarts, hands out every step
    it lists bit-exactly (applied to the state it holds) and reaches the newest."""
    src, dst, log = str(tmp_path / "src"), str(tmp_path / "dst"), tmp_path / "twice.log"
    truth = published_run(src, 12, base_every=4)  # bases at 1, 5 and 9
    damaged = Path(src, fmt.blob_path(3, 0, 1))  # passed over from base 5, before and after each restart
    damaged.write_bytes(damaged.read_bytes()[:-1])
    objects = sum(len(files) for _, _, files in os.walk(src))
    rng = random.Random(40)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    kills = 0
    handed: dict[int, dict[str, torch.Tensor]] = {}
    failed: list[BaseException] = []
    turn = threading.Condition()

    def follow() -> None:
        try:
            for followed in DeltaLoader(dst).follow(FollowSettings(poll_seconds=0.01, jump=False, timeout=60)):
                with turn:
                    handed[followed.step] = followed.tensors
                    turn.notify_all()
                if followed.step == 12:
                    return
        except BaseException as err:  # said by the test's thread
            failed.append(err)
        finally:
            with turn:
                turn.notify_all()

    follower = threading.Thread(target=follow, daemon=True)
    # the first run killed after base 5's marker (26 writes in all, 8 markers after it) and before
    # step 12's: its restart must not stop again at step 3, with the base after it already there
    for kill_at in [objects - 10, *sorted(rng.sample(range(1, objects + 1), 3)), 0]:
        job = [sys.executable, str(ROOT / "tests" / "mirror_job.py"), src, dst, str(kill_at), str(log)]
        done = subprocess.run(job, env=env, capture_output=True, text=True, timeout=300)
        if kill_at:  # killed before its kill_at-th write of this run (it may have less to write)
            assert done.returncode in (-9, 0), done.stderr
            kills += done.returncode == -9
        else:
            assert done.returncode == 0, done.stderr
        listed = assert_loads(dst, truth)  # whatever it had done, every step listed loads
        if follower.ident is None:  # from the first run's steps on, before the mirror's restart
            follower.start()
        with turn:  # the follower takes the newest step the mirror lists before the mirror goes on
            caught_up = functools.partial(lambda newest: failed or max(handed, default=None) == newest, listed[-1])
            assert turn.wait_for(caught_up, timeout=60)
        assert not failed, failed
    assert kills >= 1
    assert_loads(dst, truth, [1, 2, *range(5, 13)])
    assert not log.exists(), log.read_text()  # no object was written twice
    follower.join(timeout=60)
    assert not failed and sorted(handed) == [1, 2, *range(5, 13)]  # replayed: every step listed, in order
    for step, tensors in handed.items():
        assert_state(tensors, truth[step])


def test_a_replay_follower_polling_while_a_mirror_writes_markers_never_skips_a_step():
    """The killed-at-random test's follower, handed 10 after 6 once under load: its poll looked into
    steps 7-9 before the mirror wrote their markers and into 10 after (in order).  A poll looks
    newest first: a step listed then has every step before it the mirror wrote listed too."""
    source = DictObjects()
    publish(source, 10)
    later = {k: v for k, v in source.objects.items() if "commit" in k and (fmt.parse_step_key(k) or 0) >= 7}
    mirror = DictObjects("dict://m")
    mirror.objects = {k: v for k, v in source.objects.items() if k not in later}  # blobs of 7-10 there

    def poll_at(key: str) -> list[str]:  # the mirror writes 7-10's markers just after the poll's
        found = DictObjects.list(mirror, key)  # first look into a step's folder
        if key.startswith(f"{fmt.block_dir(0)}/"):
            mirror.objects.update(later)
            later.clear()
        return found

    mirror.list = poll_at
    listed = DeltaLoader(Store(mirror)).steps(after=6)
    assert not later and listed == [7, 8, 9]  # 10 looked into first, before its marker: at the next poll


@pytest.mark.parametrize("held_up", [0.0, 100.0])
def test_each_source_object_is_read_once_across_passes(monkeypatch, held_up):
    """`held_up`: the mirror, waiting at step 5, is overdue at step 6 and lists the source, so it
    copies step 6's blob before step 5 can come; the pass that then finds step 6 by its name must
    not read that blob ahead again."""
    clock = [0.0]
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    shared = DictObjects()
    watched = Recording("dict://home", shared.objects)  # the mirror's view of the source
    torch.manual_seed(0)
    model = TinyLM()
    with (
        DeltaPublisher(Store(shared), model, PublisherSettings(base_every=3)) as publisher,
        Mirror(Store(watched), Store(DictObjects())) as mirror,
    ):
        truth = {}
        for step in range(1, 10):
            truth |= {step: t for step, t in enumerate(train(None, model, 1).values(), start=step)}
            publisher.publish(step)
            publisher.flush()
            clock[0] += {6: 1.0 + held_up, 7: 0.5 if held_up else 1.0}.get(step, 1.0)
            if step == 5:  # its marker is there, its blob not yet: the mirror waits at step 5
                watched.hidden.add(fmt.blob_path(5, 0, 1))
            if step == 7:
                watched.hidden.clear()
            assert mirror.sync().mirror_step == (step if step < 5 or step >= 7 else 4)
            mirror.sync()
        assert_loads(mirror.destination, truth, list(range(1, 10)))
    read = +watched.reads  # objects read (a GET of a step not there yet reads nothing)
    assert set(read) == set(shared.objects)  # every object, each byte once (a base read ahead: in
    assert set(read.values()) == {1, 2}  # two ranges, cut at a delta's size, then the rest)
    assert mirror.metrics.bytes_read == sum(len(v) for v in shared.objects.values())


@contextlib.contextmanager
def _following(base_every: int = 1000) -> Iterator[tuple[Callable[[int], None], Mirror, Recording, dict]]:
    """A trainer publishing the steps asked for (a base every `base_every`, deltas between) and a
    mirror of it that lists rarely: `publish(step)`, the mirror, its recorded view of the source,
    the truth."""
    shared = DictObjects()
    watched = Recording("dict://home", shared.objects)  # the mirror's view of the source
    torch.manual_seed(0)
    model = TinyLM()
    truth: dict = {}
    with (
        DeltaPublisher(Store(shared), model, PublisherSettings(base_every=base_every)) as publisher,
        Mirror(Store(watched), Store(DictObjects()), MirrorSettings(list_seconds=1000)) as mirror,
    ):

        def publish(step: int) -> None:
            truth[step] = train(None, model, 1, seed=step)[1]
            publisher.publish(step)
            publisher.flush()

        yield publish, mirror, watched, truth


def test_a_following_mirror_finds_steps_by_their_names_and_lists_the_source_only_when_one_is_overdue(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    with _following() as (publish, mirror, watched, truth):
        publish(3)
        publish(6)
        assert mirror.sync().mirror_step == 6 and mirror.metrics.listings == 1  # learns the stride, 3
        listed = watched.lists
        for step in (9, 12, 15, 18):  # each found by its names: no listing
            clock[0] += 1.0
            assert mirror.sync().mirror_step == step - 3
            publish(step)
            assert mirror.sync().mirror_step == step
        assert watched.lists == listed and mirror.metrics.listings == 1
        publish(40)  # not the 21 it expects
        clock[0] += 1.0
        assert mirror.sync().mirror_step == 18 and mirror.metrics.listings == 1  # not overdue yet
        clock[0] += 2.0  # twice the usual gap since step 18: a listing finds it
        metrics = mirror.sync()
        assert metrics.mirror_step == 40 and metrics.listings == 2 and metrics.steps_behind == 0
    assert_loads(mirror.destination, truth, [3, 6, 9, 12, 15, 18, 40])


def test_a_step_found_after_a_miss_is_exact_only_if_the_miss_was_just_before(monkeypatch):
    """A step the mirror found just after a pass that missed it (two polls, or twice a thinned
    poll's wait: an eighth of the time since the newest step) came about then: it anchors the
    cadence.  One found after the mirror was held up since its miss (a slow request, a stall) may
    have come any time in between, like a step found at the first poll."""
    clock, told = [0.0], []

    class Told(Cadence):
        def arrived(self, at: float, exact: bool = True) -> None:
            told.append(exact)
            super().arrived(at, exact)

    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(mirror_module, "Cadence", Told)
    with _following() as (publish, mirror, _, _):
        publish(1)
        publish(2)
        assert mirror.sync().mirror_step == 2 and told == [False]  # a listing: steps came any time
        clock[0] = 10.0
        assert mirror.sync().mirror_step == 2  # a miss
        publish(3)
        clock[0] = 11.0  # one poll later
        assert mirror.sync().mirror_step == 3 and told == [False, True]
        clock[0] = 20.0
        assert mirror.sync().mirror_step == 3  # a miss, then the mirror is held up
        publish(4)
        clock[0] = 26.0
        assert mirror.sync().mirror_step == 4 and told == [False, True, False]


class _Trainer:
    """The stop event of a following mirror (`Mirror.follow`) on a fake clock: each wait moves the
    clock on and publishes the steps committed by then (`commits`, step 1 first), each blob visible
    `blob_after` seconds after its marker (a replicated bucket); it stops once the mirror holds the
    last step.  `found[step]`: the clock when the mirror first held it; `waits`: every wait."""

    def __init__(self, clock: list[float], publish, watched: Recording, commits: list[float], blob_after=0.0):
        self.clock, self.publish, self.watched, self.commits = clock, publish, watched, commits
        self.blob_after, self.found, self.waits = blob_after, {}, []
        self.published, self.lists_before = 0, 0

    def is_set(self) -> bool:
        return len(self.found) == len(self.commits)

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.clock[0] += seconds
        while self.published < len(self.commits) and self.commits[self.published] <= self.clock[0]:
            self.published += 1
            self.publish(self.published)
            if self.commits[self.published - 1] + self.blob_after > self.clock[0]:
                self.watched.hidden.add(fmt.blob_path(self.published, 0, 1))
        for step in range(1, self.published + 1):
            if self.commits[step - 1] + self.blob_after <= self.clock[0]:
                self.watched.hidden.discard(fmt.blob_path(step, 0, 1))
        return self.is_set()

    def follow(self, mirror: Mirror) -> dict[int, float]:
        """How late the mirror held each step, after its commit (and its blob's)."""
        for metrics in mirror.follow(self):  # type: ignore[arg-type]
            if not self.found and metrics.mirror_step:
                self.lists_before = self.watched.lists  # the listings until the first step
            for step in range(1, (metrics.mirror_step or 0) + 1):
                self.found.setdefault(step, self.clock[0])
        return {s: at - self.commits[s - 1] - self.blob_after for s, at in self.found.items()}


def _paced(monkeypatch, commits: list[float], blob_after: float = 0.0) -> tuple[dict[int, float], _Trainer, Recording]:
    clock = [0.0]
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    with _following() as (publish, mirror, watched, truth):
        mirror.settings = dataclasses.replace(mirror.settings, poll_seconds=0.05, list_seconds=1e9)
        trainer = _Trainer(clock, publish, watched, commits, blob_after)
        late = trainer.follow(mirror)
        assert_loads(mirror.destination, truth, list(range(1, len(commits) + 1)))
    return late, trainer, watched


def test_a_paced_mirror_follows_a_trainer_that_speeds_up_at_its_new_pace(monkeypatch):
    """A step there at the first poll may be one of a backlog: the pass looks on and copies every
    step there, and two such finds in a row forget the rhythm learned (10 s here), so that the
    mirror does not sleep through the trainer's new 2 s steps (they were found up to 24 s late)."""
    commits = [10.0 * s for s in range(1, 9)] + [80.0 + 2.0 * s for s in range(1, 31)]
    late, trainer, watched = _paced(monkeypatch, commits)
    assert max(late[s] for s in range(14, 39)) <= 1.0, late  # a few steps after the change of pace
    # a backlog's steps found in one pass are no gap (else every pass after it would be overdue: a listing each)
    assert watched.lists - trainer.lists_before <= 10, watched.lists - trainer.lists_before


def test_a_paced_mirror_keeps_its_rhythm_on_a_source_whose_blobs_land_after_their_markers(monkeypatch):
    """A step whose marker is there and blob not yet is a miss: the pass that then finds it whole
    found it as it came, so the rhythm holds (each find counted as at the first poll, it never
    did, and the mirror polled every `poll` through every step: 5.8x the requests)."""
    commits = [2.0 * s for s in range(1, 41)]
    late, _, watched = _paced(monkeypatch, commits, blob_after=0.3)
    assert max(late[s] for s in range(8, 41)) <= 0.5, late
    asked = sum(watched.reads.values()) + sum(watched.misses.values())
    assert asked <= 14 * len(commits), asked


def test_a_paced_mirror_without_a_rhythm_polls_at_least_every_few_seconds(monkeypatch):
    """Polls thin out as a pause goes on, to `mirror._IDLE_MOST` apart at most: the first step
    after an hour's pause is found within that (it was 54 s late)."""
    commits = [0.0, 1.0, 3601.0, 3603.0, 3605.0]
    late, trainer, _ = _paced(monkeypatch, commits)
    assert max(trainer.waits) <= mirror_module._IDLE_MOST + 1e-9  # the fixed end, in floating point
    assert late[3] <= mirror_module._IDLE_MOST
    assert len(trainer.waits) < 3600 / mirror_module._IDLE_MOST * 2  # not a poll every 0.05 s


def test_a_paced_mirror_that_holds_no_step_yet_thins_its_listings_through_a_warm_up(monkeypatch):
    """A mirror that holds no step lists the source at each pass (which step comes first?); through
    a trainer's 10 s warm-up at a 0.05 s poll that was a listing a poll, about 200.  The polls thin
    out as the warm-up goes on, as without a rhythm, and the first step is found at most a sixteenth
    of the wait late."""
    late, trainer, _ = _paced(monkeypatch, [10.0, 12.0, 14.0])
    assert trainer.lists_before <= 64, trainer.lists_before  # 203 polling every 0.05 s
    assert late[1] <= 10.0 / 16 + 0.05, late


def test_a_paced_mirror_without_a_rhythm_reads_markers_only_until_a_step_may_be_near(monkeypatch):
    """Without a rhythm (a warm-up here) polls thin out and most of them miss: until half the usual
    gap has passed (none known: the whole wait) each asks for the marker only (one 404), not its
    blob too.  Once a rhythm is kept, each step's blob is read with its marker again."""
    commits = [10.0 + 2.0 * s for s in range(12)]
    _, _, watched = _paced(monkeypatch, commits)
    blob_misses = {s: watched.misses[fmt.blob_path(s, 0, 1)] for s in range(1, len(commits) + 1)}
    marker_misses = {s: watched.misses[fmt.commit_path(s, 0, 1)] for s in range(1, len(commits) + 1)}
    assert all(marker_misses[s] > 0 for s in (2, 3)), marker_misses  # thinned polls that missed
    assert blob_misses[1] == blob_misses[2] == 0 and 0 < 2 * blob_misses[3] <= marker_misses[3], blob_misses
    assert sum(blob_misses[s] for s in range(6, len(commits) + 1)) > 0, blob_misses  # read ahead again


@pytest.mark.parametrize("poll", [0.05, 10.0])
def test_a_paced_mirror_reads_a_signed_runs_heartbeat_every_few_seconds_between_long_steps(monkeypatch, tmp_path, poll):
    """A signed run's heartbeat was relayed once a usual step gap: between 30 s steps and through a
    pause, a follower of the mirror whose `max_heartbeat_age` is below the gap saw it stale.  The
    mirror reads the source's heartbeat at least every `_IDLE_MOST` (waking between passes for it,
    with no request for a step), and relays it when it changed; with passes `poll` 10 s apart too."""
    from lightning_delta.signing import keygen

    clock = [0.0]
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    keygen(str(tmp_path / "trainer"))
    shared = DictObjects()
    watched = Recording("dict://home", shared.objects)
    read_at: list[float] = []
    get = watched.get

    def timed(key: str, start: int = 0, end: int | None = None) -> bytes | None:
        if key == fmt.HEARTBEAT:
            read_at.append(clock[0])
        return get(key, start, end)

    watched.get = timed  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = TinyLM()
    settings = PublisherSettings(signing_key=str(tmp_path / "trainer"))
    commits = [30.0 * s for s in range(1, 6)] + [300.0]  # 30 s steps, then a 150 s pause
    with (
        DeltaPublisher(Store(shared), model, settings) as publisher,
        Mirror(Store(watched), Store(DictObjects()), MirrorSettings(poll_seconds=poll, list_seconds=1e9)) as mirror,
    ):

        def publish(step: int) -> None:
            train(None, model, 1, seed=step)
            publisher.publish(step)
            publisher.flush()

        trainer = _Trainer(clock, publish, watched, commits)
        trainer.follow(mirror)
        assert mirror.destination.objects.get(fmt.HEARTBEAT) is not None  # relayed
    first = read_at.index(next(t for t in read_at if t >= commits[0]))
    gaps = [b - a for a, b in itertools.pairwise(read_at[first:])]
    assert max(gaps) <= mirror_module._IDLE_MOST + 0.05, gaps
    assert len(gaps) <= 2 * (commits[-1] - commits[0]) / mirror_module._IDLE_MOST, len(gaps)  # not at every poll


def test_a_paced_mirror_thins_its_polls_through_a_pause_after_a_rhythm(monkeypatch):
    """Steps 2 s apart, then a ten-minute pause: while the rhythm held, a step due and not there
    was polled every `poll` (0.05 s) until the trainer resumed, 11,920 polls of the pause.  Beyond a
    whole gap overdue, the polls thin out as without a rhythm, and the step after the pause is found
    within `_IDLE_MOST`; the steps after it within a poll or two."""
    commits = [2.0 * s for s in range(1, 9)] + [616.0 + 2.0 * s for s in range(1, 9)]
    late, trainer, _ = _paced(monkeypatch, commits)
    pause = [at for at in itertools.accumulate(trainer.waits) if 20 < at < 616]  # the polls of the pause
    assert len(pause) < 400, len(pause)
    assert late[9] <= mirror_module._IDLE_MOST, late
    # once a step came, the pause is over: polls every `poll` until the rhythm is learned again
    # (measured from the rhythm's due time from before the pause, steps 11-13 were found 0.5-4.6 s
    # late; step 10 came before step 9 was found, and is found with it)
    assert max(late[s] for s in range(11, 17)) <= 0.2, str([round(late[s], 2) for s in sorted(late)])


def test_a_heartbeat_read_between_passes_does_not_delay_the_next_pass(monkeypatch, tmp_path):
    """The sleep the cadence asks for ends when it said, however long the heartbeat reads woken
    for during it take: each read's round trip was added to the sleep, so with 30 s steps every
    pass came 1.2 s late (six reads of 0.2 s), and steps found late reset the rhythm."""
    from lightning_delta.signing import keygen

    clock = [0.0]
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    keygen(str(tmp_path / "trainer"))
    shared = DictObjects()
    watched = Recording("dict://home", shared.objects)
    get = watched.get

    def timed(key: str, start: int = 0, end: int | None = None) -> bytes | None:
        if key == fmt.HEARTBEAT:
            clock[0] += 0.2  # its round trip to the source
        return get(key, start, end)

    watched.get = timed  # type: ignore[method-assign]
    torch.manual_seed(0)
    settings = PublisherSettings(signing_key=str(tmp_path / "trainer"))
    with (
        DeltaPublisher(Store(shared), TinyLM(), settings) as publisher,
        Mirror(Store(watched), Store(DictObjects()), MirrorSettings(poll_seconds=0.05, list_seconds=1e9)) as mirror,
    ):
        publisher.publish(1)
        publisher.flush()
        monkeypatch.setattr(mirror._cadence, "wait", lambda now, poll: 30.0)
        passes: list[float] = []

        class Stop:
            def is_set(self) -> bool:
                return len(passes) >= 4

            def wait(self, seconds: float) -> bool:
                clock[0] += seconds
                return False

        for _ in mirror.follow(Stop()):  # type: ignore[arg-type]
            passes.append(clock[0])
    gaps = [b - a for a, b in itertools.pairwise(passes)]
    assert all(30.0 <= gap <= 30.0 + 0.2 + 1e-9 for gap in gaps), gaps  # a read in the pass at most


def test_a_step_found_by_its_names_past_one_the_mirror_lacks_is_not_copied_before_it(monkeypatch):
    """The stride learned from a listing (3, 5: 2) guesses 7 after 5; once the trainer commits 6
    and 7, 7 is a delta from 6, which the mirror does not hold: copied, it would be a step listed at
    the mirror that no reader reaches.  The mirror lists instead, and copies 6 then 7."""
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: 0.0)
    with _following() as (publish, mirror, _, truth):
        publish(3)
        publish(5)
        assert mirror.sync().mirror_step == 5 and mirror.metrics.listings == 1  # the stride: 2
        publish(6)
        publish(7)
        assert mirror.sync().mirror_step == 5 and mirror.metrics.listings == 1  # 7 found, not copied
        assert mirror.destination.published_steps() == [3, 5]
        metrics = mirror.sync()  # a listing: 6, then 7
        assert metrics.mirror_step == 7 and metrics.listings == 2
    assert_loads(mirror.destination, truth, [3, 5, 6, 7])


def test_a_blob_read_with_its_marker_is_read_once_and_checked_before_it_is_written():
    """Found by its names, a step's blob is read with its marker, at once: a blob there before its
    marker is held (not read again), a damaged one is never written and is read again until it
    heals, and a step that just came costs no request for the one after it."""
    with _following() as (publish, mirror, watched, truth):
        publish(1)
        publish(2)
        assert mirror.sync().mirror_step == 2  # a listing
        publish(3)
        marker, blob = fmt.commit_path(3, 0, 1), fmt.blob_path(3, 0, 1)
        watched.hidden.add(marker)  # the blob is there, its commit not yet
        assert mirror.sync().mirror_step == 2
        assert watched.reads[blob] == 1 and blob not in mirror.destination.objects.objects
        watched.hidden.clear()
        assert mirror.sync().mirror_step == 3 and mirror.metrics.listings == 1  # found by its names
        assert watched.misses[fmt.commit_path(4, 0, 1)] == 0  # 3 had just come: 4 was not looked for
        publish(4)
        key = fmt.blob_path(4, 0, 1)
        good = watched.objects[key]
        watched.objects[key] = good[:-3] + bytes([good[-3] ^ 1]) + good[-2:]  # its marker says the old bytes
        for _ in range(2):
            metrics = mirror.sync()
            assert metrics.mirror_step == 3 and metrics.stopped_at == f"dict://home/{key}"
        assert key not in mirror.destination.objects.objects
        watched.objects[key] = good  # healed
        assert mirror.sync().mirror_step == 4
        read = +watched.reads
        assert read.pop(key) == 3 and set(read.values()) == {1}  # the damaged blob: each pass until healed
    assert_loads(mirror.destination, truth, [1, 2, 3, 4])


def test_a_base_read_with_its_marker_is_cut_at_a_deltas_size_and_its_rest_read_after_the_marker():
    """A mirror holds no whole base unchecked: a blob read ahead is cut at the rank's largest delta
    (a quarter more), so a base's rest is read once its marker says what it must be."""
    with _following(base_every=3) as (publish, mirror, watched, truth):
        got: list[tuple[str, int]] = []
        get = watched.get

        def recorded(key: str, start: int = 0, end: int | None = None) -> bytes | None:
            data = get(key, start, end)
            got.append((key, -1 if data is None else len(data)))
            return data

        watched.get = recorded  # type: ignore[method-assign]
        for step in (1, 2, 3):
            publish(step)
        assert mirror.sync().mirror_step == 3
        deltas = [n for k, n in got if k in (fmt.blob_path(2, 0, 1), fmt.blob_path(3, 0, 1))]
        publish(4)  # a base
        blob = fmt.blob_path(4, 0, 1)
        assert mirror.sync().mirror_step == 4
        reads = [n for k, n in got if k == blob]
        size = len(watched.objects[blob])
        assert size > max(deltas) * 5 // 4 + 4097  # else the bound would not cut it
        assert reads == [max(deltas) * 5 // 4 + 4097, size - reads[0]]  # cut, then the rest: read once
    assert_loads(mirror.destination, truth, [1, 2, 3, 4])


def test_a_cadence_waits_until_the_next_step_is_due_and_polls_once_steps_come_early_or_at_once():
    cadence = Cadence(keep=3)
    assert cadence.wait(0.0, 0.1) == 0.1 and not cadence.overdue(0.0)  # no rhythm yet: every poll
    for t in (0.0, 2.0, 4.0, 6.0):
        cadence.arrived(t)
    assert cadence.wait(6.0, 0.1) == pytest.approx(1.9)  # due at 8.0, less one poll
    assert cadence.wait(7.95, 0.1) == 0.1
    assert not cadence.overdue(9.9) and cadence.overdue(10.1)
    cadence.arrived(8.7)  # found late (it came at 8.0): the next is still due at 10.0, not 10.7
    assert cadence.wait(8.7, 0.1) == pytest.approx(1.2)
    cadence.arrived(9.5)  # an early step: it moves the schedule sooner (due at 11.5)
    assert cadence.wait(9.5, 0.1) == pytest.approx(1.9)
    cadence.arrived(9.5)  # a backlog found at once: every poll again
    assert cadence.wait(9.5, 0.1) == 0.1


def test_a_cadence_without_a_rhythm_polls_less_often_the_longer_no_step_came():
    """Before a rhythm (a trainer's warm-up, of unknown length), polls thin out to a sixteenth of
    the time since the newest step: a poll every `poll` through a long wait is a 404 each."""
    cadence = Cadence()
    assert cadence.wait(100.0, 0.1) == 0.1  # nothing yet: every poll
    cadence.arrived(10.0)
    assert cadence.wait(10.5, 0.1) == 0.1
    assert cadence.wait(26.0, 0.1) == pytest.approx(1.0)  # 16 s without a step: found at most 1 s late
    cadence.arrived(26.5)
    assert cadence.wait(26.5, 0.1) == 0.1 and cadence.wait(34.5, 0.1) == pytest.approx(0.5)  # one gap: no rhythm
    cadence.arrived(28.5)
    assert cadence.wait(28.5, 0.1) == pytest.approx(1.9)  # a rhythm: due at 30.5, less one poll


def test_a_cadence_with_a_late_share_wakes_at_that_quantile_of_where_the_recent_steps_put_the_next():
    """A trainer whose steps jitter: each recent arrival, whole usual gaps on, is a place the next
    step may come; `late` wakes at that quantile of them (fewer polls, that share found late)."""

    def jittery(late: float = 0.0) -> Cadence:
        cadence = Cadence(keep=4, late=late)
        for t in (0.0, 2.3, 4.0, 6.6, 8.0):  # gaps 2.3, 1.7, 2.6, 1.4: places 10.0, 10.3, 10.0, 10.6, 10.0
            cadence.arrived(t)  # each found after a miss: the lead stays 0
        return cadence

    two = Cadence(keep=4)
    for t in (0.0, 2.3, 4.0):
        two.arrived(t)
    assert two.wait(4.0, 0.1) == pytest.approx(1.6)  # two gaps: the shorter, 1.7, from the newest
    assert jittery().wait(8.0, 0.1) == pytest.approx(1.9)  # the earliest, 10.0
    assert jittery(0.75).wait(8.0, 0.1) == pytest.approx(2.2)  # the fourth of five, 10.3
    assert jittery(0.5).wait(8.0, 0.1) == pytest.approx(1.9)  # the third, 10.0
    paused = Cadence(keep=4)
    for t in (0.0, 8.5, 10.5, 12.5):  # a warm-up's pause, then a 2 s rhythm
        paused.arrived(t)
    assert paused.wait(12.5, 0.1) == pytest.approx(1.9)  # due at 14.5, not at 0.0 + 4 x 2.0 (passed)
    with pytest.raises(ValueError, match="late_share"):
        MirrorSettings(late_share=1.0)


def test_a_cadence_is_not_held_late_by_a_step_found_at_the_first_poll():
    """A step found late (the mirror was held up: it was there at the first poll) only says it
    came before: the next is still due on the rhythm, not a gap after the late find, which would
    carry the lag over to every later step."""
    cadence = Cadence()
    for t in (0.0, 30.0, 60.0, 90.0):
        cadence.arrived(t)
    cadence.arrived(139.0, exact=False)  # came at 120.0, found 19 s late
    assert cadence.wait(139.0, 1.0) == pytest.approx(10.0)  # due at 150.0, less one poll
    cadence.arrived(150.2)  # found after a miss: on the rhythm again
    assert cadence.wait(150.2, 1.0) == pytest.approx(28.8)
    shifted = Cadence()
    for t in (0.0, 30.0, 60.0, 90.0, 120.0):
        shifted.arrived(t)
    shifted.arrived(134.0, exact=False)  # a listing finds a step that came 16 s early (a new phase)
    assert shifted.wait(134.5, 1.0) == pytest.approx(28.5)  # its place, 164, is not cut as before a pause


def _poller(commits: list[float], poll: float = 0.05, late: float = 0.25) -> list[tuple[float, int]]:
    """A paced poller of a trainer committing at `commits` (a poll is instant and finds a step
    committed by then): how late it found each step, and after how many misses."""
    cadence = Cadence(late=late)
    now, missed_at, found = 0.0, None, []
    for commit in commits:
        misses = 0
        while now < commit:
            missed_at, misses = now, misses + 1
            now += cadence.wait(now, poll)
        cadence.arrived(now, exact=cadence.exact(now, missed_at, poll))
        found.append((now - commit, misses))
        missed_at = None
        now += cadence.wait(now, poll)
    return found


def test_a_cadence_learns_its_rhythm_from_steps_found_as_they_came_only():
    """A step found at the first poll came before it, by an unknown amount: gaps that end at such
    finds are the poller's own schedule.  Learned from them, a rhythm holds itself: after a warm-up,
    a 2.8 s gap and a step that came 0.9 s after it (the bench's trainer under load), a 2 s trainer
    was found 0.2-2.2 s late at every later step; from exact gaps only (two first-poll finds in a row
    turn the rhythm off: polls thin out and find steps as they come again), within a poll."""
    commits = [0.0, 11.7]
    for gap in (2.8, 0.9, 1.7) + (2.0,) * 9:
        commits.append(commits[-1] + gap)
    found = _poller(commits)
    assert max(late for late, _ in found[5:]) <= 0.05  # within a poll of the commit
    assert sum(misses for _, misses in found[-4:]) <= 2 * 4  # at the price of a miss or two a step, once steady
    assert found[1][0] <= 12.0 / 16  # before any rhythm: found at most a sixteenth of the wait late
    commits = [0.0, 13.2]
    for gap in (2.67, 1.68, 2.94, 1.9, 0.95, 2.15) + (2.0,) * 8:  # exact gaps, but their median is off
        commits.append(commits[-1] + gap)
    found = _poller(commits)
    assert found[6][0] > 0.3 and found[7][0] > 0.3  # the early step, and the next: two first-poll finds
    assert max(late for late, _ in found[8:]) <= 0.1  # then polls thin out, and the rhythm is learned again


def test_a_mirror_deletes_what_the_source_deleted_in_retentions_order():
    source, mirror = DictObjects(), Recording()
    torch.manual_seed(0)
    model = TinyLM()
    truth: dict = {}
    with (
        DeltaPublisher(Store(source), model, PublisherSettings(base_every=3, keep_bases=1)) as publisher,
        Mirror(Store(source), Store(mirror)) as m,
    ):
        for step in range(1, 12):  # bases at 1, 4, 7, 10: the source keeps from its newest on
            truth |= {step: t for step, t in enumerate(train(None, model, 1).values(), start=step)}
            publisher.publish(step)
            publisher.flush()
            mirror.events.clear()
            m.sync()
            assert Store(mirror).published_steps() == Store(source).published_steps()
            deleted = [k for e, k in mirror.events if e == "delete"]
            steps = [int(k.split("/")[2]) for k in deleted]
            assert steps == sorted(steps, reverse=True)  # newest first
            for folder in {fmt.step_dir(s) for s in steps}:  # each step's markers before the rest
                mine = [k for k in deleted if k.startswith(folder)]
                assert mine[-1] == folder and all(k.endswith(".commit") for k in mine[:-1]) and len(mine) > 1
    assert assert_loads(Store(mirror), truth) == [10, 11]


def test_a_mirror_keeps_its_own_bases_and_never_copies_what_it_would_delete():
    source, mirror = DictObjects(), Recording()
    torch.manual_seed(0)
    model = TinyLM()
    with (
        DeltaPublisher(Store(source), model, PublisherSettings(base_every=3)) as publisher,
        Mirror(Store(source), Store(mirror), MirrorSettings(keep_bases=2)) as m,
    ):
        truth = train(publisher, model, 8)  # bases at 1, 4, 7; the source keeps them all
        publisher.flush()
        assert m.sync().steps_deleted == 0  # a new mirror starts at the 2nd newest base
        assert Store(mirror).published_steps() == [4, 5, 6, 7, 8]
        for step in (9, 10, 11):  # a base at 10
            truth[step] = train(None, model, 1, seed=step)[1]
            publisher.publish(step)
        publisher.flush()
        assert m.sync().steps_deleted == 3
    assert assert_loads(Store(mirror), truth) == [7, 8, 9, 10, 11]
    assert Store(source).published_steps() == list(range(1, 12))
    written = {int(k.split("/")[2]) for e, k in mirror.events if e == "create" and k.startswith("steps/")}
    assert written == set(range(4, 12))


def test_a_destination_that_holds_another_run_is_refused_and_left_alone():
    source, other = DictObjects(), DictObjects()
    publish(source, 3)
    publish(other, 2)
    before = dict(other.objects)
    with Mirror(Store(source), Store(other)) as m, pytest.raises(ConflictError, match="belongs to run"):
        m.sync()
    assert other.objects == before
    stray = DictObjects()
    stray.put(f"{fmt.step_dir(1)}/something", b"x")
    with Mirror(Store(source), Store(stray)) as m, pytest.raises(ConflictError, match=r"no run\.json"):
        m.sync()
    assert list(stray.objects) == [f"{fmt.step_dir(1)}/something"]


def test_a_damaged_source_object_is_never_copied_and_the_mirror_goes_on_once_it_heals(caplog):
    source, mirror = DictObjects(), Recording()
    truth = publish(source, 7)  # bases at 1 and 5
    key = fmt.blob_path(6, 0, 1)  # no newer base: only healing lets the mirror go on
    good = source.objects[key]
    source.objects[key] = good[:-3] + bytes([good[-3] ^ 1]) + good[-2:]  # the marker still says the old bytes
    caplog.set_level(logging.WARNING, logger="lightning_delta.mirror")
    with Mirror(Store(source), Store(mirror)) as m:
        for _ in range(3):
            metrics = m.sync()
            assert metrics.mirror_step == 5 and metrics.stopped_at == f"dict://chain/{key}"
        assert key not in mirror.objects
        assert len([r for r in caplog.records if key in r.getMessage()]) == 1  # said once, not at every pass
        assert_loads(Store(mirror), truth, [1, 2, 3, 4, 5])
        source.objects[key] = good  # healed
        assert m.sync().mirror_step == 7
    assert_loads(Store(mirror), truth, list(range(1, 8)))
    assert [e for e, _ in mirror.events].count("exists") == 0


def test_a_damaged_source_object_is_passed_over_once_a_newer_base_does_not_need_it():
    source, mirror = DictObjects(), DictObjects()
    truth = publish(source, 7)  # bases at 1 and 5
    key = fmt.blob_path(3, 0, 1)
    source.objects[key] = source.objects[key][:-1]  # truncated
    with Mirror(Store(source), Store(mirror)) as m:
        metrics = m.sync()
    assert key not in mirror.objects and metrics.mirror_step == 7
    assert_loads(Store(mirror), truth, [1, 2, 5, 6, 7])  # 3 and 4 chain through the damage


@pytest.mark.parametrize("new", [True, False])
def test_a_restarted_mirror_does_not_stop_again_at_damage_a_newer_base_passed_over(new):
    """With a new step after the restart or none (a finished run): the damage is read once."""
    source, mirror = DictObjects(), DictObjects("dict://m")
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(Store(source), model, PublisherSettings(base_every=4)) as publisher:
        truth = train(publisher, model, 7)  # bases at 1 and 5
        publisher.flush()
        key = fmt.blob_path(3, 0, 1)
        source.objects[key] = source.objects[key][:-1]  # truncated: passed over from base 5
        with Mirror(Store(source), Store(mirror)) as m:
            assert m.sync().mirror_step == 7
        if new:
            truth[8] = train(None, model, 1, seed=8)[1]
            publisher.publish(8)
    watched = Recording("dict://chain", source.objects)
    with Mirror(Store(watched), Store(mirror), MirrorSettings(list_seconds=1e-9)) as m:  # restarted: a new
        metrics = m.sync()  # process knows nothing of the skip; every pass a listing
        again = m.sync()
    newest = 8 if new else 7
    for seen in (metrics, again):
        assert seen.mirror_step == newest and seen.stopped_at is None and seen.steps_behind == 0
    assert key not in mirror.objects
    assert watched.reads[key] == 1  # found damaged once, then passed over for good, not at every listing
    assert_loads(Store(mirror), truth, [1, 2, 5, 6, 7, 8][: newest - 2])


def test_a_restarted_mirror_copies_a_step_that_came_late_below_its_newest_base():
    """A step's marker that reaches the source after the mirror copied a newer base (a replicated
    bucket, a slow rank): a running mirror copies it at its next listing, and so must a restarted
    one.  Before it came, 5 and 6, which chain through it, were held (lost at once here, then passed
    over from base 7): a mirror lists only steps that load."""
    source, mirror = DictObjects(), DictObjects("dict://m")
    truth = publish(source, 8, base_every=6)  # bases at 1 and 7; 5 and 6 chain through 4
    key = fmt.commit_path(4, 0, 1)
    marker = source.objects.pop(key)
    with Mirror(Store(source), Store(mirror), MirrorSettings(list_seconds=1e-9, missing_after=0.0)) as m:
        assert m.sync().mirror_step == 8
    assert_loads(Store(mirror), truth, [1, 2, 3, 7, 8])
    source.objects[key] = marker
    with Mirror(Store(source), Store(mirror), MirrorSettings(list_seconds=1e-9)) as m:
        metrics = m.sync()
    assert metrics.stopped_at is None and metrics.steps_behind == 0
    assert_loads(Store(mirror), truth, list(range(1, 9)))


def test_a_store_error_while_a_restarted_mirror_reads_its_base_is_raised_and_claimed_again(monkeypatch):
    """A passing store error is not damage: the pass raises it, and the next one claims again and
    reads the mirror's base, so damage below it does not hold back the steps after it."""
    source, mirror = DictObjects(), DictObjects("dict://m")
    model = TinyLM()
    with DeltaPublisher(Store(source), model, PublisherSettings(base_every=4)) as publisher:
        truth = train(publisher, model, 7)  # bases at 1 and 5
        publisher.flush()
        key = fmt.blob_path(3, 0, 1)
        source.objects[key] = source.objects[key][:-1]  # passed over from base 5
        with Mirror(Store(source), Store(mirror)) as m:
            assert m.sync().mirror_step == 7
        truth[8] = train(None, model, 1, seed=8)[1]
        publisher.publish(8)
    failures = [StoreError("the mirror's store timed out")]

    def cutoff(*args):
        if failures:
            raise failures.pop()
        return real(*args)

    real = mirror_module.cutoff
    monkeypatch.setattr(mirror_module, "cutoff", cutoff)
    with Mirror(Store(source), Store(mirror), MirrorSettings(list_seconds=1e-9)) as m:
        with pytest.raises(StoreError, match="timed out"):
            m.sync()
        assert m.sync().mirror_step == 8
    assert_loads(Store(mirror), truth, [1, 2, 5, 6, 7, 8])


def test_a_damaged_marker_at_the_mirror_does_not_stop_a_restart():
    """The newest base a restarted mirror reads back (`cutoff`) may meet damage at the mirror: it
    is said, and the mirror goes on copying the source's new steps."""
    source, mirror = DictObjects(), DictObjects("dict://m")
    model = TinyLM()
    with DeltaPublisher(Store(source), model, PublisherSettings(base_every=4)) as publisher:
        truth = train(publisher, model, 7)  # bases at 1 and 5
        publisher.flush()
        with Mirror(Store(source), Store(mirror)) as m:
            assert m.sync().mirror_step == 7
        key = fmt.commit_path(7, 0, 1)
        mirror.objects[key] = mirror.objects[key][:-1]
        truth[8] = train(None, model, 1, seed=8)[1]
        publisher.publish(8)
    with Mirror(Store(source), Store(mirror)) as m:
        assert m.sync().mirror_step == 8
    for key in (fmt.blob_path(8, 0, 1), fmt.commit_path(8, 0, 1)):
        assert mirror.objects[key] == source.objects[key]
    for step in range(1, 7):  # the steps before the damage load
        assert_state(DeltaLoader(Store(mirror)).state_dict(step)[1], truth[step])


def test_a_late_bridge_holds_its_base_and_is_copied_once_it_comes():
    """Only a damaged bridge is left out: one not at a replicated source yet holds its base."""
    shared = DictObjects()
    watched, mirror = Recording("dict://home", shared.objects), DictObjects("dict://m")
    truth = publish(shared, 5, base_every=3)  # bases at 1 and 4, a bridge at 4
    late = fmt.blob_path(4, 0, 1, bridge=True)
    watched.hidden.add(late)
    with Mirror(Store(watched), Store(mirror)) as m:
        metrics = m.sync()
        assert metrics.mirror_step == 3 and metrics.stopped_at == f"dict://home/{late}"
        watched.hidden.clear()
        assert m.sync().mirror_step == 5
    assert late in mirror.objects and fmt.commit_path(4, 0, 1, bridge=True) in mirror.objects
    assert_loads(Store(mirror), truth, [1, 2, 3, 4, 5])


def test_a_damaged_bridge_is_said_once_while_its_base_waits(caplog):
    shared = DictObjects()
    watched, mirror = Recording("dict://home", shared.objects), DictObjects("dict://m")
    publish(shared, 5, base_every=3)
    key = fmt.blob_path(4, 0, 1, bridge=True)
    shared.objects[key] = shared.objects[key][:-1]
    watched.hidden.add(fmt.blob_path(4, 0, 1))  # the base itself late: step 4 prepared at every pass
    caplog.set_level(logging.WARNING, logger="lightning_delta.mirror")
    with Mirror(Store(watched), Store(mirror)) as m:
        assert m.sync().mirror_step == 3 and m.sync().mirror_step == 3
        watched.hidden.clear()
        assert m.sync().mirror_step == 5
    assert len([r for r in caplog.records if key in r.getMessage()]) == 1


@pytest.mark.parametrize("damaged", ["blob", "marker"])
def test_a_damaged_bridge_is_never_copied_and_its_base_is_mirrored_without_it(caplog, damaged):
    source, mirror = DictObjects(), DictObjects("dict://m")
    truth = publish(source, 5, base_every=3)  # bases at 1 and 4, a bridge at 4
    key = fmt.blob_path(4, 0, 1, bridge=True) + (".commit" if damaged == "marker" else "")
    source.objects[key] = source.objects[key][:-1]
    caplog.set_level(logging.WARNING, logger="lightning_delta.mirror")
    with Mirror(Store(source), Store(mirror)) as m:
        metrics = m.sync()
        assert metrics.mirror_step == 5 and metrics.stopped_at is None
        assert m.sync().mirror_step == 5
    assert not any("bridge" in k for k in mirror.objects)  # neither its blob nor its marker
    assert len([r for r in caplog.records if key in r.getMessage()]) == 1  # said once
    assert_loads(Store(mirror), truth, [1, 2, 3, 4, 5])  # step 4 from its base
    assert [r.bridge for r in Store(mirror).part_refs(4, 0, 1)] == [False]  # a follower at 3 reads the base


def test_a_bridge_left_out_is_copied_once_it_heals_while_its_base_is_the_mirrors_newest():
    """A damaged bridge is tried again at each listing until a newer base makes it useless: healed,
    its blob and then its marker are copied, so followers at the step before its base read it."""
    shared = DictObjects()
    watched, mirror = Recording("dict://home", shared.objects), Recording("dict://m")
    torch.manual_seed(0)
    model = TinyLM()
    first, second = fmt.blob_path(4, 0, 1, bridge=True), fmt.blob_path(7, 0, 1, bridge=True)
    with (
        DeltaPublisher(Store(shared), model, PublisherSettings(base_every=3)) as publisher,
        Mirror(Store(watched), Store(mirror), MirrorSettings(list_seconds=1e-9)) as m,  # lists at every pass
    ):
        truth = train(publisher, model, 5)  # bases at 1 and 4, a bridge at 4
        publisher.flush()
        good = shared.objects[first]
        shared.objects[first] = good[:-1]
        assert m.sync().mirror_step == 5 and first not in mirror.objects
        shared.objects[first] = good  # healed
        assert m.sync().mirror_step == 5
        assert mirror.events[-2:] == [("create", first), ("create", first + ".commit")]  # blob, then marker
        assert mirror.objects == shared.objects
        for step in range(6, 11):  # bases at 7 and 10
            truth[step] = train(None, model, 1, seed=step)[1]
            publisher.publish(step)
            publisher.flush()
            if step == 7:
                good = shared.objects[second]
                shared.objects[second] = good[:-1]
            if step in (8, 10):
                assert m.sync().mirror_step == step and second not in mirror.objects
        reads = watched.reads[second]
        shared.objects[second] = good  # healed after base 10 was mirrored: no follower needs it now
        assert m.sync().mirror_step == 10
    assert second not in mirror.objects and watched.reads[second] == reads  # not read again
    assert_loads(Store(mirror), truth, list(range(1, 11)))


def test_a_bridge_that_heals_as_a_newer_base_comes_is_neither_read_nor_copied():
    """Healed in the listing that copies a newer base, a bridge left out is of no use: not read."""
    shared = DictObjects()
    watched, mirror = Recording("dict://home", shared.objects), Recording("dict://m")
    torch.manual_seed(0)
    model = TinyLM()
    first = fmt.blob_path(4, 0, 1, bridge=True)
    with (
        DeltaPublisher(Store(shared), model, PublisherSettings(base_every=3)) as publisher,
        Mirror(Store(watched), Store(mirror), MirrorSettings(list_seconds=1e-9)) as m,
    ):
        truth = train(publisher, model, 5)  # bases at 1 and 4, a bridge at 4
        publisher.flush()
        good = shared.objects[first]
        shared.objects[first] = good[:-1]
        assert m.sync().mirror_step == 5 and first not in mirror.objects
        for step in (6, 7):  # a base at 7
            truth[step] = train(None, model, 1, seed=step)[1]
            publisher.publish(step)
        publisher.flush()
        shared.objects[first] = good  # healed as base 7 comes
        reads = watched.reads[first]
        assert m.sync().mirror_step == 7
    assert first not in mirror.objects and watched.reads[first] == reads
    assert_loads(Store(mirror), truth, list(range(1, 8)))


def test_a_blob_at_the_mirror_that_is_not_the_sources_is_refused_and_its_marker_not_written():
    source, mirror = DictObjects(), DictObjects("dict://m")
    publish(source, 3)
    key = fmt.blob_path(2, 0, 1)
    mirror.objects[fmt.RUN_MANIFEST] = source.objects[fmt.RUN_MANIFEST]
    mirror.objects[key] = source.objects[key][:-1]  # a damaged copy, left by something else
    with Mirror(Store(source), Store(mirror)) as m, pytest.raises(ConflictError, match="not the source's object"):
        m.sync()
    assert fmt.commit_path(2, 0, 1) not in mirror.objects and DeltaLoader(Store(mirror)).steps() == [1]


def test_a_marker_at_the_mirror_that_is_not_the_sources_is_refused():
    source, mirror = DictObjects(), DictObjects("dict://m")
    publish(source, 5)  # bases at 1 and 5, a bridge at 5 (its marker does not make the step complete)
    key = fmt.commit_path(5, 0, 1, bridge=True)
    mirror.objects[fmt.RUN_MANIFEST] = source.objects[fmt.RUN_MANIFEST]
    mirror.objects[key] = other = source.objects[key][:-1] + b" "
    with Mirror(Store(source), Store(mirror)) as m, pytest.raises(ConflictError, match="differs from the source's"):
        m.sync()
    assert mirror.objects[key] == other and fmt.commit_path(5, 0, 1) not in mirror.objects


def test_a_mirror_following_retention_never_deletes_past_its_own_newest_base():
    shared = DictObjects()
    watched, mirror = Recording("dict://home", shared.objects), DictObjects("dict://m")
    torch.manual_seed(0)
    model = TinyLM()
    with (
        DeltaPublisher(Store(shared), model, PublisherSettings(base_every=3, keep_bases=2)) as publisher,
        Mirror(Store(watched), Store(mirror), MirrorSettings(list_seconds=1e-9)) as m,  # lists at every pass
    ):
        truth = train(publisher, model, 5)  # bases at 1 and 4
        publisher.flush()
        assert m.sync().mirror_step == 5
        for step in range(6, 12):  # bases at 7 and 10: the source deletes 1 to 6
            truth[step] = train(None, model, 1, seed=step)[1]
            publisher.publish(step)
        publisher.flush()
        assert Store(shared).published_steps() == [7, 8, 9, 10, 11]
        watched.hidden.add(fmt.blob_path(7, 0, 1))  # not there yet: the mirror's newest base is still 4
        assert m.sync().mirror_step == 5
        assert assert_loads(Store(mirror), truth) == [4, 5]  # 1 to 3 deleted, not the base its readers need
        watched.hidden.clear()
        assert m.sync().mirror_step == 11
    assert assert_loads(Store(mirror), truth) == [7, 8, 9, 10, 11]


def test_a_late_blob_holds_the_mirror_at_its_step_which_reports_steps_behind_and_a_growing_lag(monkeypatch):
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    truth = publish(shared, 7)  # bases at 1 and 5
    late = fmt.blob_path(3, 0, 1)
    watched.hidden.add(late)  # not damage: a replicated bucket that has not received it yet
    with Mirror(Store(watched), Store(mirror)) as m:
        lags = []
        for clock[0] in (0.0, 10.0, 25.0):
            metrics = m.sync()
            assert metrics.mirror_step == 2 and metrics.stopped_at == f"dict://home/{late}"  # not passed over
            assert metrics.steps_behind == 5 and metrics.source_step == 7
            lags.append(metrics.lag_seconds)
        assert lags == [0.0, 10.0, 25.0]  # since step 3 was first seen complete at the source
        watched.hidden.clear()
        metrics = m.sync()
    assert metrics.mirror_step == 7 and metrics.steps_behind == 0 and metrics.lag_seconds == 0.0
    assert_loads(Store(mirror), truth, list(range(1, 8)))


def test_a_blob_still_missing_after_missing_after_is_damage(monkeypatch, caplog):
    """A marker whose blob never reaches a replicated source holds the mirror only `missing_after`
    seconds (a fake clock): then its step is damage, passed over at a newer base, or the mirror
    stops there, says which object, and goes on once it comes."""
    clock = [0.0]
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.WARNING, logger="lightning_delta.mirror")
    shared = DictObjects()
    watched, mirror = Recording("dict://home", shared.objects), DictObjects("dict://m")
    truth = publish(shared, 7)  # bases at 1 and 5
    lost, late = fmt.blob_path(3, 0, 1), fmt.blob_path(6, 0, 1)
    watched.hidden.add(lost)

    def said(key: str) -> int:
        return len([r for r in caplog.records if key in r.getMessage()])

    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        for clock[0] in (0.0, 119.0):
            metrics = m.sync()
            assert metrics.mirror_step == 2 and metrics.stopped_at == f"dict://home/{lost}" and not said(lost)
        clock[0] = 120.0  # lost: damage, said, and the next pass (a listing) passes it over from base 5
        assert m.sync().stopped_at == f"dict://home/{lost}" and said(lost) == 1
        metrics = m.sync()
        assert metrics.mirror_step == 7 and metrics.stopped_at is None
        assert lost not in mirror.objects
        assert_loads(Store(mirror), truth, [1, 2, 5, 6, 7])
        # no newer base: past the bound the mirror stops at the step, and goes on once the blob comes
        shared.objects.update({fmt.commit_path(3, 0, 1): b"", fmt.blob_path(3, 0, 1): b""})  # not read
        for key in (fmt.commit_path(6, 0, 1), fmt.commit_path(7, 0, 1)):
            del mirror.objects[key]  # the mirror at 5 again, step 6's blob not at the source yet
        del mirror.objects[late]
    watched.hidden = {late}
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        for clock[0] in (200.0, 319.0):
            metrics = m.sync()
            assert metrics.mirror_step == 5 and metrics.stopped_at == f"dict://home/{late}" and not said(late)
        for clock[0] in (320.0, 400.0):
            metrics = m.sync()
            assert metrics.mirror_step == 5 and metrics.stopped_at == f"dict://home/{late}" and said(late) == 1
        watched.hidden.clear()  # it came after all
        assert m.sync().mirror_step == 7 and m._missing._since == {}  # a pass waiting for nothing forgets
    assert_loads(Store(mirror), truth, [1, 2, 5, 6, 7])


def test_a_blob_missing_at_a_gap_in_the_step_numbers_is_lost_after_missing_after(monkeypatch):
    """Steps 3 -> 5 (a gap): the pass by names between listings asks for step 4, finds nothing, and
    neither forgets how long step 5's blob has been missing nor the stop (one rank; two ranks where
    one never committed a step are the same case): the mirror passes it over at the next base."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    torch.manual_seed(0)
    model = TinyLM()
    truth = {}
    with DeltaPublisher(Store(shared), model, PublisherSettings(base_every=4)) as publisher:
        for step in (1, 2, 3, 5, 6, 7, 8, 9):  # bases at 1, 5 and 9
            truth[step] = train(None, model, 1, seed=step)[1]
            publisher.publish(step)
    lost = fmt.blob_path(5, 0, 1)
    watched.hidden.add(lost)
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        for clock[0] in range(0, 120, 10):
            metrics = m.sync()
            assert metrics.mirror_step == 3 and metrics.stopped_at == f"dict://home/{lost}"
        clock[0] = 150.0  # lost (at the listing due by now), then passed over from base 7
        for _ in range(2):
            metrics = m.sync()
    assert metrics.mirror_step == 9 and metrics.stopped_at is None
    assert_loads(Store(mirror), truth, [1, 2, 3, 9])


def test_the_missing_clock_restarts_when_the_mirror_moves_on(monkeypatch):
    """A blob found missing while the mirror is held at an earlier step counts from when the mirror
    reaches its step, as a follower's does: not lost 21 s after that, lost `missing_after` after."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    truth = publish(shared, 12)  # bases at 1, 5 and 9
    first, second = fmt.blob_path(3, 0, 1), fmt.blob_path(7, 0, 1)
    watched.hidden |= {first, second}  # both late, found missing at the first pass
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        assert m.sync().mirror_step == 2
        clock[0] = 100.0
        watched.hidden.discard(first)
        assert m.sync().mirror_step == 6  # held at 7 from now
        for clock[0] in (121.0, 121.5, 240.0):
            metrics = m.sync()
            assert metrics.mirror_step == 6 and metrics.stopped_at == f"dict://home/{second}"
        clock[0] = 241.0  # missing since the pass at 121 (the first after the one that moved the mirror on)
        for _ in range(2):
            metrics = m.sync()
    assert metrics.mirror_step == 12 and metrics.stopped_at is None
    assert_loads(Store(mirror), truth, [1, 2, 3, 4, 5, 6, 9, 10, 11, 12])


def test_the_mirror_command_takes_missing_after(tmp_path, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    truth = published_run(src, 7, base_every=4)  # bases at 1 and 5
    Path(src, fmt.blob_path(3, 0, 1)).unlink()
    assert main(["mirror", src, dst, "--json"]) == 0  # 120 s by default: not there yet
    assert json.loads(capsys.readouterr().out)["mirror_step"] == 2
    assert main(["mirror", src, dst, "--json", "--missing-after", "0"]) == 0  # lost at once
    assert json.loads(capsys.readouterr().out)["mirror_step"] == 7
    assert_loads(dst, truth, [1, 2, 5, 6, 7])


def test_a_caught_up_mirror_reports_no_lag_for_a_step_below_its_newest_that_never_completes(monkeypatch):
    """A marker whose blob never reaches a replicated source, below the newest step the mirror
    holds: the mirror is not behind, its lag (what `--follow` shows) does not grow, and, lost, the
    blob holds nothing back (no stop, no listing at each pass); it is passed over for good (base 7
    needs nothing older: not copied if it comes; a restarted mirror would list it again).  Step 6,
    before base 7: a step after it would chain through it, and be held (every listed step loads)."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    publish(shared, 8, base_every=6)  # bases at 1 and 7
    key = fmt.commit_path(6, 0, 1)
    marker = shared.objects.pop(key)
    with Mirror(Store(watched), Store(mirror), MirrorSettings(list_seconds=30.0)) as m:
        assert m.sync().mirror_step == 8
        shared.objects[key] = marker  # the marker comes; its blob does not
        watched.hidden.add(fmt.blob_path(6, 0, 1))
        for clock[0] in (40.0, 41.0, 55.0, 200.0, 201.0, 202.0):  # lost from 160 on
            metrics = m.sync()
            assert metrics.mirror_step == 8 and metrics.steps_behind == 0 and metrics.lag_seconds == 0.0
            assert metrics.stopped_at is None
        assert metrics.listings == 3  # every `list_seconds` (at 0, 40, 200), not at each pass
        watched.hidden.clear()  # it came after all: passed over for good, its marker not read again
        clock[0] = 300.0
        assert m.sync().listings == 4
    assert key not in mirror.objects and watched.reads[key] == 1


def test_a_mirror_of_a_mirror_serves_every_step_exactly():
    home, region, zone = DictObjects("dict://home"), DictObjects("dict://region"), DictObjects("dict://zone")
    truth = publish(home, 9, base_every=3)
    with Mirror(Store(home), Store(region)) as first, Mirror(Store(region), Store(zone)) as second:
        first.sync()
        assert second.sync().mirror_step == 9
    assert zone.objects == home.objects  # the same bytes, markers and manifest included
    assert_loads(Store(zone), truth, list(range(1, 10)))


def test_the_mirror_command_copies_a_chain_and_reports_as_json(tmp_path, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    truth = published_run(src, 5, base_every=3)
    assert main(["mirror", src, dst, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mirror_step"] == 5 and report["steps_behind"] == 0 and report["bytes_copied"] > 0
    assert_loads(dst, truth, [1, 2, 3, 4, 5])
    assert main(["mirror", str(tmp_path / "nothing"), dst]) == 2
    assert "no lightning_delta run" in capsys.readouterr().err
    assert Path(dst, fmt.RUN_MANIFEST).exists()


def test_a_following_mirror_feeds_a_follower_at_the_mirror_while_the_trainer_publishes(tmp_path):
    home, region = str(tmp_path / "home"), str(tmp_path / "region")
    torch.manual_seed(0)
    model = TinyLM()
    truth: dict = {}
    publisher = DeltaPublisher(home, model, PublisherSettings(base_every=3))
    trainer = threading.Thread(target=lambda: truth.update(train(publisher, model, 8)))
    stop, passes = threading.Event(), []
    mirror = Mirror(home, region, MirrorSettings(poll_seconds=0.01))
    mirroring = threading.Thread(target=lambda: passes.extend(mirror.follow(stop)))
    trainer.start()
    mirroring.start()
    seen = {}
    try:
        for followed in DeltaLoader(region).follow(FollowSettings(poll_seconds=0.01, timeout=120)):
            seen[followed.step] = followed.tensors
            if followed.step == 8:
                break
    finally:
        stop.set()
        mirroring.join()
        trainer.join()
        publisher.close()
        mirror.close()
    assert max(seen) == 8 and all(s in truth for s in seen)
    for step, tensors in seen.items():
        assert_state(tensors, truth[step])
    copied = [p.bytes_copied for p in passes]
    assert copied == sorted(copied) and passes[-1].mirror_step == 8 and passes[-1].steps_behind == 0
    assert passes[-1].bytes_copied == sum(p.stat().st_size for p in Path(home).rglob("*") if p.is_file())


def test_the_mirror_command_follows_with_a_progress_line_until_interrupted(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    truth = published_run(src, 4, base_every=3)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "lightning_delta.cli", "mirror", src, dst, "--follow", "--poll-seconds", "0.05"]
    # SIGINT at its default in the child, as at a terminal: a shell without job control starts
    # background commands (a CI runner's, say) with SIGINT ignored, and the child would inherit it
    at_terminal = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=at_terminal
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("mirror at step 4 of 4, 0 behind, ") and "bytes copied" in line and "lag" in line
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()  # fail, not hang
                raise
    assert proc.returncode == 0, err
    assert_loads(dst, truth, [1, 2, 3, 4])


def test_the_mirror_command_follows_a_stalled_mirrors_growing_lag_without_a_line_at_every_pass(
    monkeypatch, tmp_path, capsys
):
    def passes(_mirror: Mirror, stop=None) -> Iterator[MirrorMetrics]:
        at = MirrorMetrics(source_step=5, mirror_step=5, bytes_copied=10)
        yield from [at] * 3  # caught up and idle: one line
        for lag in (0.3, 0.9, 1.2, 1.9, 2.5, 4.1, 5.0, 200.0, 230.0, 270.0):  # a stall: step 6 not mirrored
            yield dataclasses.replace(at, source_step=6, steps_behind=1, lag_seconds=lag)

    monkeypatch.setattr(Mirror, "follow", passes)
    assert main(["mirror", str(tmp_path / "src"), str(tmp_path / "dst"), "--follow"]) == 0
    lags = [line.rsplit("lag ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lags == ["0.0 s", "0.3 s", "1.9 s", "4.1 s", "200.0 s", "270.0 s"]  # doubled, or a minute more


def test_a_hole_below_the_newest_step_holds_back_only_the_steps_that_chain_through_it(monkeypatch):
    """Bases 1 and 7, mirrored to 8 while 4-6 were not at the source (a replica); then 4's marker
    comes and its blob never does, 5 and 6 (deltas on 4) come whole, and 10, 11 and 12 are published
    (no 9: only a listing finds 10).  The hole holds back 5 and 6, which chain through it (every
    listed step loads), and nothing above 8."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    torch.manual_seed(0)
    model = TinyLM()
    truth = {}
    with DeltaPublisher(Store(shared), model, PublisherSettings(base_every=6)) as publisher:
        for step in range(1, 9):
            truth[step] = train(None, model, 1, seed=step)[1]
            publisher.publish(step)
        publisher.flush()
        late = {k: shared.objects.pop(k) for k in list(shared.objects) if fmt.parse_step_key(k) in (4, 5, 6)}
        with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
            assert m.sync().mirror_step == 8
            shared.objects.update(late)
            watched.hidden.add(fmt.blob_path(4, 0, 1))
            for step in (10, 11, 12):
                truth[step] = train(None, model, 1, seed=step)[1]
                publisher.publish(step)
            publisher.flush()
            clock[0] = 10.0
            while m.metrics.listings < 3:  # before: held at 8 at every listing, until the next base
                metrics = m.sync()
                clock[0] += 10.0
    assert metrics.mirror_step == 12 and metrics.stopped_at is None
    assert_loads(Store(mirror), truth, [1, 2, 3, 7, 8, 10, 11, 12])


def test_a_pass_that_copies_steps_and_then_raises_moves_the_missing_clock_on(monkeypatch):
    """As `-k moves_on`, with a store error at the end of the pass that moved the mirror on (the
    caller passes again): the clock still counts step 7's blob from then, not from the first pass."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    publish(shared, 12)  # bases at 1, 5 and 9
    first, second = fmt.blob_path(3, 0, 1), fmt.blob_path(7, 0, 1)
    watched.hidden |= {first, second}
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        assert m.sync().mirror_step == 2
        clock[0] = 100.0
        watched.hidden.discard(first)
        relay = m._relay_heartbeat

        def fails_once() -> None:
            m._relay_heartbeat = relay  # type: ignore[method-assign]
            raise StoreError("the destination failed once")

        m._relay_heartbeat = fails_once  # type: ignore[method-assign]
        with pytest.raises(StoreError):
            m.sync()  # copied 3 to 6, then raised
        for clock[0] in (121.0, 122.0):
            metrics = m.sync()
    assert metrics.mirror_step == 6 and metrics.stopped_at == f"dict://home/{second}"  # before: 7 and 8 passed over


def test_a_delta_whose_previous_step_comes_after_it_is_held_until_it_comes(monkeypatch):
    """A source that fills out of order (a replicated bucket): step 7 there before step 6, which it
    applies to.  The mirror holds 7 (not damage, no step listed that does not load) until 6 comes,
    then copies both, in order."""
    clock, shared, watched, _ = on_a_fake_clock(monkeypatch)
    mirror = Recording("dict://m")
    truth = publish(shared, 9)  # bases at 1, 5 and 9
    six = {k: shared.objects.pop(k) for k in [k for k in shared.objects if k.startswith(fmt.step_dir(6))]}
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        for clock[0] in (0.0, 50.0, 100.0):  # a listing at 0 and 50 (list_seconds), names between
            metrics = m.sync()
            assert metrics.mirror_step == 5 and metrics.stopped_at == f"dict://home/{fmt.commit_path(6, 0, 1)}"
            assert fmt.commit_path(7, 0, 1) not in mirror.objects
        shared.objects.update(six)  # it came
        assert m.sync().mirror_step == 9
    markers = [k for e, k in mirror.events if e == "create" and k.endswith(".commit") and "bridge" not in k]
    assert markers == [fmt.commit_path(s, 0, 1) for s in range(1, 10)]  # 6's before 7's
    assert_loads(Store(mirror), truth, list(range(1, 10)))


def test_a_delta_whose_previous_step_never_comes_is_held_until_missing_after_then_passed_over(monkeypatch, caplog):
    """Step 6 never reaches the source: step 7 is held `missing_after`, then 6 is damage, said once:
    the mirror stops there, naming step 6's marker, and goes on at the next base (9, which comes later)."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    caplog.set_level(logging.WARNING, logger="lightning_delta.mirror")
    truth = publish(shared, 9)  # bases at 1, 5 and 9
    for k in [k for k in shared.objects if k.startswith(fmt.step_dir(6))]:
        del shared.objects[k]
    nine = {k: shared.objects.pop(k) for k in [k for k in shared.objects if k.startswith(fmt.step_dir(9))]}
    lost = f"dict://home/{fmt.commit_path(6, 0, 1)}"
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        for clock[0] in (0.0, 100.0, 130.0):  # listings (list_seconds 30): lost at 130
            metrics = m.sync()
            assert metrics.mirror_step == 5 and metrics.stopped_at == lost
            assert fmt.commit_path(7, 0, 1) not in mirror.objects
            assert len([r for r in caplog.records if lost in r.getMessage()]) == (clock[0] >= 120)
        shared.objects.update(nine)
        clock[0] = 131.0
        metrics = m.sync()
    assert metrics.mirror_step == 9 and metrics.stopped_at is None
    assert_loads(Store(mirror), truth, [1, 2, 3, 4, 5, 9])


def test_a_running_mirror_passes_over_damage_below_a_base_it_holds_as_a_restarted_one_does(monkeypatch):
    """Bases 1 and 7, mirrored to 8 while step 6 was not at the source; then 6 comes, its blob
    damaged.  A base the mirror holds needs nothing below it: the running mirror reads the damaged
    blob once and passes it over for good (not a read at every listing), as a restarted one does."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    truth = publish(shared, 8, base_every=6)  # bases at 1 and 7
    six = {k: shared.objects.pop(k) for k in [k for k in shared.objects if k.startswith(fmt.step_dir(6))]}
    key = fmt.blob_path(6, 0, 1)
    with Mirror(Store(watched), Store(mirror), MirrorSettings(list_seconds=30.0)) as m:
        assert m.sync().mirror_step == 8
        shared.objects.update(six)
        shared.objects[key] = six[key][:-1]  # truncated
        for clock[0] in (30.0, 60.0, 90.0):  # a listing each
            metrics = m.sync()
            assert metrics.mirror_step == 8 and metrics.stopped_at is None
        assert metrics.listings == 4 and watched.reads[key] == 1  # before: read at each listing
        shared.objects[key] = six[key]  # healed: no longer needed
        clock[0] = 120.0
        m.sync()
    assert key not in mirror.objects
    assert_loads(Store(mirror), truth, [1, 2, 3, 4, 5, 7, 8])


def test_a_late_delta_whose_previous_step_the_mirrors_retention_deletes_is_not_copied():
    """Bases 1 and 7, mirrored to 8 while step 6 was not at the source; then the source's retention
    deletes 1-5 and 6 comes after (a replica that does not replicate deletes).  The mirror deletes
    1-5 as the source did, so 6, a delta on 5, is not copied: it would be listed and not load."""
    shared, mirror = DictObjects(), DictObjects("dict://m")
    truth = publish(shared, 8, base_every=6)  # bases at 1 and 7
    six = {k: shared.objects.pop(k) for k in [k for k in shared.objects if k.startswith(fmt.step_dir(6))]}
    with Mirror(Store(shared), Store(mirror), MirrorSettings(list_seconds=1e-9)) as m:
        assert m.sync().mirror_step == 8
        delete_steps(Store(shared), [1, 2, 3, 4, 5])
        shared.objects.update(six)
        metrics = m.sync()
    assert metrics.mirror_step == 8 and metrics.stopped_at is None and metrics.steps_deleted == 5
    assert fmt.commit_path(6, 0, 1) not in mirror.objects
    assert_loads(Store(mirror), truth, [7, 8])


@pytest.mark.parametrize("passes", [1, 2])
def test_a_late_delta_is_not_copied_before_the_base_that_makes_retention_delete_its_previous_step(passes):
    """As `-k mirrors_retention_deletes`, but the mirror holds 1-5 only when the source (a replica)
    has deleted 1-5 and holds 6 (late), 7 and 8: base 7 is copied in the same pass as 6 (`passes`
    1), or the pass after it (2: 6 there before 7).  Either way the mirror then deletes 1-5, so 6,
    a delta on 5, is never copied (review rmir51's R1, R1b: listed, and did not load): it waits for
    5 at the source as for a late part."""
    shared, mirror = DictObjects(), DictObjects("dict://m")
    truth = publish(shared, 8, base_every=6)  # bases at 1 and 7
    later = {
        s: {k: shared.objects.pop(k) for k in list(shared.objects) if k.startswith(fmt.step_dir(s))} for s in (6, 7, 8)
    }
    # 5 is lost at once at the source (not before `missing_after` else): 6 is damage, passed over at 7
    with Mirror(Store(shared), Store(mirror), MirrorSettings(list_seconds=1e-9, missing_after=0.0)) as m:
        assert m.sync().mirror_step == 5
        delete_steps(Store(shared), [1, 2, 3, 4, 5])
        shared.objects.update(later[6])
        if passes == 2:
            assert m.sync().mirror_step == 5
        shared.objects.update(later[7] | later[8])
        metrics = m.sync()
    assert metrics.mirror_step == 8 and metrics.steps_deleted == 5
    assert fmt.commit_path(6, 0, 1) not in mirror.objects
    assert_loads(Store(mirror), truth, [7, 8])


def two_ranks(monkeypatch, objects: DictObjects, steps: int, skipped: int) -> dict:
    """A two-rank chain of `steps` states of TinyLM's tensors (one base, at step 1; each step adds
    its number, not trained: no time spent) in `objects`, published in this process, where rank 1
    does not publish `skipped` (its uploads fell behind: `Backlog.COALESCE`), so that step is only
    partly at the source, and rank 1's next part applies to the step before it; the true state per
    step.  The two ranks' publishers are made in two threads, their collectives a stand-in (a
    barrier), then publish step after step in this one."""
    torch.manual_seed(0)
    first = bf16_state(TinyLM())
    truth = {s: {k: v + s for k, v in first.items()} for s in range(1, steps + 1)}
    barrier, sent = threading.Barrier(2), [b"", b""]

    def exchange_bytes(mine: bytes, group: Any, device: torch.device) -> list[bytes]:
        sent[group.rank] = mine
        barrier.wait()
        both = list(sent)
        barrier.wait()
        return both

    monkeypatch.setattr(torch.distributed, "get_rank", lambda group: group.rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: 2)
    monkeypatch.setattr(claim_module, "group_device", lambda group, device: torch.device("cpu"))
    monkeypatch.setattr(claim_module, "exchange_bytes", exchange_bytes)
    at = [1]
    publishers: dict[int, DeltaPublisher] = {}

    def made(rank: int) -> None:
        group = types.SimpleNamespace(rank=rank)
        settings = PublisherSettings(base_every=1000)
        publishers[rank] = DeltaPublisher(Store(objects), lambda: truth[at[0]], settings, process_group=group)

    threads = [threading.Thread(target=made, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with publishers[0], publishers[1]:
        for at[0] in range(1, steps + 1):
            for rank, publisher in sorted(publishers.items()):
                if (rank, at[0]) != (1, skipped):
                    publisher.publish(at[0])
                    publisher.flush()
    return truth


def test_a_delta_on_a_part_of_a_step_copied_in_the_same_pass_is_copied_with_it(monkeypatch):
    """Two ranks; rank 1 never published step 4 (a backlog it coalesced), so its 5 applies to its 3,
    and rank 0's 5 to its 4: step 4 is never complete, and 5 and 6 load.  Mirrored to 3 before 4-6
    came, then one listing pass copies rank 0's part of 4 and then 5, whose rank 0 part needs it (the
    hold rule's "copied in the same pass"), and 6: every step the source serves, in that pass
    (before: 5 held until a later pass)."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    truth = two_ranks(monkeypatch, shared, 6, skipped=4)
    assert_loads(Store(shared), truth, [1, 2, 3, 5, 6])
    later = {k: shared.objects.pop(k) for k in list(shared.objects) if fmt.parse_step_key(k) in (4, 5, 6)}
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0, list_seconds=30.0)) as m:
        assert m.sync().mirror_step == 3
        shared.objects.update(later)
        clock[0] = 30.0  # a listing
        metrics = m.sync()
    assert metrics.mirror_step == 6 and metrics.stopped_at is None and metrics.listings == 2
    assert fmt.commit_path(4, 0, 2) in mirror.objects and fmt.commit_path(4, 1, 2) not in mirror.objects
    assert_loads(Store(mirror), truth, [1, 2, 3, 5, 6])


def test_a_held_delta_passed_over_leaves_nothing_at_the_mirror_and_nothing_kept(monkeypatch):
    """Step 6 never reaches the source: 7 and 8, which chain through it, are held, then passed over
    at base 9 once 6 is lost.  Their markers are read once each, their blobs never (read after the
    hold check, not before: review rmir51's finding 7), so the mirror holds nothing of 7 or 8, and
    keeps nothing of them once it passed them over (before: their blobs stayed at the mirror
    without markers, and their source markers in memory)."""
    clock, shared, watched, _ = on_a_fake_clock(monkeypatch)
    mirror = Recording("dict://m")
    truth = publish(shared, 9)  # bases at 1, 5 and 9
    for k in [k for k in shared.objects if fmt.parse_step_key(k) == 6]:
        del shared.objects[k]
    nine = {k: shared.objects.pop(k) for k in [k for k in shared.objects if fmt.parse_step_key(k) == 9]}
    passed = [(s, key) for s in (7, 8) for key in (fmt.commit_path(s, 0, 1), fmt.blob_path(s, 0, 1))]
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        for clock[0] in (0.0, 100.0, 130.0):  # held, then 6 lost at 130
            assert m.sync().mirror_step == 5
        assert {k for _, k in passed} & set(m._markers) == {fmt.commit_path(7, 0, 1), fmt.commit_path(8, 0, 1)}
        shared.objects.update(nine)
        clock[0] = 131.0
        metrics = m.sync()
        kept = set(m._markers) | m._checked
    assert metrics.mirror_step == 9 and metrics.stopped_at is None
    assert mirror.list(fmt.step_dir(7)) == [] and mirror.list(fmt.step_dir(8)) == []
    assert not [k for k in kept if fmt.parse_step_key(k) < 9]
    assert [watched.reads[k] for _, k in passed] == [1, 0, 1, 0]
    assert_loads(Store(mirror), truth, [1, 2, 3, 4, 5, 9])


@pytest.mark.parametrize("rhythm", [False, True])
def test_a_mirror_stopped_at_damage_lists_the_source_less_often_the_longer_it_is_stopped(monkeypatch, rhythm):
    """Step 6 never reaches the source: 7 and 8 are held, 6 is lost at 130 s.  Polled every second
    from then, the mirror lists the source at the next pass, then as long after each listing as it
    had been stopped then: 1, 2, 4, 8, 16 s and then every `list_seconds` (30), 8 listings in 100
    polls (before: one a poll, review rmir51's finding 6, each a LIST of every held step's folder),
    also after steps found by their names a second apart (a rhythm, whose next step is overdue all
    along: review rmir52's finding 1, one listing a poll again).  It still goes on, from base 9
    once a listing finds it."""
    clock, shared, watched, mirror = on_a_fake_clock(monkeypatch)
    truth = publish(shared, 10)  # bases at 1, 5 and 9
    for k in [k for k in shared.objects if fmt.parse_step_key(k) == 6]:
        del shared.objects[k]
    nine = {k: shared.objects.pop(k) for k in [k for k in shared.objects if fmt.parse_step_key(k) in (9, 10)]}
    later = {k: shared.objects.pop(k) for k in [k for k in shared.objects if fmt.parse_step_key(k) in (3, 4, 5)]}
    with Mirror(Store(watched), Store(mirror), MirrorSettings(missing_after=120.0)) as m:
        for step in (3, 4, 5):  # found by names at 7, 8 and 9 s (after 7 and 8 are held from 0 on), or listed at 0
            if rhythm:
                clock[0] = step + 4.0
                m.sync()
            shared.objects.update({k: v for k, v in later.items() if fmt.parse_step_key(k) == step})
        for clock[0] in (0.0, 130.0) if not rhythm else (10.0, 130.0):  # lost at 130
            assert m.sync().stopped_at == f"dict://home/{fmt.commit_path(6, 0, 1)}"
        listed = {}
        for clock[0] in range(131, 231):
            before = m.metrics.listings
            assert m.sync().mirror_step == 5
            listed[clock[0]] = m.metrics.listings - before
        assert [t - 130 for t, n in listed.items() if n] == [1, 2, 4, 8, 16, 32, 62, 92]
        shared.objects.update(nine)  # found at the next listing, at 252 (30 s after 222)
        for clock[0] in range(231, 253):
            metrics = m.sync()
            assert metrics.mirror_step == (10 if clock[0] >= 252 else 5)
    assert metrics.stopped_at is None
    assert_loads(Store(mirror), truth, [1, 2, 3, 4, 5, 9, 10])
