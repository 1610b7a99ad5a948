"""DeltaLoader.follow against a chain that is being written by a publisher in another thread."""

from __future__ import annotations

import itertools
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DictObjects, HookedObjects, Revealing, Said, bf16_state, bitwise_equal, train
from forge import MESSAGE, forge_value
from lightning_delta import (
    ChecksumError,
    DeltaLoader,
    DeltaPublisher,
    FollowedStep,
    FollowSettings,
    MissingObjectError,
    PublisherSettings,
    Store,
    StoreError,
    replica,
)
from lightning_delta import format as fmt
from lightning_delta import loader as loader_module
from lightning_delta.patch import StepPatch
from tinylm import TinyLM


class Trainer:
    """Publishes steps of a TinyLM on demand and remembers the true bf16 state of each."""

    def __init__(self, url: str, base_every: int = 5, keep_bases: int | None = None) -> None:
        torch.manual_seed(0)
        self.model, self.truth, self.step = TinyLM(), {}, 0
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.publisher = DeltaPublisher(
            url, self.model, PublisherSettings(base_every=base_every, keep_bases=keep_bases)
        )

    def steps(self, count: int, pause: float = 0.0, before: Progress | None = None) -> None:
        """Publish `count` steps; with `before`, each only once the follower handed out the previous
        one (a follower in sync, however slowly this machine runs it)."""
        for _ in range(count):
            if before is not None:
                before.wait_for(self.step)
            self.step += 1
            self.model(torch.randint(0, 97, (2, 9))).square().mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.truth[self.step] = bf16_state(self.model)
            self.publisher.publish(self.step)
            self.publisher.flush()
            time.sleep(pause)


class Progress:
    """The newest step a follower handed out, for a writer to wait on instead of a clock."""

    def __init__(self) -> None:
        self.newest, self.changed = 0, threading.Condition()

    def saw(self, step: int) -> None:
        with self.changed:
            self.newest = max(self.newest, step)
            self.changed.notify_all()

    def wait_for(self, step: int, timeout: float = 120.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.newest >= step, timeout), f"follower never reached {step}"


def until(follower: Iterator[FollowedStep], last: int) -> Iterator[FollowedStep]:
    """The steps `follower` hands out, up to `last` (a generous idle timeout only ends a lost test)."""
    for followed in follower:
        yield followed
        if followed.step >= last:
            return


def assert_exact(followed, truth) -> None:
    assert all(bitwise_equal(followed.tensors[n], t) for n, t in truth[followed.step].items()), followed.step


def test_a_follower_keeps_up_with_a_live_chain(store_url):
    trainer, progress = Trainer(store_url), Progress()
    trainer.steps(1)
    writer = threading.Thread(target=trainer.steps, args=(11, 0.0, progress))
    writer.start()
    seen = []
    for followed in until(DeltaLoader(store_url).follow(FollowSettings(poll_seconds=0.01, timeout=120)), 12):
        assert_exact(followed, trainer.truth)
        seen.append(followed.step)
        progress.saw(followed.step)
    writer.join()
    trainer.publisher.close()
    assert seen == list(range(1, 13))  # each step while the chain was written, none skipped


def test_a_follower_that_fell_behind_jumps_to_the_newest_step_and_reports_it(store_url):
    trainer = Trainer(store_url)
    trainer.steps(7)
    follower = DeltaLoader(store_url).follow(FollowSettings(poll_seconds=0.01, timeout=120))
    first = next(follower)
    assert first.step == 7 and first.behind == 0  # the newest, not step 1
    assert_exact(first, trainer.truth)
    trainer.steps(3)  # the caller is "generating" meanwhile
    rest = list(until(follower, 10))
    assert rest[-1].step == 10 and all(8 <= f.step <= 10 for f in rest)
    for followed in rest:
        assert followed.behind <= 10 - followed.step
    trainer.publisher.close()


