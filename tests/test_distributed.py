"""Real 2-process gloo Lightning runs: what the loader rebuilds equals what the trainer held."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, Revealing, bitwise_equal, torchrun
from forge import MESSAGE
from lightning_delta import (
    ChainError,
    ChecksumError,
    DeltaLoader,
    FollowSettings,
    FormatError,
    Mirror,
    MirrorSettings,
    SnapshotNotFoundError,
    Store,
)
from lightning_delta import format as fmt

pytestmark = pytest.mark.slow
JOB = ROOT / "tests" / "dist_job.py"


def run(tmp: Path, *args: str) -> tuple[str, Path]:
    store, truth = tmp / "store", tmp / "truth"
    torchrun(JOB, str(store), str(truth), *args)
    return str(store), truth


def truth_at(truth: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(truth / f"step-{step:06d}.safetensors")


def assert_rebuilds_every_step(store: str, truth: Path, steps: int) -> None:
    loader = DeltaLoader(store)
    assert loader.steps() == list(range(1, steps + 1))
    changed = 0
    previous = None
    for step in loader.steps():
        got, state = loader.state_dict(step)
        expected = truth_at(truth, step)
        assert got == step and state.keys() == expected.keys()
        for name in expected:
            assert bitwise_equal(state[name], expected[name]), (step, name)
        if previous is not None:
            changed += sum(
                int((expected[n].view(torch.int16) != previous[n].view(torch.int16)).sum()) for n in expected
            )
        previous = expected
    assert changed > 0, "the run changed no bf16 weight: the test would prove nothing"


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> tuple[str, Path]:
    return run(tmp_path_factory.mktemp("fsdp2"), "--strategy", "fsdp2", "--probe")


def test_fsdp2_chain_with_a_probe_is_bit_exact(fsdp2_run):
    """The probe's no-grad forward leaves FSDP2's root unsharded: the publisher must still read
    each rank's own shard (not the first rows of the full tensor, nor freed storage)."""
    store, truth = fsdp2_run
    assert_rebuilds_every_step(store, truth, 30)
    loader = DeltaLoader(store)
    for step in (1, 2, 30):
        loader.state_dict(step)
        expected = torch.load(truth / f"probe-{step:06d}.pt")
        assert loader.last_report.probe == tuple(expected.flatten().tolist()), step
    parts = Store(store)
    kinds = {s: parts.read_part(s, 0, 2).header.kind for s in range(1, 31)}
    assert [s for s, k in kinds.items() if k == fmt.Kind.BASE] == [1, 11, 21]
    # each rank uploaded only its own FSDP2 shard: the two parts of a weight are disjoint halves
    manifest = parts.manifest().manifest
    head = next(i for i, t in enumerate(manifest.tensors) if t.name == "head.weight")
    w0, w1 = ([s for p in manifest.ranks[r] for s in p if s.tensor == head] for r in range(2))
    assert len(w0) == len(w1) == 1 and (w0[0].start, w1[0].start) == (0, w0[0].numel)
    assert w0[0].numel + w1[0].numel == 97 * 32


def test_ddp_chain_is_bit_exact_and_uploads_each_byte_once(tmp_path):
    store, truth = run(tmp_path, "--strategy", "ddp")
    assert_rebuilds_every_step(store, truth, 30)
    parts = Store(store)
    sizes = [parts.manifest().numel(r) for r in range(2)]
    total = sum(t.numel() for t in truth_at(truth, 1).values())
    assert sum(sizes) == total and abs(sizes[0] - sizes[1]) <= 1


def test_gradient_accumulation_publishes_once_per_optimizer_step(tmp_path):
    store, truth = run(tmp_path, "--strategy", "fsdp2", "--accumulate", "2", "--steps", "12", "--base-every", "5")
    assert_rebuilds_every_step(store, truth, 12)


# ----------------------------------------------------------------------------- faults


@pytest.fixture
def store_copy(fsdp2_run, tmp_path) -> tuple[str, Path]:
    store, truth = fsdp2_run
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    return str(copy), truth


def test_a_missing_rank_part_makes_its_step_invisible(store_copy):
    store, truth = store_copy
    Path(store, fmt.commit_path(15, 1, 2)).unlink()
    loader = DeltaLoader(store)
    assert 15 not in loader.steps() and 14 in loader.steps()
    with pytest.raises(SnapshotNotFoundError):
        loader.state_dict(15)
    with pytest.raises(ChainError, match="step 15"):
        loader.state_dict(16)  # rank 1's delta at 16 needs its part at 15
    for step in (14, 21, 30):
        state = loader.state_dict(step)[1]
        assert all(bitwise_equal(state[n], t) for n, t in truth_at(truth, step).items())


