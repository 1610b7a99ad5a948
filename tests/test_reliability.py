"""Exact weights or a `DeltaError`, whatever the store holds and whatever order calls come in.

Each test reproduces one finding of the review of format 2 (issue #12) and pins its fix; the
stateful property test at the end drives random call sequences over a damaged chain.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kill_job
from conftest import Verdict, assert_state, bf16_state, published_run, replace_blob, verdict
from forge import MESSAGE, forge_value
from fuzz import _rle_bomb
from lightning_delta import (
    ChainError,
    ChecksumError,
    DeltaError,
    DeltaLoader,
    DeltaPublisher,
    FollowSettings,
    FormatError,
    PublisherSettings,
    Store,
    codec,
    wire,
)
from lightning_delta import format as fmt
from lightning_delta.objects import FsspecObjects
from lightning_delta.retention import collect

# ----------------------------------------------------------------------------- damage


def rewrite(store: Store, step: int, mutate: Callable[[bytearray], bytes], *, resign: bool) -> None:
    """Replace a step's blob by `mutate(blob)`; with `resign`, its marker is made to match, so
    only the header rules and the value checksums can catch the change."""
    key = fmt.blob_path(step, 0, 1)
    blob = bytes(mutate(bytearray(store.objects.get(key))))
    if resign:
        replace_blob(store, step, 0, 1, blob)
    else:
        store.objects.put(key, blob)


def flip_payload(blob: bytearray) -> bytearray:
    last = fmt.decode_blob(bytes(blob)).entries[-1]
    blob[len(blob) - last.length // 2] ^= 0x01
    return blob


def flip_header(blob: bytearray) -> bytearray:
    blob[40] ^= 0x01
    return blob


DAMAGE: dict[str, Callable[[Store, int, Path], None]] = {
    "payload bit, marker re-signed": lambda s, step, _: rewrite(s, step, flip_payload, resign=True),
    "one value, marker re-signed": lambda s, step, _: forge_value(s, step),  # only the value checksum sees it
    "header bit": lambda s, step, _: rewrite(s, step, flip_header, resign=False),
    "truncated": lambda s, step, _: rewrite(s, step, lambda b: b[:-7], resign=False),
    "blob deleted": lambda s, step, _: s.objects.delete([fmt.blob_path(step, 0, 1)]),
    "blob replaced by a folder": lambda s, step, _: (
        s.objects.delete([fmt.blob_path(step, 0, 1)]),
        os.makedirs(f"{s.url}/{fmt.blob_path(step, 0, 1)}/x"),
    ),
    "part of another run": lambda s, step, other: (
        s.objects.put(fmt.blob_path(step, 0, 1), Store(str(other)).objects.get(fmt.blob_path(step, 0, 1))),
        s.objects.put(fmt.commit_path(step, 0, 1), Store(str(other)).objects.get(fmt.commit_path(step, 0, 1))),
    ),
}


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Path:
    """The same seeded training published by another run: same layout, same bytes but the run id."""
    url = tmp_path_factory.mktemp("other") / "store"
    published_run(str(url), 8, base_every=10)
    return url


# ----------------------------------------------------------------------------- held steps


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_failed_load_never_changes_the_step_held(store_url, other_run, damage):
    """Issue #12, finding 1: state_dict(3) twice, a failing state_dict(7), then state_dict(3)."""
    truth = published_run(store_url, 8, base_every=10)
    store = Store(store_url)
    DAMAGE[damage](store, 7, other_run)
    loader = DeltaLoader(store_url)
    for _ in range(2):  # a poll that finds nothing new asks for the step it holds
        assert_state(loader.state_dict(3)[1], truth[3])
    with pytest.raises(DeltaError):
        loader.state_dict(7)
    assert_state(loader.state_dict(3)[1], truth[3])
    assert_state(loader.state_dict(6)[1], truth[6])
    with pytest.raises(DeltaError):
        loader.state_dict(8)
    assert_state(loader.state_dict(5)[1], truth[5])


def test_polling_the_newest_step_keeps_serving_it_exactly(store_url):
    truth = published_run(store_url, 4, base_every=10)
    loader = DeltaLoader(store_url)
    for _ in range(5):
        step, state = loader.state_dict()
        assert step == 4
        assert_state(state, truth[4])


def test_a_foreign_part_is_a_chain_error_and_verify_names_it(store_url, other_run, capsys):
    from lightning_delta.cli import main

    published_run(store_url, 8, base_every=10)
    DAMAGE["part of another run"](Store(store_url), 6, other_run)
    with pytest.raises(ChainError, match="foreign part"):
        DeltaLoader(store_url).state_dict(6)
    assert main(["verify", store_url]) == 1
    out = capsys.readouterr().out
    assert "step 6 rank 0 delta: ChainError" in out and "foreign part" in out and "step 5:" not in out