class _OutvotedLoader(DeltaLoader):
    """A loader as worker 0 of a two-worker replica whose worker 1 always sees a different value
    (another listing, another verdict): a follower must take worker 0's decisions, in one process."""

    def decide(self, value: int | BaseException) -> list[int]:
        mine = super().decide(value)[0]
        return [mine, mine + 1000 if mine >= 0 else 0]


def test_a_follower_takes_group_rank_0s_decisions_whatever_the_other_workers_say(store_url):
    trainer = Trainer(store_url)
    trainer.steps(4)
    follower = _OutvotedLoader(store_url).follow(FollowSettings(poll_seconds=0.01, timeout=120))
    first = next(follower)
    assert (first.step, first.behind) == (4, 0)  # worker 1's 1004 and 1000 newer steps are not taken
    assert_exact(first, trainer.truth)
    trainer.steps(2)
    rest = list(until(follower, 6))
    # step 5 may be verified after step 6 was committed (behind 1), never worker 1's 1000 behind
    assert rest[-1].step == 6 and all(f.behind <= 6 - f.step for f in rest)
    trainer.publisher.close()


def test_a_replica_loads_group_rank_0s_newest_step_whatever_the_other_workers_list(store_url):
    trainer = Trainer(store_url)
    trainer.steps(4)
    step, state = _OutvotedLoader(store_url).state_dict()  # the newest: worker 1 lists 1004
    assert step == 4
    assert all(bitwise_equal(state[n], t) for n, t in trainer.truth[4].items())
    trainer.publisher.close()


@pytest.fixture
def one_worker_group() -> Iterator[dist.ProcessGroup]:
    """A real gloo group of one worker in this process (destroyed after: a publisher would take
    an initialised default group for its own)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_replica_workers_holding_different_steps_decode_the_step_from_its_base(
    store_url, one_worker_group, monkeypatch
):
    """Worker 1 of the replica (a stand-in: the held steps it reports) holds step 2 where worker 0
    holds 3, so no one held state can check the patches both send: both decode from the base."""
    trainer = Trainer(store_url, base_every=10)  # step 1 the base, 2 to 4 deltas
    trainer.steps(4)
    trainer.publisher.close()
    loader = DeltaLoader(store_url, process_group=one_worker_group)
    loader.state_dict(step=3)
    assert loader.prepare(4).report.parts_read == 1  # in agreement: the delta from the step held

    def worker_1_holds_step_2(mine: bytes | BaseException, group, device) -> list[bytes]:
        got = replica.exchange_bytes(mine, group, device)
        held_steps = isinstance(mine, bytes) and mine[:1] in (b"[", b"n")  # a list of steps, or null
        return [*got, b"[2]"] if held_steps else got

    monkeypatch.setattr(loader_module, "exchange_bytes", worker_1_holds_step_2)
    prepared = loader.prepare(4)
    assert prepared.report.parts_read == 4  # the base and every delta up to 4, not the step held
    loader.write(prepared)
    assert loader.held_step == 4
    assert all(bitwise_equal(loader.tensors_of(prepared)[n], t) for n, t in trainer.truth[4].items())


def test_a_lost_delta_is_skipped_and_the_follower_resyncs_at_the_next_base(store_url, caplog):
    trainer = Trainer(store_url, base_every=5)  # bases at 1, 6, 11
    trainer.steps(9)
    shutil.rmtree(Path(store_url, fmt.step_dir(8)))  # steps 9 and 10 cannot rebuild
    # missing_after=0: step 8 counts as lost at once, not as not there yet (see the out-of-order tests)
    follower = DeltaLoader(store_url).follow(FollowSettings(poll_seconds=0.01, timeout=120, missing_after=0))
    caplog.set_level(logging.WARNING, logger="lightning_delta.follow")
    writer = threading.Thread(target=trainer.steps, args=(3,))  # 10 (broken), 11 (base), 12
    writer.start()
    seen = []
    for followed in until(follower, 12):
        assert_exact(followed, trainer.truth)
        seen.append(followed)
    writer.join()
    trainer.publisher.close()
    assert [f.step for f in seen] in ([11, 12], [12])  # never 9 or 10, whose chain lost step 8
    assert seen[0].skipped[0] == 9 and set(seen[0].skipped) <= {9, 10}
    assert any("does not rebuild" in r.message for r in caplog.records)


@pytest.mark.parametrize("damage", ["bytes", "value"])
def test_a_corrupt_step_never_reaches_the_live_model(store_url, damage, caplog):
    """Damage planted before following starts (no race with the follower's reads): a flipped byte
    the marker's SHA-256 catches, or one value changed under a re-signed marker (tests/forge.py)
    that only the trainer's value checksum catches."""
    trainer = Trainer(store_url, base_every=4)  # bases at 1 and 5
    trainer.steps(5)
    if damage == "bytes":
        blob = Path(store_url, fmt.blob_path(4, 0, 1))
        data = bytearray(blob.read_bytes())
        data[-2] ^= 0x01
        blob.write_bytes(bytes(data))
    else:
        forge_value(Store(store_url), 4)
    caplog.set_level("WARNING", logger="lightning_delta.follow")
    live = TinyLM()
    loader = DeltaLoader(store_url)
    loader.apply_to(live, step=3)
    before = {k: v.detach().clone() for k, v in live.state_dict().items()}
    follower = loader.follow(FollowSettings(poll_seconds=0.01, jump=False, timeout=120))
    followed = next(follower)  # step 4 is tried, refused, and skipped; step 5 is a base
    assert (followed.step, followed.skipped) == (5, (4,))
    refusals = [r.args[1] for r in caplog.records if r.name == "lightning_delta.follow" and "rebuild" in r.msg]
    assert len(refusals) == 1 and isinstance(refusals[0], ChecksumError)
    said = "does not match its commit marker" if damage == "bytes" else f"step 4: payload 0 .*{MESSAGE}"
    assert re.search(said, str(refusals[0]))
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())  # nothing written yet
    followed.apply_to(live)
    assert_exact(followed, trainer.truth)
    assert all(bitwise_equal(t, trainer.truth[5][n]) for n, t in bf16_state(live).items())
    follower.close()
    trainer.publisher.close()