def test_a_removed_delta_breaks_its_segment_only(store_copy):
    store, truth = store_copy
    shutil.rmtree(Path(store, fmt.step_dir(13)))
    loader = DeltaLoader(store)
    for step in range(14, 21):
        with pytest.raises(ChainError):
            DeltaLoader(store).state_dict(step)
    for step in [11, 12, 21, 25, 30]:
        state = loader.state_dict(step)[1]
        assert all(bitwise_equal(state[n], t) for n, t in truth_at(truth, step).items()), step


def test_a_flipped_byte_in_any_object_never_gives_wrong_weights(store_copy):
    store, truth = store_copy
    rng = random.Random(0)
    targets = [(step, rank) for step in (11, 12, 20) for rank in (0, 1)]  # a base, deltas
    checked = 0
    for step, rank in targets:
        for key in (fmt.blob_path(step, rank, 2), fmt.commit_path(step, rank, 2)):
            path = Path(store, key)
            original = path.read_bytes()
            positions = rng.sample(range(len(original)), min(25, len(original)))
            for pos in positions:
                flipped = bytearray(original)
                flipped[pos] ^= 1 << rng.randrange(8)
                path.write_bytes(bytes(flipped))
                with pytest.raises((ChecksumError, FormatError)):
                    DeltaLoader(store).state_dict(step)
                checked += 1
            path.write_bytes(original)
    assert checked > 200
    state = DeltaLoader(store).state_dict(20)[1]  # and untouched objects still load
    assert all(bitwise_equal(state[n], t) for n, t in truth_at(truth, 20).items())


@pytest.fixture(scope="module")
def replica_run(tmp_path_factory) -> list[dict]:
    """One run of tests/replica_job.py: two gloo processes as trainer ranks, then as one replica."""
    tmp = tmp_path_factory.mktemp("replica")
    out = tmp / "out"
    out.mkdir()
    torchrun(ROOT / "tests" / "replica_job.py", str(tmp / "store"), str(out))
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def test_a_replica_of_two_workers_downloads_one_copy_and_both_rebuild_exactly(replica_run):
    reports = replica_run
    for report in reports:
        assert report["exact"] == [True, True]
        assert report["followed"] == [7] and report["followed_exact"] == [True]
        assert 0.3 < report["bytes"][0] / report["alone_bytes"] < 0.7  # about half each
    assert sum(r["bytes"][0] for r in reports) == reports[0]["alone_bytes"]  # together: one copy
    # its own rank's chain: base 1 and deltas 2, 3; then deltas 4, 6, 7 and the bridge at 5, never base 5
    assert [r["parts"] for r in reports] == [[3, 4], [3, 4]]


def test_a_replica_of_modules_refuses_together_and_decides_together(replica_run):
    reports = [r["modules"] for r in replica_run]
    assert reports[0]["tampered"] > 0  # step 4 changes the tensors worker 1's module gets wrong
    for report in reports:
        assert report["module_3"]
        # worker 1 refused worker 0's patch; the base that would heal it is unreachable from
        # worker 1 only: both raise worker 1's StoreError, and neither wrote, not even worker 0
        assert report["refused"] == "StoreError" and report["untouched"]
        assert report["healed_exact_4"] and report["refusals_seen"] == 1
        assert report["caught_up"] == [6, 1] and report["caught_up_exact"]
    assert reports[0]["untouched_exact_3"] and not reports[1]["untouched_exact_3"]


def test_a_replica_refuses_a_value_only_the_trainers_checksum_can_catch(replica_run):
    for report in replica_run:
        kind, message = report["forged"]
        assert kind == "ChecksumError" and re.search(f"step 7: payload 0 .*{MESSAGE}", message), message