def test_parts_whose_links_do_not_meet_are_a_chain_error_not_a_skipped_step(store_url):
    """The chain link a replica's worker checks in the parts another worker fetched for it: each
    part's `prev_step` is the step of the part before it, or the parts are refused."""
    from lightning_delta.reader import ChainReader

    published_run(store_url, 4, base_every=10)
    store = Store(store_url)
    refs = [store.part_refs(step, 0, 1)[0] for step in (1, 2, 4)]  # 3 left out: 4 applies to 3
    blobs = [store.read_object(ref, 0, 1) for ref in refs]
    reader = ChainReader(store)
    assert [p.header.step for p in reader.parse(refs[:2], blobs[:2], 0)] == [1, 2]
    with pytest.raises(ChainError, match="step 4 does not follow step 2"):
        reader.parse(refs, blobs, 0)


# ----------------------------------------------------------------------------- sizes


def _raw_payload(n: int, sections: list[tuple[codec.Compressor, bytes]]) -> bytes:
    head = wire._HEADER.pack(codec.MAGIC, codec.Mode.RAW, codec.ValueCoding.NONE, 0, 1)
    out = [head, wire._varint(n), wire._varint(n), wire._varint(0)]
    for compressor, data in sections:
        out += [bytes([compressor]), wire._varint(len(data)), data]
    return b"".join(out)