def test_a_step_the_caller_leaves_late_does_not_let_the_next_be_decoded_early(store_url):
    """The caller ends its turn with a step only once the follower has decoded the next (a slow
    generation, a busy machine): the follower must still wait for that next step's write before it
    decodes the one after, or it decodes against a state about to be replaced (seen in CI as
    "step 9 was decoded against a state the loader no longer holds")."""
    trainer = Trainer(store_url, base_every=10)
    trainer.steps(5)
    loader, listed = DeltaLoader(store_url), Progress()
    decoding: dict[int, threading.Event] = {step: threading.Event() for step in range(1, 6)}
    against: dict[int, int | None] = {}
    steps, prepare = loader.steps, loader.prepare

    def listing(after: int | None = None) -> list[int]:
        out = steps(after)
        if after is not None:
            listed.saw(after)  # having decoded step `after`, the follower counts the steps newer than it
        return out

    def decode(step: int, *, resync_missing: bool = True) -> StepPatch:
        against[step] = loader.held_step
        decoding[step].set()
        return prepare(step, resync_missing=resync_missing)

    loader.steps, loader.prepare = listing, decode  # type: ignore[method-assign]
    live, seen = TinyLM(), []
    for followed in until(loader.follow(FollowSettings(poll_seconds=0.01, jump=False, timeout=120)), 5):
        if followed.step > 1 and followed.step < 5:
            decoding[followed.step + 1].wait(0.2)  # room for an early decode to start: none may
        followed.apply_to(live)
        assert all(bitwise_equal(t, trainer.truth[followed.step][n]) for n, t in bf16_state(live).items())
        seen.append(followed.step)
        if followed.step < 5:
            listed.wait_for(followed.step + 1)  # the next step is decoded and on its way out
    assert seen == [1, 2, 3, 4, 5]
    assert against == {1: None, 2: 1, 3: 2, 4: 3, 5: 4}  # each decoded against the step before it
    trainer.publisher.close()