def test_a_rank_that_fails_in_any_collective_fails_every_rank_promptly_with_its_error(tmp_path):
    """No rank is left waiting: a publisher's claim on a prefix rank 0 cannot write, a replica's load
    and follow, and an engine's prepare, where one rank's store fails; an engine's in-place walk,
    where one worker's walk fails halfway (both then hold the step they held), where its undo fails
    too (both drop the step and re-sync from a base), and where the workers hold different steps
    (both load the next from its base); errors that are not `DeltaError`s in a
    prepare, a walk, a write and at init, a base part one worker reads damaged, and a store error in
    one worker's prefetcher.  Every rank raises the failing rank's `DeltaError` type (the timeout of
    `torchrun` is what a hang would hit)."""
    torchrun(ROOT / "tests" / "collective_job.py", str(tmp_path), timeout=240)
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for report in reports:
        for case in ("claim", "load", "follow", "engine"):
            assert report[case][0] == "StoreError", (case, report[case])
        assert "Not a directory (a part of the path is a regular file)" in report["claim"][2]
        assert report["many"] == [True] * 121
    assert "worker 1 of the group" in reports[0]["load"][2]  # rank 0 says whose error it raises
    for report in reports:  # rank 1 failed in its second walk, rank 0 walked them all: both took them back
        assert report["walk"][0] == "FormatError" and report["walk_untouched"], report["walk"]
    walked = reports[0]["walk_then"][0]  # the payloads of step 2 that are walked in place
    assert walked >= 2 and reports[1]["walk_then"] == [walked, 2]
    assert [reports[0]["walk_calls"], reports[1]["walk_calls"]] == [walked, 2]
    assert reports[0]["differ_then"] == reports[1]["differ_then"] == [True, 3]
    assert "worker 1 of the group" in reports[0]["walk"][2]
    # worker 1's walk and then its undo failed: both dropped step 3 and re-synced step 4 from its base
    assert [r["undo"][0] for r in reports] == ["ok", "ok"] and [r["undo_then"] for r in reports] == [[True, 4]] * 2
    # errors that are not `DeltaError`s: a `DeltaError` on every worker, naming worker 1, then both go on
    for case, kind in (("raw_prepare", "RuntimeError"), ("raw_init", "RuntimeError"), ("keyerror", "KeyError")):
        for report in reports:
            assert report[case][0] == "DeltaError", (case, report[case])
            assert f"worker 1 of the group: {kind}" in report[case][2], (case, report[case])
    for report in reports:
        assert report["keyerror_then"] == ["ok", 4, "ok"]
        # worker 1's parameters could not be listed, in a write, then from a prepare on: both raise
        # its error; the walk is taken back (both still hold step 4), the base written in part
        # (both hold no step); then both go on
        for case in ("params_write", "params_prepare"):
            assert report[case][0] == "DeltaError", (case, report[case])
            assert report[case][2].startswith("worker 1 of the group: RuntimeError: the engine's weights were released")
        assert report["params_write_untouched"] and report["params_write_held"] == 4
        assert report["params_prepare_held"] is None
        assert report["params_then"] == ["ok", 4, "ok"]
        # written in part on rank 0, not at all on rank 1: both hold no step, and re-sync from a base
        assert (
            report["oom_write"][0] == "DeltaError"
            and "worker 1 of the group: OutOfMemoryError" in report["oom_write"][2]
        )
        assert report["oom_held"] is None and report["oom_then"] == ["ok", 6, "ok"]
        # a base part damaged in worker 1's read alone: refused by the hash of the worker that read it,
        # on both, before anything is written; then both load the next step
        assert report["damaged"][0] == "ChecksumError" and "SHA-256" in report["damaged"][2], report["damaged"]
        assert report["damaged_untouched"] and report["damaged_then"] == ["ok", 6, "ok"]
        # rank 1's prefetcher met a store error: both prefetchers stop on it, and the update fetches again
        assert report["prefetch"][0] == "ok" and report["prefetch_then"] == [8, "ok", 0], report["prefetch"]
        assert report["verify_prefetching"] == ["ok"] * 20  # the check stops the prefetcher first
    assert reports[1]["params_prepare_asked"] >= 1 and reports[1]["params_write_asked"] >= 2
    assert reports[0]["oom_calls"] == [0, 0] and reports[1]["oom_calls"][1] >= 1, reports[1]  # as it walked whole


def test_a_worker_that_fails_before_a_classed_decode_asks_for_exponents_fails_the_group_promptly(tmp_path):
    """A CLASSED payload's decode asks the group for the held exponents (an exchange, then an
    all-reduce): worker 1 fails before it reaches that (decoding, filling in its exponents, writing)
    while worker 0 asks.  Both raise worker 1's error as the same `DeltaError`, no hang (the timeout
    of `torchrun`), nothing written before the point of no return, and after a failed write both
    re-sync from a base, exactly."""
    out = tmp_path / "out"
    out.mkdir()
    torchrun(ROOT / "tests" / "classed_job.py", str(tmp_path / "store"), str(out), timeout=150)
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["modes"] == ["CLASSED"] and report["payloads"] == 2
        for case, error in (("decode", "OutOfMemoryError"), ("fill", "RuntimeError")):
            kind, message, untouched, held = report[case]
            assert kind == "DeltaError" and f"worker 1 of the group: {error}" in message, (case, report[case])
            assert untouched and held == 1, (case, report[case])
        kind, message, _, held = report["write"]
        assert kind == "DeltaError" and "worker 1 of the group: OutOfMemoryError" in message and held is None
        assert report["resync"][0] == report["then"][0] == "ok" and report["resync_exact"] and report["then_exact"]
    # worker 0 asked the group for exponents worker 1 never asked for, and wrote on after worker 1 failed
    assert reports[0]["decode_asked"] > reports[1]["decode_asked"] >= 1
    assert reports[0]["write_calls"] > reports[1]["write_calls"] == 1 and reports[1]["write"][2]


