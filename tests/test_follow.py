"""DeltaLoader.follow against a chain that is being written by a publisher in another thread."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import ClassVar

import torch

from conftest import bf16_state, bitwise_equal
from lightning_delta import DeltaLoader, DeltaPublisher, Store
from lightning_delta import format as fmt
from tinylm import TinyLM


class Trainer:
    """Publishes steps of a TinyLM on demand and remembers the true bf16 state of each."""

    def __init__(self, url: str, base_every: int = 5, keep_bases: int | None = None) -> None:
        torch.manual_seed(0)
        self.model, self.truth, self.step = TinyLM(), {}, 0
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.publisher = DeltaPublisher(url, self.model, base_every=base_every, keep_bases=keep_bases)

    def steps(self, count: int, pause: float = 0.0) -> None:
        for _ in range(count):
            self.step += 1
            self.model(torch.randint(0, 97, (2, 9))).square().mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.truth[self.step] = bf16_state(self.model)
            self.publisher.publish(self.step)
            self.publisher.flush()
            time.sleep(pause)


def assert_exact(followed, truth) -> None:
    assert all(bitwise_equal(followed.tensors[n], t) for n, t in truth[followed.step].items()), followed.step


def test_a_follower_keeps_up_with_a_live_chain(store_url):
    trainer = Trainer(store_url)
    writer = threading.Thread(target=trainer.steps, args=(12, 0.05))
    writer.start()
    seen = []
    for followed in DeltaLoader(store_url).follow(poll_seconds=0.01, timeout=5.0):
        assert_exact(followed, trainer.truth)
        seen.append(followed.step)
    writer.join()
    trainer.publisher.close()
    assert seen == sorted(set(seen)) and seen[-1] == 12
    assert len(seen) >= 2  # it followed the chain while it was written, not just its end


def test_a_follower_that_fell_behind_jumps_to_the_newest_step_and_reports_it(store_url):
    trainer = Trainer(store_url)
    trainer.steps(7)
    follower = DeltaLoader(store_url).follow(poll_seconds=0.01, timeout=5.0)
    first = next(follower)
    assert first.step == 7 and first.behind == 0  # the newest, not step 1
    assert_exact(first, trainer.truth)
    trainer.steps(3)  # the caller is "generating" meanwhile; its prefetched step goes stale
    second = next(follower)
    assert second.step in (8, 9, 10)
    assert second.behind == 10 - second.step
    rest = [f.step for f in follower]
    assert (rest[-1] if rest else second.step) == 10
    trainer.publisher.close()


def test_a_lost_delta_is_skipped_and_the_follower_resyncs_at_the_next_base(store_url, caplog):
    trainer = Trainer(store_url, base_every=5)  # bases at 1, 6, 11
    trainer.steps(9)
    shutil.rmtree(Path(store_url, fmt.step_dir(8)))  # steps 9 and 10 cannot rebuild
    follower = DeltaLoader(store_url).follow(poll_seconds=0.01, timeout=5.0)
    caplog.set_level(logging.WARNING, logger="lightning_delta.follow")
    threading.Timer(0.3, trainer.steps, args=(3,)).start()  # 10 (broken), 11 (base), 12
    seen = list(follower)
    trainer.publisher.close()
    assert [f.step for f in seen] in ([11, 12], [12])  # never 9 or 10, whose chain lost step 8
    for f in seen:
        assert_exact(f, trainer.truth)
    assert seen[0].skipped[0] == 9 and set(seen[0].skipped) <= {9, 10}
    assert any("does not rebuild" in r.message for r in caplog.records)


def test_a_corrupt_step_never_reaches_the_live_model(store_url):
    trainer = Trainer(store_url, base_every=100)
    trainer.steps(4)
    blob = Path(store_url, fmt.blob_path(4, 0, 1))
    data = bytearray(blob.read_bytes())
    data[-2] ^= 0x01  # planted before following starts: no race with the follower's reads
    blob.write_bytes(bytes(data))
    live = TinyLM()
    DeltaLoader(store_url).apply_to(live, step=3)
    before = {k: v.detach().clone() for k, v in live.state_dict().items()}
    follower = DeltaLoader(store_url).follow(poll_seconds=0.01, timeout=0.5)
    for followed in follower:  # step 4 is refused and nothing newer rebuilds
        followed.apply_to(live)
        raise AssertionError(f"step {followed.step} was handed out")
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())
    trainer.publisher.close()


def test_a_poll_lists_one_block_however_long_the_run(store_url):
    class CountingStore(Store):
        listed: ClassVar[list[str]] = []

        def list(self, key: str) -> list[str]:
            CountingStore.listed.append(key)
            return super().list(key)

    trainer = Trainer(store_url)
    trainer.step = 994  # steps 995..1004 straddle the first block boundary
    trainer.steps(10)
    loader = DeltaLoader(CountingStore(store_url))
    assert loader.steps() == list(range(995, 1005))  # a full listing: steps/, both blocks, new steps
    CountingStore.listed = []
    assert loader.steps(after=1000) == [1001, 1002, 1003, 1004]
    assert CountingStore.listed == ["steps", fmt.block_dir(1)]  # the blocks, then only the newest one
    trainer.steps(1)
    CountingStore.listed = []
    assert loader.steps(after=1004) == [1005]
    assert CountingStore.listed == ["steps", fmt.block_dir(1), fmt.step_dir(1005)]  # and the one new step
    trainer.publisher.close()


def test_replay_hands_out_every_complete_step_in_order(store_url):
    trainer = Trainer(store_url, base_every=4)
    trainer.steps(9)
    seen = list(DeltaLoader(store_url).follow(poll_seconds=0.01, jump=False, timeout=0.3))
    assert [f.step for f in seen] == list(range(1, 10))
    assert [f.behind for f in seen] == list(range(8, -1, -1))
    for f in seen:
        assert_exact(f, trainer.truth)
    trainer.publisher.close()


def test_catch_up_drops_steps_staler_than_max_staleness(store_url, caplog):
    trainer = Trainer(store_url)
    trainer.steps(3)
    caplog.set_level(logging.WARNING, logger="lightning_delta.follow")
    follower = DeltaLoader(store_url).follow(poll_seconds=0.01, max_staleness=1, catch_up=True, timeout=1.0)
    assert next(follower).step == 3
    # While the caller "generates", step 4 is prefetched, then four more are published: step 4
    # is 4 behind when handed out, so it is dropped for the newest.
    trainer.steps(1)
    time.sleep(0.3)
    trainer.steps(4)
    rest = [f for f in follower]
    assert rest and rest[-1].step == 8 and all(f.behind <= 1 for f in rest)
    assert any("behind the store" in r.message for r in caplog.records)
    trainer.publisher.close()


def test_retention_never_takes_what_a_live_follower_needs(store_url):
    trainer = Trainer(store_url, base_every=3, keep_bases=1)  # only the newest base's segment stays
    writer = threading.Thread(target=trainer.steps, args=(20, 0.03))
    writer.start()
    seen = []
    for followed in DeltaLoader(store_url).follow(poll_seconds=0.01, timeout=3.0):
        assert followed.skipped == ()  # nothing it needed was ever gone
        assert_exact(followed, trainer.truth)
        seen.append(followed.step)
    writer.join()
    trainer.publisher.close()
    assert seen[-1] == 20 and len(seen) > 3
    assert Store(store_url).published_steps()[0] == 19  # older segments were deleted meanwhile