def test_a_poll_lists_one_block_however_long_the_run(store_url):
    listed: list[str] = []
    trainer = Trainer(store_url)
    trainer.step = 994  # steps 995..1004 straddle the first block boundary
    trainer.steps(10)
    loader = DeltaLoader(Store(HookedObjects(store_url, on_list=listed.append)))
    assert loader.steps() == list(range(995, 1005))  # a full listing: steps/, both blocks, new steps
    listed.clear()
    assert loader.steps(after=1000) == [1001, 1002, 1003, 1004]
    assert listed == ["steps", fmt.block_dir(1)]  # the blocks, then only the newest one
    trainer.steps(1)
    listed.clear()
    assert loader.steps(after=1004) == [1005]
    assert listed == ["steps", fmt.block_dir(1), fmt.step_dir(1005)]  # and the one new step
    trainer.publisher.close()


def test_replay_hands_out_every_complete_step_in_order(store_url):
    trainer = Trainer(store_url, base_every=4)
    trainer.steps(9)
    seen = []
    for followed in until(DeltaLoader(store_url).follow(FollowSettings(poll_seconds=0.01, jump=False, timeout=120)), 9):
        assert_exact(followed, trainer.truth)  # its tensors, taken before the next step
        seen.append(followed)
    assert [f.step for f in seen] == list(range(1, 10))
    assert [f.behind for f in seen] == list(range(8, -1, -1))
    trainer.publisher.close()


def test_catch_up_drops_steps_staler_than_max_staleness(store_url, caplog):
    trainer = Trainer(store_url)
    trainer.steps(3)
    caplog.set_level(logging.WARNING, logger="lightning_delta.follow")
    published = threading.Event()

    def while_step_4_is_read(key: str) -> None:  # four more steps land while step 4 is fetched
        if key == fmt.blob_path(4, 0, 1) and not published.is_set():
            published.set()
            trainer.steps(4)

    loader = DeltaLoader(Store(HookedObjects(store_url, before_read=while_step_4_is_read)))
    follower = loader.follow(FollowSettings(poll_seconds=0.01, max_staleness=1, catch_up=True, timeout=120))
    assert next(follower).step == 3
    trainer.steps(1)
    rest = list(until(follower, 8))
    assert published.is_set() and [f.step for f in rest] == [8] and rest[0].behind == 0
    assert any("step 4 is 4 steps behind" in r.message for r in caplog.records)
    assert_exact(rest[0], trainer.truth)
    trainer.publisher.close()


def test_retention_never_takes_what_a_live_follower_needs(store_url):
    trainer = Trainer(store_url, base_every=3, keep_bases=1)  # only the newest base's segment stays
    progress = Progress()
    writer = threading.Thread(target=trainer.steps, args=(20, 0.0, progress))
    writer.start()
    seen = []
    for followed in until(DeltaLoader(store_url).follow(FollowSettings(poll_seconds=0.01, timeout=120)), 20):
        assert followed.skipped == ()  # nothing it needed was ever gone
        assert_exact(followed, trainer.truth)
        seen.append(followed.step)
        progress.saw(followed.step)
    writer.join()
    trainer.publisher.close()
    assert seen == list(range(1, 21))
    assert Store(store_url).published_steps()[0] == 19  # older segments were deleted meanwhile


def test_a_follower_on_an_empty_prefix_says_once_what_it_waits_for(store_url):
    said = Said("no complete step yet")
    logging.getLogger("lightning_delta.follow").addHandler(said)
    trainer = Trainer(store_url)  # claims the prefix, publishes nothing yet
    follower = DeltaLoader(store_url).follow(FollowSettings(poll_seconds=0.01, timeout=120))
    seen: list[int] = []
    reader = threading.Thread(target=lambda: seen.extend(f.step for f in until(follower, 2)))
    reader.start()
    try:
        assert said.event.wait(120)  # it polls an empty chain: it says so before anything is published
        trainer.steps(2)
        reader.join()
    finally:
        logging.getLogger("lightning_delta.follow").removeHandler(said)
    trainer.publisher.close()
    assert seen[-1] == 2
    assert len(said.messages) == 1 and "polling every 0.01 s" in said.messages[0]