# ----------------------------------------------------------------------------- stores that fill out of order


def objects_of(store: str) -> dict[str, bytes]:
    root = Path(store)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("seed", range(3))
def test_a_follower_of_a_two_rank_chain_revealed_out_of_order_hands_out_only_exact_steps(fsdp2_run, seed):
    """One rank's part of a step before the other's, one rank's chain ahead of the other's."""
    store, truth = fsdp2_run
    objects = objects_of(store)
    rng = random.Random(seed)
    order = sorted(objects)
    rng.shuffle(order)
    revealing = Revealing(objects, order, [rng.randint(1, 12) for _ in range(5)])
    seen = []
    for followed in DeltaLoader(Store(revealing)).follow(FollowSettings(poll_seconds=0.001, timeout=120)):
        expected = truth_at(truth, followed.step)
        assert all(bitwise_equal(followed.tensors[n], t) for n, t in expected.items()), followed.step
        assert followed.skipped == ()
        seen.append(followed.step)
        if followed.step == 30:
            break
    assert seen == sorted(set(seen)) and seen[-1] == 30


def test_a_mirror_of_a_two_rank_chain_with_an_incomplete_step_serves_what_the_source_serves(store_copy):
    """Rank 1's marker of 15 never comes: rank 1's 16-20 chain through it, so those steps are listed
    at the source but do not load there.  The mirror holds them (`missing_after`), then passes them
    over from base 21: every step it lists loads, and a follower there is served the steps a
    follower of the source is served."""
    store, truth = store_copy
    missing = fmt.commit_path(15, 1, 2)
    Path(store, missing).unlink()  # 15 incomplete; rank 1's 16..20 chain through it
    mirror = str(Path(store).parent / "mirror")
    with Mirror(store, mirror) as m:  # not there yet: held
        metrics = m.sync()
    assert metrics.mirror_step == 14 and metrics.stopped_at is not None and metrics.stopped_at.endswith(missing)
    with Mirror(store, mirror, MirrorSettings(missing_after=0.0)) as m:  # lost at once: passed over
        metrics = m.sync()
    assert metrics.mirror_step == 30 and metrics.stopped_at is None
    assert Path(mirror, fmt.commit_path(15, 0, 2)).exists()  # rank 0's part, which its 16 needs
    assert DeltaLoader(mirror).steps() == [*range(1, 15), *range(21, 31)]
    assert DeltaLoader(store).steps() == [*range(1, 15), *range(16, 31)]
    for step in (14, 16, 20, 21, 30):  # the edges of what is held (each load costs ~0.3 s)
        for where in (store, mirror):
            if 16 <= step <= 20:  # listed at the source only, and it does not load there
                if where == store:
                    with pytest.raises(ChainError, match="step 15"):
                        DeltaLoader(where).state_dict(step)
                continue
            state = DeltaLoader(where).state_dict(step)[1]
            assert all(bitwise_equal(state[n], t) for n, t in truth_at(truth, step).items()), (where, step)


def test_a_mirror_asks_for_one_ranks_objects_until_a_two_rank_step_comes(store_copy):
    """Following a two-rank chain, a pass that finds the next step not there yet asks for one
    rank's marker and blob (two 404s, not two per rank); once it comes, every rank's part."""
    store, truth = store_copy
    later = Path(store).parent / "later"
    later.mkdir()
    shutil.move(Path(store, fmt.step_dir(21)), later / "21")
    for step in range(22, 31):
        shutil.rmtree(Path(store, fmt.step_dir(step)))
    mirror = str(Path(store).parent / "mirror")
    with Mirror(store, mirror, MirrorSettings(list_seconds=1000)) as m:
        assert m.sync().mirror_step == 20 and m.metrics.listings == 1
        asked: list[str] = []
        get = m.source.objects.get

        def recorded(key: str, start: int = 0, end: int | None = None) -> bytes | None:
            asked.append(key)
            return get(key, start, end)

        m.source.objects.get = recorded  # type: ignore[method-assign]
        assert m.sync().mirror_step == 20 and m.metrics.listings == 1  # found by its names: not there
        assert sorted(asked) == sorted([fmt.blob_path(21, 0, 2), fmt.commit_path(21, 0, 2)])
        shutil.move(later / "21", Path(store, fmt.step_dir(21)))
        asked.clear()
        assert m.sync().mirror_step == 21
        assert {fmt.commit_path(21, 0, 2), fmt.commit_path(21, 1, 2)} <= set(asked)
    state = DeltaLoader(mirror).state_dict(21)[1]
    assert all(bitwise_equal(state[n], t) for n, t in truth_at(truth, 21).items())