@pytest.mark.parametrize(
    "frame",
    [
        _rle_bomb(3 << 29, declare=True),  # 49 KB that declares and would fill 1.5 GiB
        _rle_bomb(3 << 29, declare=False),  # the same without a declared size
        bytes([0xE0]) + (1 << 45).to_bytes(8, "little") + (1 | 2 | 1 << 3).to_bytes(3, "little") + b"\0",
    ],
    ids=["declared-1.5GiB", "undeclared-1.5GiB", "declared-2**45"],
)
def test_a_zstd_frame_never_sizes_its_own_output(frame):
    """Finding 2: the payload header's element count bounds every section before it is decoded."""
    payload = _raw_payload(1024, [(codec.Compressor.NONE, bytes(1024)), (codec.Compressor.ZSTD, frame)])
    with pytest.raises(FormatError, match="ZSTD section"):
        codec.decode(None, payload, numel=1024, dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", ["zeros", "random"])
def test_one_flipped_bit_in_a_small_payload_is_refused_or_caught_by_the_checksum(kind):
    """Every single-bit flip of a whole payload: a `FormatError`, the same bits, or values the
    trainer's checksum tells apart; both checks are reached."""
    truth = torch.zeros(1024) if kind == "zeros" else torch.randn(1024, generator=torch.Generator().manual_seed(0))
    truth = truth.to(torch.bfloat16)
    payload = bytearray(codec.encode(None, truth))
    seen = []
    for i in range(len(payload) * 8):
        payload[i // 8] ^= 1 << (i % 8)
        decode = functools.partial(codec.decode, None, bytes(payload), numel=1024, dtype=torch.bfloat16)
        seen.append(verdict(decode, truth))
        payload[i // 8] ^= 1 << (i % 8)
    assert Verdict.REFUSED in seen and Verdict.CAUGHT in seen
    assert seen.count(Verdict.SAME) < 0.01 * len(seen)


def test_a_payload_never_decodes_to_a_dtype_nobody_asked_for():
    """Found by scripts/fuzz.py (codec, seed 0, case 623150): a RAW bf16 payload whose dtype byte
    flipped to float16 decoded to float16 with the same bits, so the same checksum."""
    half = bytearray(codec.encode(None, torch.randn(7).to(torch.float16)))  # byte planes
    half[7] = 1  # dtype: bfloat16
    with pytest.raises(FormatError, match=r"bfloat16, expected torch\.float16"):
        codec.decode(None, bytes(half), numel=7, dtype=torch.float16)
    brain = bytearray(codec.encode(None, torch.randn(7).to(torch.bfloat16)))  # exponent bytes apart
    brain[7] = 2  # dtype: float16, which has no EXPONENT coding
    with pytest.raises(FormatError, match="inconsistent"):
        codec.decode(None, bytes(brain), numel=7, dtype=torch.bfloat16)


@pytest.mark.parametrize("numel", [2**31, 2**40, 2**40 + 1, 2**62])
def test_declared_sizes_are_bounded_before_allocation(numel):
    """Finding 3: an lz4 section of 2**31 bytes was an OverflowError, 2**62 elements a MemoryError."""
    payload = _raw_payload(numel, [(codec.Compressor.LZ4, b"\0" * 16), (codec.Compressor.LZ4, b"\0" * 16)])
    with pytest.raises(FormatError):
        codec.decode(None, payload, numel=numel, dtype=torch.bfloat16)


def test_an_object_larger_than_its_marker_is_not_read_whole(store_url):
    """Finding 2: a blob far larger than its marker says is refused after marker-size + 1 bytes."""
    published_run(store_url, 2)
    reads: list[int | None] = []

    class Recording(FsspecObjects):
        def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
            if key.endswith(".ldelta"):
                reads.append(end)
            return super().get(key, start, end)

    store = Store(Recording(store_url))
    key = fmt.blob_path(2, 0, 1)
    store.objects.put(key, store.objects.get(key) + bytes(8 << 20))
    reads.clear()
    with pytest.raises(FormatError, match="larger than"):
        store.read_part(2, 0, 1)
    assert None not in reads and max(reads) < 1 << 20


# ----------------------------------------------------------------------------- listing


def test_stray_names_are_ignored_and_logged_once(store_url, caplog):
    """Finding 6: a folder '²' made steps() raise, a folder '5' listed step 5 twice."""
    truth = published_run(store_url, 5)
    root = Path(store_url)
    for stray in ["steps/\u00b2", "steps/000000000/5", "steps/000000000/00000000000\uff15", "steps/000000001"]:
        (root / stray).mkdir()
    (root / "steps/000000000/000000001005").mkdir()  # a step in the wrong block
    (root / "steps/000000000/000000000003/rank-00000-of-00001.ldelta.tmp-1").write_bytes(b"x")
    loader = DeltaLoader(store_url)
    with caplog.at_level(logging.WARNING, logger="lightning_delta.store"):
        assert loader.steps() == [1, 2, 3, 4, 5]
        assert loader.steps() == [1, 2, 3, 4, 5]
    logged = [r.getMessage().split()[1].rstrip(":").rsplit("/", 1)[-1] for r in caplog.records]
    assert sorted(logged) == sorted(["000000001005", "00000000000\uff15", "5", "\u00b2"])  # once each
    assert_state(loader.state_dict(5)[1], truth[5])


def test_a_stale_or_hostile_latest_object_changes_nothing(store_url):
    """Finding 5: a `latest` of 10**12 listed 10**9 blocks; a stale one hid steps 1000-1003."""
    published_run(store_url, 3)
    Path(store_url, "latest").write_text(json.dumps({"step": 10**12}))
    assert DeltaLoader(store_url).steps(after=0) == [1, 2, 3]
    Path(store_url, "latest").write_text(json.dumps({"step": 1}))
    assert DeltaLoader(store_url).steps(after=1) == [2, 3]


def test_a_chain_without_a_manifest_is_refused(store_url):
    published_run(store_url, 2)
    os.remove(Path(store_url, fmt.RUN_MANIFEST))
    with pytest.raises(FormatError, match=r"no run\.json"):
        DeltaLoader(store_url).steps()
    assert DeltaLoader(str(Path(store_url).parent / "empty")).steps() == []


# ----------------------------------------------------------------------------- retention


class Killed(FsspecObjects):
    """An object store whose deleter dies (raises) at its `budget`-th deleting call."""

    def __init__(self, url: str, budget: int) -> None:
        super().__init__(url)
        self.budget = budget

    def _spend(self) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise KeyboardInterrupt("killed")

    def delete(self, keys) -> None:
        for key in list(keys):  # object by object, so a kill can fall between any two
            self._spend()
            super().delete([key])

    def delete_prefix(self, key: str) -> None:
        self._spend()
        super().delete_prefix(key)


def test_a_collection_killed_at_any_moment_leaves_every_listed_step_loadable(tmp_path):
    """Finding 7: gc deleted oldest first, so a kill left deltas whose base was gone."""
    source = tmp_path / "source"
    truth = published_run(str(source), 14, base_every=4)  # bases 1, 5, 9, 13
    moments = 0
    while True:
        url = tmp_path / f"kill-{moments}"
        shutil.copytree(source, url)
        try:
            deleted = collect(Store(Killed(str(url), moments)), keep_bases=1)
        except KeyboardInterrupt:
            deleted = None
        loader = DeltaLoader(str(url))
        listed = loader.steps()
        assert listed[-2:] == [13, 14]
        for step in listed:
            assert_state(loader.state_dict(step)[1], truth[step])
        if deleted is not None:
            assert deleted == list(range(1, 13)) and listed == [13, 14]
            break
        moments += 1
    assert moments == 26  # the markers (bridges at 5 and 9 too), then the folder, of each of the 12 steps


def test_a_collection_that_would_keep_no_base_is_refused_before_it_reads(tmp_path):
    with pytest.raises(ValueError, match=r"^keep_bases must be >= 1, got 0$"):
        collect(Store(str(tmp_path / "store")), keep_bases=0, dry_run=True)


# ----------------------------------------------------------------------------- any order of calls

STEPS, BASE_EVERY = 12, 4  # bases at 1, 5, 9
DAMAGED = {3: "one value, marker re-signed", 6: "part of another run", 10: "truncated"}
LOADABLE = {1, 2, 5, 9}  # every other step's chain passes a damaged part, and fails with its error:
REFUSED = {3: ChecksumError, 4: ChecksumError, 6: ChainError, 7: ChainError, 8: ChainError}
REFUSED |= {10: FormatError, 11: FormatError, 12: FormatError}


@pytest.fixture(scope="module")
def damaged_chain(tmp_path_factory, other_run) -> tuple[str, dict]:
    url = str(tmp_path_factory.mktemp("damaged") / "store")
    truth = published_run(url, STEPS, base_every=BASE_EVERY)
    for step, damage in DAMAGED.items():
        DAMAGE[damage](Store(url), step, other_run)
    return url, truth


def test_the_damaged_chain_loads_exactly_where_it_should(damaged_chain):
    url, truth = damaged_chain
    for step in range(1, STEPS + 1):
        loader = DeltaLoader(url)
        if step in LOADABLE:
            assert_state(loader.state_dict(step)[1], truth[step])
        else:
            with pytest.raises(REFUSED[step]) as refused:
                loader.state_dict(step)
            assert type(refused.value) is REFUSED[step]
            assert REFUSED[step] is not ChecksumError or MESSAGE in str(refused.value)


class LoaderCalls(RuleBasedStateMachine):
    """Random sequences of calls on one loader over a damaged chain, with a module bound to it or
    not: every tensor handed out, and every value of a bound module, equals the trainer's state
    for its step, every failure is a `DeltaError`, and a failure changes nothing."""

    url: str
    truth: dict

    @initialize()
    def open(self) -> None:
        from tinylm import TinyLM

        self.loader = DeltaLoader(self.url)
        self.module, self.bound = TinyLM(), False

    def _check(self, step: int | None, call: Callable[[], tuple[int, dict]]) -> None:
        try:
            got, state = call()
        except DeltaError:
            assert step is None or step not in LOADABLE or step > STEPS
            return
        assert got in LOADABLE and (step is None or got == step)
        assert_state(state, self.truth[got])

    @rule(step=st.integers(0, STEPS + 1))
    def state_dict(self, step: int) -> None:
        self._check(step, lambda: self.loader.state_dict(step))

    @rule()
    def newest(self) -> None:
        with pytest.raises(DeltaError):  # step 12 does not rebuild (step 10 is damaged)
            self.loader.state_dict()

    @rule(step=st.integers(0, STEPS + 1), fresh=st.booleans())
    def apply_to(self, step: int, fresh: bool) -> None:
        """Into the module bound to the loader (only the changes are written), or a fresh one."""
        from tinylm import TinyLM

        module = TinyLM() if fresh else self.module
        before = bf16_state(module)
        try:
            assert self.loader.apply_to(module, step) == step
        except DeltaError:
            assert step not in LOADABLE
            assert_state(bf16_state(module), before)  # nothing was written
            return
        assert step in LOADABLE
        assert_state(bf16_state(module), self.truth[step])
        self.module, self.bound = module, True

    @rule(after=st.integers(0, STEPS))
    def steps(self, after: int) -> None:
        assert self.loader.steps(after) == list(range(after + 1, STEPS + 1))

    @precondition(lambda self: any(s > (self.loader.held_step or 0) for s in LOADABLE))
    @rule()
    def follow_replays_what_rebuilds(self) -> None:
        held = self.loader.held_step or 0
        expected = sorted(s for s in LOADABLE if s > held)
        seen = []
        for followed in self.loader.follow(FollowSettings(poll_seconds=0.01, jump=False)):
            assert set(followed.skipped) <= set(DAMAGED) | {4, 7, 8}  # damaged, or chained through damage
            if self.bound:
                followed.apply_to(self.module)
                assert_state(bf16_state(self.module), self.truth[followed.step])
            else:
                assert_state(followed.tensors, self.truth[followed.step])
            seen.append(followed.step)
            if followed.step == expected[-1]:
                break
        assert seen == expected

    @precondition(lambda self: self.loader.held_step is not None)
    @rule()
    def verify(self) -> None:
        self.loader.verify()  # nothing changed the held state behind the loader's back

    @invariant()
    def the_held_state_is_intact(self) -> None:
        step = self.loader.held_step
        assert step is None or step in LOADABLE
        if step is not None:
            assert_state(self.loader.state_dict(step)[1], self.truth[step])
            if self.bound:
                assert_state(bf16_state(self.module), self.truth[step])


def test_any_sequence_of_calls_hands_out_exact_weights_or_a_delta_error(damaged_chain):
    url, truth = damaged_chain
    LoaderCalls.url, LoaderCalls.truth = url, truth
    runner = LoaderCalls.TestCase
    runner.settings = settings(
        max_examples=40,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    runner().runTest()


# ----------------------------------------------------------------------------- real kills


def _job(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).with_name("kill_job.py")), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # waits for the job to reach its work, however slow the machine
    assert line.strip() == "ready", proc.stderr.read()
    return proc


def _kill_at_random(proc: subprocess.Popen, rng: random.Random, seconds: float, *, may_finish: bool = False) -> None:
    """Kill the job at a random moment of its work (what is asserted holds at any); a job that
    ended on its own (crashed, or finished where `may_finish`) is no kill."""
    time.sleep(rng.uniform(0, seconds))
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    ended = {-signal.SIGKILL, 0} if may_finish else {-signal.SIGKILL}
    assert proc.returncode in ended, f"the job ended on its own ({proc.returncode}): {proc.stderr.read()[-3000:]}"


def _committed(proc: subprocess.Popen) -> int:
    """Wait for a publisher job's first step to be committed; that step."""
    line = proc.stdout.readline()
    assert line.startswith("committed "), f"{line!r}: {proc.stderr.read()[-3000:]}"
    return int(line.split()[1])


def _assert_listed_steps_exact(url: str) -> list[int]:
    loader = DeltaLoader(url)
    listed = loader.steps()
    truth = kill_job.states(max(listed, default=0))
    for step in listed:
        assert_state(loader.state_dict(step)[1], truth[step])
    return listed


@pytest.mark.slow
def test_publishers_killed_at_random_moments_leave_only_exact_steps_and_resume(tmp_path):
    """4 kills: a fresh run killed, then its resumption killed, twice (scripts/fuzz.py and the
    other tests here cover the same ground at scale; each job's start, torch's import, is most of
    a trial's time).  In the first trial a kill may land anywhere, before the first commit too; in
    the second, after each run's first step is committed: that step and the resumed run's first
    are listed, and exact."""
    rng = random.Random(0)
    for trial in range(2):
        synced = trial >= 1
        url = str(tmp_path / f"run-{trial}")
        job = _job("publish", url, "1")
        if synced:
            assert _committed(job) == 1
        _kill_at_random(job, rng, 1.5)
        listed = _assert_listed_steps_exact(url)
        assert not synced or listed[0] == 1
        store = Store(url)
        first = max(store.published_steps(), default=0) + 1  # past whatever the kill left behind
        manifest = store.manifest()
        job = _job("publish", url, str(first), *([manifest.run_id] if manifest else []))
        if synced:
            assert _committed(job) == first
        _kill_at_random(job, rng, 1.5)
        listed = _assert_listed_steps_exact(url)
        assert not listed or listed[0] == 1
        assert not synced or first in listed  # the resumed run published, and its steps rebuild


@pytest.mark.slow
def test_collections_killed_at_random_moments_leave_every_listed_step_loadable(tmp_path):
    """3 kills in the middle of a gc that deletes 35 steps (each deleting call slowed to 20 ms)."""
    source = str(tmp_path / "source")
    tensors = kill_job.initial()
    with DeltaPublisher(source, lambda: tensors, PublisherSettings(base_every=kill_job.BASE_EVERY)) as publisher:
        for step in range(1, 41):
            kill_job.evolve(tensors, step)
            publisher.publish(step)
    rng, cut = random.Random(0), []
    for trial in range(3):
        url = str(tmp_path / f"gc-{trial}")
        shutil.copytree(source, url)
        _kill_at_random(_job("gc", url), rng, 1.2, may_finish=True)
        listed = _assert_listed_steps_exact(url)
        assert listed[-5:] == [36, 37, 38, 39, 40]
        cut.append(len(listed))
    assert len(set(cut)) > 1  # the kills did land at different moments of the collection