def test_a_report_prints_in_one_short_line(store_url):
    trainer = Trainer(store_url)
    trainer.publisher.publish(1, probe=torch.zeros(130))
    trainer.publisher.close()
    loader = DeltaLoader(store_url)
    loader.state_dict()
    text = repr(loader.last_report)
    assert "<130 log-probs>" in text and len(text) < 200 and "\n" not in text


def test_a_store_that_fails_for_good_ends_the_iteration_with_its_error(store_url):
    """Damage is skipped (the next base heals it); a store that cannot be read is not damage."""
    trainer = Trainer(store_url)
    trainer.steps(2)
    down = threading.Event()

    def unreachable(key: str) -> None:
        if down.is_set() and key.endswith(".ldelta"):
            raise StoreError(f"{store_url}: the endpoint is unreachable while reading {key}")

    loader = DeltaLoader(Store(HookedObjects(store_url, before_read=unreachable)))
    follower = loader.follow(FollowSettings(poll_seconds=0.01, jump=False, prefetch=False))  # step 2: once asked
    assert next(follower).step == 1
    down.set()
    with pytest.raises(StoreError, match="unreachable"):
        next(follower)
    trainer.publisher.close()


# ----------------------------------------------------------------------------- stores that fill out of order


@pytest.fixture(scope="module")
def small_chain() -> tuple[dict[str, bytes], dict[int, dict[str, torch.Tensor]]]:
    """Nine published steps (bases at 1, 4 and 7, each later one with its bridge), as objects."""
    objects = DictObjects()
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(Store(objects), model, PublisherSettings(base_every=3)) as publisher:
        truth = train(publisher, model, 9)
    return objects.objects, truth


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_follower_on_a_store_that_fills_out_of_order_hands_out_only_exact_steps(small_chain, data, caplog):
    """Markers before their blobs, steps before the steps they chain to, the run manifest last: a
    step that is not complete yet is neither handed out, nor skipped, nor warned about at each poll."""
    objects, truth = small_chain
    order = data.draw(st.permutations(sorted(objects)))
    batches = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=6).filter(any))
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="lightning_delta")
    loader = DeltaLoader(Store(Revealing(objects, order, batches)))
    seen = []
    for followed in until(loader.follow(FollowSettings(poll_seconds=0.001, timeout=60)), 9):
        assert_exact(followed, truth)
        assert followed.skipped == ()
        seen.append(followed.step)
    assert seen[-1] == 9 and seen == sorted(set(seen))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all("no complete step yet" in w for w in warnings), warnings


def test_an_object_missing_past_missing_after_is_damage_and_the_follower_resyncs(small_chain, caplog):
    objects, truth = small_chain
    lost = fmt.blob_path(5, 0, 1)  # steps 5 and 6 chain through it; 7's bridge too, not its base
    store = Revealing(objects, sorted(objects), [len(objects)], hidden=frozenset({lost}))
    caplog.set_level(logging.WARNING, logger="lightning_delta")
    settings = FollowSettings(poll_seconds=0.001, jump=False, timeout=60, missing_after=0.05)
    seen = {}
    for followed in until(DeltaLoader(Store(store)).follow(settings), 9):
        assert_exact(followed, truth)
        seen[followed.step] = followed.skipped
    assert seen == {1: (), 2: (), 3: (), 4: (), 7: (5, 6), 8: (), 9: ()}
    rebuilds = [r.getMessage() for r in caplog.records if "does not rebuild, waiting" in r.getMessage()]
    assert len(rebuilds) == 2 and lost in rebuilds[0]  # once per skipped step, not at every poll