def tried(rank: int, step: int, missing: int | None) -> list[str]:
    """The keys worker `rank` (trainer rank `rank`'s share) reads trying `step` from step 2 where its
    blob of step `missing` is not there: every marker, then the blobs newest first up to the missing one."""
    markers = [fmt.commit_path(s, rank, 2) for s in range(3, step + 1)] + [fmt.commit_path(5, rank, 2, bridge=True)]
    blobs = [fmt.blob_path(s, rank, 2, bridge=s == 5) for s in range(step, 2, -1) if missing is None or s > missing]
    return sorted(markers + blobs)


@pytest.mark.parametrize("case", ["back", "bound"])
def test_a_replica_past_a_hole_reads_each_poll_one_try_on_each_worker_and_stays_in_step(replica_run, case):
    """Held 2, trainer rank 1's blob of step 3 (worker 1's share) not there yet, 3 to 7 listed: worker
    1 names step 3, worker 0 (which has only its message) step 7, and both take the oldest, so each
    poll tries 7 once and then nothing newer than 3 (with the newest, or without the exchange, both
    would try 6, 5, 4 and 3 too, and read their blobs again).  Neither hands out a step or warns
    until the blob comes ("back": 7 through 3) or worker 0's bound passes ("bound": said once, 7
    rebuilt from the base at 5); the other worker's bound (0, then 1000) changes nothing."""
    for rank, report in enumerate(r[case] for r in replica_run):
        reads = [sorted(keys) for _, keys, _ in report["read"]]
        assert reads == [tried(rank, 7, 3 if rank == 1 else None), []] * 3, (rank, report["read"])
        assert all(size == stored for size, _, stored in report["read"])  # each object read whole, once
        assert report["not_yet"] == [7, 7, 7]  # the same outcome, each poll
        if case == "back":
            assert report["handed"] == [7, [], 5, True] and report["warnings"] == []  # the deltas 3, 4, 5, 6, 7
        else:
            assert report["handed"] == [7, [], 3, True]  # the base at 5, then 6 and 7
            [warning] = report["warnings"]
            assert "step 7 does not rebuild from the step held" in warning and fmt.blob_path(3, 1, 2) in warning


def test_a_replica_past_a_hole_hands_out_the_complete_step_below_it_on_both_workers(replica_run):
    """Held 2, trainer rank 0's blob of step 7 (worker 0's share) never comes: worker 0 names step
    7, worker 1 (which has only its message) none, and both try 6 next, in the same poll, and hand
    it out bit-exactly (were worker 1 to name 0, or neither to narrow, neither would try 6)."""
    for rank, report in enumerate(r["below"] for r in replica_run):
        # then the follower, prefetching, polls on while the caller holds 6: those reads are not counted
        reads = [sorted(keys) for _, keys, _ in report["read"][:2]]
        assert reads == [tried(rank, 7, 7 if rank == 0 else None), tried(rank, 6, None)], (rank, report["read"])
        assert all(size == stored for size, _, stored in report["read"][:2])
        assert report["handed"] == [6, [], 4, True] and report["not_yet"] == [7] and report["warnings"] == []


def test_a_replica_past_two_holes_tries_each_poll_once_down_to_the_oldest(replica_run):
    """Held 2, each worker misses a blob of its own share: worker 0 of step 6, worker 1 of step 3.
    Each names its own (not the first failing worker's, passed on to both), so both stop below 3
    after one try of 7 a poll (naming 6, both would try 5 too, each poll) until both come."""
    for rank, report in enumerate(r["two"] for r in replica_run):
        reads = [sorted(keys) for _, keys, _ in report["read"]]
        assert reads == [tried(rank, 7, 6 if rank == 0 else 3), []] * 3, (rank, report["read"])
        assert all(size == stored for size, _, stored in report["read"])
        assert report["not_yet"] == [7, 7, 7]
        assert report["handed"] == [7, [], 5, True] and report["warnings"] == []