class _MissedByWorker1(DeltaLoader):
    """Worker 0 of a replica whose worker 1 (a stand-in) met the missing object: worker 0 has only
    its message (the key of the error it raises, as the group's exchange hands it on), and worker
    1 names the object's step wherever the workers' answers are all read."""

    hole: int | None = None

    def prepare(self, step: int, *, resync_missing: bool = True) -> StepPatch:
        try:
            return super().prepare(step, resync_missing=resync_missing)
        except MissingObjectError as err:
            self.hole = fmt.parse_step_key(err.key)
            raise MissingObjectError(f"worker 1: {err}") from err

    def decide(self, value: int | BaseException) -> list[int]:
        mine = super().decide(value)[0]
        return [mine, mine if self.hole is None else min(mine, self.hole)]


@pytest.mark.parametrize("loader_type", [DeltaLoader, _MissedByWorker1], ids=["alone", "missed_by_worker_1"])
def test_a_hole_in_the_chain_costs_each_poll_the_newer_steps_blobs_once(small_chain, loader_type):
    """Held 1, step 2's blob not there yet, 3 to 9 listed (each chains through 2, the bases 4 and 7
    through their bridges): 9 is tried, then only steps older than 2, so no newer blob is read
    twice a poll (before, 8, 7, ... 3 were tried in turn: 212,194 bytes a poll against 41,503),
    also where another worker of a replica met the missing object."""
    objects, truth = small_chain
    lost = fmt.blob_path(2, 0, 1)
    polls: list[int] = []  # bytes read before each listing of the steps

    class Counting(Revealing):
        def list(self, key: str) -> list[str]:
            if key == "steps":
                polls.append(self.bytes_read)
                if len(polls) == 7:  # three polls made: the blob arrives
                    self.shown.add(lost)
            return super().list(key)

    store = Counting(objects, sorted(objects), [len(objects)], hidden=frozenset({lost}))
    store.shown |= set(objects) - {lost}
    loader = loader_type(Store(store))
    loader.state_dict(1)
    del polls[:]
    steps = range(2, 10)
    markers = sum(len(v) for k, v in objects.items() if k.endswith(".commit") and fmt.parse_step_key(k) in steps)
    walked = [fmt.blob_path(s, 0, 1, bridge=s in (4, 7)) for s in steps if s != 2]
    one_try = markers + sum(len(objects[k]) for k in walked)  # 41,503 bytes
    follower = loader.follow(FollowSettings(poll_seconds=0.001, timeout=60))
    followed = next(follower)
    assert [b - a for a, b in itertools.pairwise(polls[:7])] == [one_try, 0] * 3
    assert followed.step == 9 and followed.skipped == ()
    assert_exact(followed, truth)
    follower.close()


def test_steps_newer_than_a_hole_are_tried_as_soon_as_an_older_one_is_taken(small_chain):
    """Held 1, step 3's blob and steps 4-9 not there yet: 2 is taken past the hole; once the rest
    arrives, the next `next()` takes 9 at its first listing, not after a whole poll (the bound
    "older than the hole" ends with the step handed out)."""
    objects, truth = small_chain
    late = {k for k in objects if (fmt.parse_step_key(k) or 0) >= 4} | {fmt.blob_path(3, 0, 1)}
    listings = [0]

    class Counting(Revealing):
        def list(self, key: str) -> list[str]:
            listings[0] += key == "steps"
            return super().list(key)

    store = Counting(objects, sorted(objects), [0])  # shows only what the test adds
    store.shown |= set(objects) - late
    loader = DeltaLoader(Store(store))
    loader.state_dict(1)
    follower = loader.follow(FollowSettings(poll_seconds=0.001, timeout=60, prefetch=False))
    first = next(follower)
    assert first.step == 2  # 3 is not complete yet: the older 2 is taken
    store.shown |= late
    listings[0] = 0
    second = next(follower)
    assert second.step == 9 and listings[0] == 2  # the steps listed, and those after 9 (none): no pause between
    assert_exact(second, truth)
    follower.close()
