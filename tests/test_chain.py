"""Publisher and loader in one process, driven by plain torch code (no Lightning)."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch

from conftest import HookedObjects, assert_state, bf16_state, published_run, replace_blob, train
from forge import MESSAGE, forge_value
from lightning_delta import (
    Backlog,
    ChainError,
    ChecksumError,
    DeltaLoader,
    DeltaPublisher,
    DType,
    FormatError,
    FullCheck,
    LoaderSettings,
    ModelMismatchError,
    PublishError,
    SnapshotNotFoundError,
    Store,
    StoreError,
    codec,
)
from lightning_delta import format as fmt
from lightning_delta import patch as patches
from lightning_delta.codec import CodecOptions, Context
from lightning_delta.errors import first_names
from lightning_delta.publisher import PublisherSettings, step_metrics
from lightning_delta.shards import named_tensors
from lightning_delta.sinks import HeldCopies
from tinylm import TinyLM


def test_every_step_rebuilds_bit_exactly_and_bases_follow_the_schedule(store_url):
    truth = published_run(store_url, 10, base_every=4)
    loader = DeltaLoader(store_url)
    assert loader.steps() == list(range(1, 11))
    for step in [3, 10, 1, 7, 8, 9]:  # out of order: the loader restarts from a base when needed
        got, state = loader.state_dict(step)
        assert got == step
        assert_state(state, truth[step])
    assert loader.state_dict()[0] == 10
    store = Store(store_url)
    bases = [s for s in range(1, 11) if store.read_part(s, 0, 1).header.kind == fmt.Kind.BASE]
    assert bases == [1, 5, 9]
    assert "scratch" not in state and "logit_scale" in state


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_publish_through_pinned_side_stream_copies_rebuilds_bit_exactly(store_url):
    """The CUDA path: diff on the device, pinned side-stream copies, the worker waits on events."""
    torch.manual_seed(0)
    model = TinyLM().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    truth = {}
    with DeltaPublisher(store_url, model, PublisherSettings(base_every=4)) as pub:
        for step in range(1, 9):
            tokens = torch.randint(0, 97, (4, 17), device="cuda")
            torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
            pub.publish(step)
            truth[step] = {k: v.cpu() for k, v in bf16_state(model).items()}  # after: publish must not wait
    loader = DeltaLoader(store_url, LoaderSettings(device="cuda"))
    for step in range(1, 9):
        assert_state({k: v.cpu() for k, v in loader.state_dict(step)[1].items()}, truth[step])


def test_deltas_are_small_at_rl_learning_rates(store_url):
    torch.manual_seed(0)
    model = TinyLM(dim=64)
    with DeltaPublisher(store_url, model, PublisherSettings(base_every=100)) as pub:
        train(pub, model, 4, lr=1e-6)
    store = Store(store_url)
    dense = 2 * store.manifest().numel(0)
    delta = store.read_part(4, 0, 1)
    assert delta.header.kind == fmt.Kind.DELTA
    assert 0 < sum(e.changed for e in delta.entries) < 0.1 * dense / 2
    assert sum(e.length for e in delta.entries) < 0.05 * dense  # a few percent of the dense bf16 size


def test_apply_to_copies_into_a_fresh_model(store_url):
    truth = published_run(store_url, 5, base_every=3)
    replica = TinyLM()
    assert DeltaLoader(store_url).apply_to(replica) == 5
    assert_state(bf16_state(replica), truth[5])


def test_corrupt_step_leaves_the_module_and_loader_untouched(store_url):
    truth = published_run(store_url, 4, base_every=10)
    loader, replica = DeltaLoader(store_url), TinyLM()
    loader.apply_to(replica, step=2)
    before = bf16_state(replica)
    store = Store(store_url)
    blob_key = fmt.blob_path(3, 0, 1)
    blob = bytearray(store.objects.get(blob_key))
    blob[-3] ^= 0xFF
    store.objects.put(blob_key, bytes(blob))
    with pytest.raises(ChecksumError):
        loader.apply_to(replica, step=4)
    assert_state(bf16_state(replica), before)
    # the loader's state, the module, is intact: step 2 is still served from it
    assert loader.held_step == 2
    assert_state(loader.state_dict(2)[1], truth[2])


def test_a_bound_module_is_the_held_state_and_takes_only_the_changes(store_url):
    truth = published_run(store_url, 7, base_every=10)
    loader, replica = DeltaLoader(store_url), TinyLM()
    pointers = {name: t.data_ptr() for name, t in named_tensors(replica).items()}  # the module's own tensors
    loader.apply_to(replica, step=1)
    numel = sum(t.numel() for t in truth[1].values())
    assert loader.last_report.changed == numel  # the first write: everything, from the base
    store = Store(store_url)
    changed = {s: sum(e.changed for e in store.read_part(s, 0, 1).entries) for s in range(2, 7)}
    for step in (2, 3, 6):  # 4 and 5 on the way to 6 are composed into one patch
        loader.apply_to(replica, step=step)
        assert_state(bf16_state(replica), truth[step])
        written = loader.last_report.changed  # only the changes are written
        assert written == changed[step] if step < 6 else changed[6] <= written <= sum(changed[s] for s in (4, 5, 6))
    assert {name: t.data_ptr() for name, t in named_tensors(replica).items()} == pointers  # in place, never replaced
    step, tensors = loader.state_dict(7)  # copies of the module plus the patch; the module stays at 6
    assert step == 7 and loader.held_step == 6
    assert_state(tensors, truth[7])
    assert_state(bf16_state(replica), truth[6])
    assert all(t.data_ptr() not in pointers.values() for t in tensors.values())  # copies, not the module's


@pytest.mark.parametrize("cadence", list(FullCheck))
def test_a_weight_changed_behind_the_loaders_back_is_caught_at_the_full_checks_cadence(store_url, cadence, caplog):
    """A bound module's weight changed where the next steps change nothing: the incremental check
    cannot see it (what it proves is the step's changes); the full check finds it at its cadence,
    says so, and the step is rebuilt from its base, which heals the module."""
    truth = published_run(store_url, 6, base_every=4)  # bases at 1 and 5
    name = next(iter(truth[2]))
    steady = torch.stack([truth[s][name].view(torch.int16).flatten() for s in range(2, 6)])
    pos = int((steady == steady[0]).all(dim=0).nonzero()[0])  # unchanged from step 2 to step 5
    loader, live = DeltaLoader(store_url, LoaderSettings(full_check=cadence)), TinyLM()
    loader.apply_to(live, step=2)
    with torch.no_grad():
        weight = named_tensors(live)[name].view(-1)
        weight[pos] = (weight[pos : pos + 1].to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()
    caught_at = {FullCheck.EVERY_STEP: 3, FullCheck.BASE_STEPS: 5, FullCheck.ON_DEMAND: None}[cadence]
    for step in (3, 4, 5):
        if step != caught_at:  # the tampered weight goes unseen, the rest is the trainer's
            loader.apply_to(live, step=step)
            state = bf16_state(live)
            assert state[name].view(-1)[pos] != truth[step][name].view(-1)[pos]
            state[name].view(-1)[pos] = truth[step][name].view(-1)[pos]
            assert_state(state, truth[step])
            continue
        with caplog.at_level(logging.WARNING, logger="lightning_delta.loader"):
            loader.apply_to(live, step=step)  # found, said, and the step rebuilt from its base
        assert "changed behind the loader's back" in caplog.text
        assert_state(bf16_state(live), truth[step])  # every weight written, the tampered one too
        loader.verify()
        return
    with pytest.raises(ChecksumError, match="behind the loader's back"):
        loader.verify()  # on demand


@pytest.mark.parametrize("forged", [3, 4], ids=["delta", "base"])
def test_a_payload_only_its_checksum_can_catch_leaves_the_held_step_intact(store_url, forged):
    """One value changed in a part that decodes cleanly under a re-signed marker (tests/forge.py):
    the loader's copies and a bound module both refuse it by the trainer's checksum.  A loader
    that holds step 2 reads the delta at 3 (and the bridge at 4); one that holds nothing, the
    base at 4."""
    truth = published_run(store_url, 4, base_every=3)  # bases at 1 and 4
    forge_value(Store(store_url), forged)
    held = [1, 2] if forged == 3 else []
    loader = DeltaLoader(store_url)
    for step in held:
        loader.state_dict(step)  # step 1's buffers are now the spare ones
    with pytest.raises(ChecksumError, match=f"step {forged}: payload 0 .*{MESSAGE}"):
        loader.state_dict(forged)
    assert_state(loader.state_dict(2)[1], truth[2])
    bound, replica = DeltaLoader(store_url), TinyLM()
    for step in held:
        bound.apply_to(replica, step=step)
    before = bf16_state(replica)
    with pytest.raises(ChecksumError, match=f"step {forged}: payload 0 .*{MESSAGE}"):
        bound.apply_to(replica, step=forged)
    assert bound.held_step == (held[-1] if held else None)
    assert_state(bf16_state(replica), before)


def test_apply_to_refuses_a_different_model(store_url):
    published_run(store_url, 1)
    with pytest.raises(ModelMismatchError, match="wrong shape"):
        DeltaLoader(store_url).apply_to(TinyLM(dim=16))
    with pytest.raises(ModelMismatchError, match="missing"):
        DeltaLoader(store_url).apply_to(torch.nn.Linear(2, 2))


def test_unknown_steps(store_url):
    with pytest.raises(SnapshotNotFoundError, match="no complete step"):
        DeltaLoader(store_url).state_dict()
    published_run(store_url, 2)
    with pytest.raises(SnapshotNotFoundError, match="step 7"):
        DeltaLoader(store_url).state_dict(7)


def test_steps_must_increase(store_url):
    with DeltaPublisher(store_url, TinyLM()) as pub:
        pub.publish(3)
        with pytest.raises(ValueError, match="increase"):
            pub.publish(3)


def test_settings_reach_the_publisher(store_url):
    settings = PublisherSettings(base_every=3, dtype="float16", backlog="block", max_pending=1)
    assert settings.dtype == DType.float16 and settings.backlog is Backlog.BLOCK
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(store_url, model, settings) as pub:  # BLOCK: every step is published, however busy
        train(pub, model, 4)
    store = Store(store_url)
    kinds = [store.read_part(s, 0, 1).header.kind for s in range(1, 5)]
    assert kinds == [fmt.Kind.BASE, fmt.Kind.DELTA, fmt.Kind.DELTA, fmt.Kind.BASE]
    shipped = {name: t.detach().half() for name, t in named_tensors(model).items()}  # float16, as asked
    assert_state(DeltaLoader(store_url).state_dict(4)[1], shipped)


def test_step_metrics_report_the_diff_at_once_and_the_upload_once_it_finished(store_url):
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(store_url, model) as pub:
        first = step_metrics(pub, pub.publish(1))
        assert first["delta/changed_fraction"] == 1.0  # a base: every element is new
        train(None, model, 1)
        stats = pub.publish(2)
        pub.flush()
        metrics = step_metrics(pub, stats)
    assert 0 < metrics["delta/changed_fraction"] == stats.changed / stats.numel < 1
    assert metrics["delta/last_published_step"] == 2.0 and metrics["delta/queue_depth"] == 0.0
    assert metrics["delta/compression_ratio"] == pytest.approx(2 * stats.numel / metrics["delta/stored_bytes"])
    assert metrics["delta/compression_ratio"] > 2 and metrics["delta/skipped_steps"] == 0.0


def test_coalescing_skips_steps_instead_of_waiting_and_keeps_the_chain_exact(store_url):
    """Uploads stall until the training loop is over: under BLOCK it could never end; under
    COALESCE it ends, having published only what fits in the pipeline."""
    gate = threading.Event()

    def stall(key: str) -> None:
        if key != fmt.RUN_MANIFEST:
            assert gate.wait(120), "the training loop waited for an upload"

    torch.manual_seed(0)
    model = TinyLM()
    settings = PublisherSettings(base_every=5, backlog=Backlog.COALESCE, max_pending=1)
    pub = DeltaPublisher(Store(HookedObjects(store_url, stall)), model, settings)
    truth = train(pub, model, 20)
    # at most one snapshot in upload, one compressed and waiting, one being compressed, one queued
    assert pub.skipped >= 16
    gate.set()
    pub.close()
    loader = DeltaLoader(store_url)
    steps = loader.steps()
    assert len(steps) == 20 - pub.skipped and steps[0] == 1
    for step in steps:
        assert_state(loader.state_dict(step)[1], truth[step])


def test_blocking_backlog_publishes_every_step(store_url, monkeypatch):
    """Uploads stall until the training loop has waited on the full upload queue (watched where
    `publish` puts a snapshot into it; under COALESCE it would skip steps and end first): then
    every step is published, exactly."""
    gate, turn, done = threading.Event(), threading.Event(), threading.Event()

    def stall(key: str) -> None:
        if key != fmt.RUN_MANIFEST:
            assert gate.wait(120), "the uploads were never let through"

    torch.manual_seed(0)
    model = TinyLM()
    settings = PublisherSettings(backlog=Backlog.BLOCK, max_pending=1)
    pub = DeltaPublisher(Store(HookedObjects(store_url, stall)), model, settings)
    jobs, put = pub._uploads.jobs, pub._uploads.jobs.put

    def watched(item, *args, **kwargs):
        if jobs.full():  # the trainer is about to wait for the queue
            turn.set()
        return put(item, *args, **kwargs)

    monkeypatch.setattr(jobs, "put", watched)
    truth = {}

    def training() -> None:
        truth.update(train(pub, model, 8))  # more steps than the stalled pipeline holds
        done.set()
        turn.set()

    thread = threading.Thread(target=training)
    thread.start()
    assert turn.wait(120)
    assert not done.is_set(), "the training loop went on past a full upload queue"
    gate.set()
    thread.join()
    pub.close()
    assert pub.skipped == 0
    loader = DeltaLoader(store_url)
    assert loader.steps() == list(range(1, 9))
    for step in range(1, 9):
        assert_state(loader.state_dict(step)[1], truth[step])


class Failing:
    """Writes fail from the `fail_from`-th on, as a store that went away would."""

    def __init__(self, fail_from: int) -> None:
        self.fail_from, self.writes = fail_from, 0
        self.lock = threading.Lock()

    def __call__(self, key: str) -> None:
        with self.lock:
            self.writes += 1
            if self.writes >= self.fail_from:
                raise StoreError("connection reset by peer")


def test_a_failing_store_surfaces_on_the_trainer_thread(store_url):
    model = TinyLM()
    pub = DeltaPublisher(Store(HookedObjects(store_url, Failing(fail_from=3))), model)
    pub.publish(1)
    pub.publish(2)  # its upload fails in the background
    with pytest.raises(PublishError, match="connection reset"):
        pub.flush()
    pub.close()  # the error was raised once; closing is clean


def test_after_a_failure_the_next_publish_is_a_base(store_url):
    store = Failing(fail_from=10**9)
    model = TinyLM()
    with DeltaPublisher(Store(HookedObjects(store_url, store)), model, PublisherSettings(base_every=100)) as pub:
        pub.publish(1)
        pub.flush()
        store.fail_from = store.writes + 1
        pub.publish(2)
        with pytest.raises(PublishError):
            pub.flush()
        store.fail_from = 10**9
        pub.publish(3)
    parts = Store(store_url)
    assert parts.read_part(3, 0, 1).header.kind == fmt.Kind.BASE
    assert DeltaLoader(store_url).steps() == [1, 3]


def test_a_step_with_a_foreign_object_is_refused(store_url):
    torch.manual_seed(0)
    with DeltaPublisher(store_url, TinyLM()) as pub:
        pub.publish(1)
    store = Store(store_url)
    foreign = b"PK\x03\x04" + bytes(range(60))  # a zip file, say
    replace_blob(store, 1, 0, 1, foreign)
    with pytest.raises(FormatError, match="not a lightning_delta/5 part"):
        DeltaLoader(store_url).state_dict(1)


def test_a_snapshot_that_fails_halfway_makes_the_next_publish_a_base(store_url):
    n = 300_000  # over the payload-sharing threshold: "a" and "b" are diffed one after the other
    tensors = {"a": torch.zeros(n), "b": torch.zeros(n)}
    with DeltaPublisher(store_url, lambda: tensors, PublisherSettings(base_every=100)) as pub:
        pub.publish(1)
        tensors["a"] = torch.ones(n)  # "a" is snapshotted first ...
        tensors["b"] = torch.zeros(n, device="meta")  # ... then "b" fails: "a"'s cache holds an unpublished step
        with pytest.raises((ValueError, RuntimeError), match="device"):
            pub.publish(2)
        tensors["b"] = torch.zeros(n)
        pub.publish(3)
    assert Store(store_url).read_part(3, 0, 1).header.kind == fmt.Kind.BASE
    step, state = DeltaLoader(store_url).state_dict()
    assert step == 3 and torch.equal(state["a"], torch.ones(n, dtype=torch.bfloat16))


def test_the_layout_is_fixed_for_the_run(store_url):
    from lightning_delta import UnsupportedStrategyError

    tensors = {"a": torch.zeros(8)}
    with DeltaPublisher(store_url, lambda: tensors) as pub:
        pub.publish(1)
        tensors["a"] = torch.zeros(9)
        with pytest.raises(UnsupportedStrategyError, match="new run"):
            pub.publish(2)
        del tensors["a"]
        with pytest.raises(UnsupportedStrategyError, match="vanished"):
            pub.publish(3)


def test_the_next_snapshot_is_compressed_while_the_previous_one_uploads(store_url, monkeypatch):
    """Step 1's upload waits until step 2's payloads were compressed: without the pipeline,
    step 2 would be compressed only after step 1 is in the store, and this would never end."""
    compressed, step_two = [], threading.Event()
    serialize = codec.serialize

    def counting(packed, options=None):
        compressed.append(packed.n)
        if len(compressed) > payloads:
            step_two.set()
        return serialize(packed, options)

    def gate(key: str) -> None:
        if f"/{1:012d}/" in key:
            assert step_two.wait(120), "step 2 was not compressed while step 1 uploaded"

    torch.manual_seed(0)
    model = TinyLM()
    pub = DeltaPublisher(Store(HookedObjects(store_url, gate)), model, PublisherSettings(max_pending=2))
    payloads = len(pub.store.run().manifest.ranks[0])
    monkeypatch.setattr(codec, "serialize", counting)
    truth = train(pub, model, 2)
    pub.close()
    assert len(compressed) >= 2 * payloads
    loader = DeltaLoader(store_url)
    assert loader.steps() == [1, 2]
    assert_state(loader.state_dict(2)[1], truth[2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_cuda_loader_without_cuda_fails_at_construction(store_url):
    with pytest.raises(ValueError, match="no CUDA device"):
        DeltaLoader(store_url, LoaderSettings(device="cuda"))


def test_an_in_sync_follower_never_reads_a_base_after_its_first(store_url):
    truth = published_run(store_url, 12, base_every=5)  # bases 1, 6, 11; bridges at 6 and 11
    store = Store(store_url)
    assert [s for s in range(1, 13) if store.part_refs(s, 0, 1)[-1].bridge] == [6, 11]
    base_bytes = min(store.part_refs(s, 0, 1)[0].size for s in (1, 6, 11))
    loader = DeltaLoader(store_url)
    for step in range(1, 13):
        assert_state(loader.state_dict(step)[1], truth[step])
        report = loader.last_report
        assert report.parts_read == 1
        assert (report.bytes_read > base_bytes) == (step == 1), step  # markers, manifest and one small part


def test_a_late_joiner_reads_one_base_and_the_deltas_after_it(store_url):
    truth = published_run(store_url, 9, base_every=5)
    store = Store(store_url)
    expected = sum(store.part_refs(s, 0, 1)[0].size for s in (6, 7, 8, 9))
    loader = DeltaLoader(store_url)
    loader.steps()  # the manifest
    assert_state(loader.state_dict(9)[1], truth[9])
    markers = loader.last_report.bytes_read - expected  # one a part, and the bridge's beside the base
    assert loader.last_report.parts_read == 4 and 0 < markers < 5 * 200


@pytest.mark.parametrize("base_every", [2, 100], ids=["base-due", "base-not-due"])
def test_after_a_failed_upload_the_next_base_has_no_bridge(store_url, base_every):
    """A bridge would link to a part that was never committed: the next base comes alone, whether
    it was due (bases at 1, 3) or is one only because the upload of step 2 failed."""
    store = Failing(fail_from=10**9)
    tensors = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    truth = {}
    objects = Store(HookedObjects(store_url, store))
    with DeltaPublisher(objects, lambda: tensors, PublisherSettings(base_every=base_every)) as pub:
        for step in (1, 2, 3, 4):
            tensors["w"][step * 10] += 1
            truth[step] = tensors["w"].clone()
            store.fail_from = store.writes + 1 if step == 2 else 10**9
            pub.publish(step)
            if step == 2:
                with pytest.raises(PublishError):
                    pub.flush()
            pub.flush()
    refs = {s: Store(store_url).part_refs(s, 0, 1) for s in (1, 3, 4)}
    assert [(r.bridge, r.kind) for r in refs[3]] == [(False, fmt.Kind.BASE)]  # a rebase: step 2 never committed
    assert [(r.bridge, r.kind, r.prev_step) for r in refs[4]] == [(False, fmt.Kind.DELTA, 3)]
    loader = DeltaLoader(store_url)
    assert loader.steps() == [1, 3, 4]
    for step in (1, 3, 4):
        assert torch.equal(loader.state_dict(step)[1]["w"], truth[step])


def test_a_base_is_packed_from_a_copy_the_next_step_does_not_touch(store_url, monkeypatch):
    """The worker packs a base after `publish` returns; the next step writes its changes into the
    publisher's cache meanwhile.  (A base packed from the cache itself came out as a mix of both
    steps: found by the SIGKILL test as a committed base whose checksum did not match.)"""
    from lightning_delta import codec

    gate, original = threading.Event(), codec.pack_full

    def held_back(new):
        assert gate.wait(120)
        return original(new)

    monkeypatch.setattr(codec, "pack_full", held_back)
    tensors = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    with DeltaPublisher(store_url, lambda: tensors, PublisherSettings(base_every=100, max_pending=2)) as pub:
        pub.publish(1)
        first = tensors["w"].clone()
        tensors["w"][::3] += 1
        pub.publish(2)  # diffs against the cache and updates it while step 1 waits to be packed
        gate.set()
    loader = DeltaLoader(store_url)
    assert torch.equal(loader.state_dict(1)[1]["w"], first)
    assert torch.equal(loader.state_dict(2)[1]["w"], tensors["w"])


def test_exponent_context_chain_rebuilds_bit_exactly(store_url):
    """What a GPU publisher writes by default (`Context.AUTO`), forced on the CPU: CLASSED deltas
    and bridges rebuild every step exactly, in order and out of it."""
    torch.manual_seed(0)
    model = TinyLM(dim=64)
    options = CodecOptions(context=Context.EXPONENT)
    with DeltaPublisher(store_url, model, PublisherSettings(base_every=4, codec=options)) as pub:
        truth = train(pub, model, 9, lr=1e-5)
    store = Store(store_url)
    sizes = [numel for numel, _ in store.manifest().payloads[0]]
    parts = [store.read_part(step, 0, 1, bridge=step in (5, 9)) for step in range(2, 10)]
    modes = {codec.parse(data, numel).mode for part in parts for data, numel in zip(part.payloads, sizes, strict=True)}
    assert codec.Mode.CLASSED in modes and all(part.header.kind == fmt.Kind.DELTA for part in parts)
    loader = DeltaLoader(store_url)
    for step in [*range(1, 10), 3, 9, 6]:
        assert_state(loader.state_dict(step)[1], truth[step])


def test_the_first_of_two_upload_failures_is_the_one_raised(store_url):
    gate = threading.Event()

    def fail(key: str) -> None:
        if f"/{1:012d}/" in key:
            assert gate.wait(120)  # step 1's upload fails only once step 2 is queued behind it
            raise StoreError("first failure")
        if f"/{2:012d}/" in key:
            raise StoreError("second failure")

    pub = DeltaPublisher(Store(HookedObjects(store_url, fail)), TinyLM(), PublisherSettings(base_every=1))
    pub.publish(1)
    pub.publish(2)  # a base too: the upload stage tries it after step 1 failed
    gate.set()
    with pytest.raises(PublishError, match="first failure"):
        pub.flush()
    pub.close()


# ------------------------------------------------------------------ patch.py's contract, directly


def _two_tensor_run(store_url: str, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """Two small bf16 tensors, published as one payload of two slices (base at 1, deltas after),
    each step with a probe of its number; the true bits per step."""
    torch.manual_seed(0)
    tensors = {"a": torch.randn(40).bfloat16(), "b": torch.randn(3, 8).bfloat16()}
    truth = {}
    with DeltaPublisher(store_url, tensors, PublisherSettings(base_every=10)) as pub:
        for step in range(1, steps + 1):
            if step > 1:
                for t in tensors.values():
                    t.view(-1)[step % 3 :: 5] += 0.25  # a few elements of each slice, some exponents
            pub.publish(step, probe=torch.full((2,), float(step)))
            truth[step] = {k: v.clone() for k, v in tensors.items()}
    return truth


def test_decoded_patches_carry_the_checksums_a_peer_verifies_them_by(store_url):
    """A replica's workers check each other's patches (`patch.verify_against`) by the checksum each
    patch carries: a base, a composed chain of deltas and the empty patch of the step held all
    verify against the held state, rebuild the truth, and a patch claiming another checksum is
    refused.  The payload holds two tensors, so each patch crosses from one slice to the next."""
    truth = _two_tensor_run(store_url, 3)
    store = Store(store_url)
    run = store.run()
    assert [len(slices) for slices in run.manifest.ranks[0]] == [2]
    cpu = torch.device("cpu")
    parts = [store.read_part(step, 0, 1) for step in (1, 2, 3)]
    sink = HeldCopies(run, cpu)
    base = patches.decode_rank(run, 0, parts[:1], None, None, cpu, "here", True)
    patches.verify_against(run, 0, base, None, None)
    patches.apply(run, 0, base, sink)
    assert_state(sink.tensors(), truth[1])
    nowhere = patches.PayloadView(run, 0, 0).gather(sink, torch.empty(0, dtype=torch.int64))
    assert nowhere.dtype == torch.int16 and nowhere.shape == (0,)  # two slices, no position asked
    from_base = patches.decode_rank(run, 0, parts, None, None, cpu, "here", True)  # whole, then two deltas
    patches.verify_against(run, 0, from_base, None, None)
    one = patches.decode_rank(run, 0, parts[1:2], base.state, sink, cpu, "here", False)
    patches.verify_against(run, 0, one, base.state, sink)
    delta = patches.decode_rank(run, 0, parts[1:], base.state, sink, cpu, "here", False)  # two deltas composed
    assert delta.state.probe == (3.0, 3.0) and delta.state.header.step == 3 and not delta.base_step
    patches.verify_against(run, 0, delta, base.state, sink)
    claimed = dataclasses.replace(delta.payloads[0], checksum=delta.payloads[0].checksum ^ 1)
    with pytest.raises(ChecksumError, match=r"^rank 0 payload 0: the patch another worker decoded does not"):
        patches.verify_against(run, 0, dataclasses.replace(delta, payloads=(claimed,)), base.state, sink)
    patches.apply(run, 0, delta, sink)
    assert_state(sink.tensors(), truth[3])
    held = patches.decode_rank(run, 0, [], delta.state, sink, cpu, "here", True)  # the step held already
    assert held.state == delta.state and held.base_step and held.payloads[0].changed == 0
    patches.verify_against(run, 0, held, delta.state, sink)
    patches.apply(run, 0, held, sink)
    assert_state(sink.tensors(), truth[3])


def test_a_chain_that_misses_the_step_held_or_a_payload_that_disagrees_is_refused_with_where(store_url):
    """`decode_rank`'s refusals, each naming where: a delta that does not follow the step held (or
    with no state held), a payload that does not decode, one that changes another count than its
    header says, and one a forged value makes miss the trainer's checksum (naming its tensors)."""
    _two_tensor_run(store_url, 3)
    store = Store(store_url)
    run = store.run()
    cpu = torch.device("cpu")
    parts = [store.read_part(step, 0, 1) for step in (1, 2, 3)]
    sink = HeldCopies(run, cpu)
    base = patches.decode_rank(run, 0, parts[:1], None, None, cpu, "here", True)
    patches.apply(run, 0, base, sink)
    chain = r"^here: the chain does not reach a base or the step held$"
    with pytest.raises(ChainError, match=chain):
        patches.decode_rank(run, 0, parts[2:], base.state, sink, cpu, "here", False)  # 3 from 1
    with pytest.raises(ChainError, match=chain):
        patches.decode_rank(run, 0, parts[1:], None, sink, cpu, "here", False)
    with pytest.raises(ChainError, match=chain):
        patches.decode_rank(run, 0, parts[1:], base.state, None, cpu, "here", False)
    cut = dataclasses.replace(parts[1], payloads=(parts[1].payloads[0][:8],))
    with pytest.raises(FormatError, match=r"^here step 2: payload 0: "):
        patches.decode_rank(run, 0, [cut], base.state, sink, cpu, "here", False)
    entry = parts[1].entries[0]
    miscounted = dataclasses.replace(parts[1], entries=(dataclasses.replace(entry, changed=entry.changed + 1),))
    with pytest.raises(FormatError, match=rf"^here step 2: payload 0 changes {entry.changed} elements, header says"):
        patches.decode_rank(run, 0, [miscounted], base.state, sink, cpu, "here", False)
    forge_value(store, 2)
    forged = store.read_part(2, 0, 1)
    with pytest.raises(ChecksumError, match=rf"^here step 2: payload 0 \(a, b\) {MESSAGE}$"):
        patches.decode_rank(run, 0, [forged], base.state, sink, cpu, "here", False)


def test_a_composed_chain_through_an_empty_delta_and_moved_exponents_decodes_exactly(store_url):
    """Deltas composed into one patch (`decode_rank` over several parts) read the state held
    through the patch so far: after a step that changes nothing (an empty patch, yet positions are
    asked through it), and a step that moves exponents, a CLASSED delta is decoded against the
    exponents as the earlier deltas left them, not as held (#39: the classes of the held state
    put its changes at other positions, and the trainer's checksum refused a valid step).  The
    tensor is one payload of one slice, whose held exponents are read in one piece."""
    torch.manual_seed(0)
    w = (torch.randn(4096) * 0.05).bfloat16()
    truth = {}

    def smallest() -> torch.Tensor:
        size = w.float().abs()
        return (size <= size.quantile(0.25)).nonzero().view(-1)

    settings = PublisherSettings(base_every=10, codec=CodecOptions(context=Context.EXPONENT))
    with DeltaPublisher(store_url, {"w": w}, settings) as pub:
        for step in (1, 2, 3, 4):
            if step == 3:
                w[smallest()[::4]] *= 4  # two exponents up, among the small ones
            if step == 4:
                w.view(torch.int16)[smallest()[1::3]] += 1  # one ULP among the smallest: CLASSED
            pub.publish(step)
            truth[step] = {"w": w.clone()}
    store = Store(store_url)
    run = store.run()
    assert [len(slices) for slices in run.manifest.ranks[0]] == [1]
    parts = [store.read_part(step, 0, 1) for step in (1, 2, 3, 4)]
    assert parts[1].entries[0].changed == 0 and parts[2].entries[0].changed > 0
    assert codec.parse(parts[3].payloads[0], w.numel()).mode == codec.Mode.CLASSED
    cpu = torch.device("cpu")
    sink = HeldCopies(run, cpu)
    base = patches.decode_rank(run, 0, parts[:1], None, None, cpu, "here", True)
    patches.apply(run, 0, base, sink)
    assert torch.equal(patches.PayloadView(run, 0, 0).exponents(sink), codec.exponent_bytes(truth[1]["w"]))
    composed = patches.decode_rank(run, 0, parts[1:], base.state, sink, cpu, "here", False)
    assert composed.state.header.step == 4
    patches.apply(run, 0, composed, sink)
    assert_state(sink.tensors(), truth[4])


def test_a_forged_value_in_a_payload_of_many_tensors_names_its_first_four(store_url):
    """The checksum's refusal names the tensors of the payload, the first four (a payload of small
    tensors may hold hundreds), and how many it left out."""
    tensors = {name: (torch.arange(8) * 0.5 + i).bfloat16() for i, name in enumerate("abcde")}
    with DeltaPublisher(store_url, tensors, PublisherSettings(base_every=10)) as pub:
        for step in (1, 2):
            if step == 2:
                for t in tensors.values():
                    t[step::3] += 0.25
            pub.publish(step)
    store = Store(store_url)
    run = store.run()
    assert [len(slices) for slices in run.manifest.ranks[0]] == [5]
    cpu = torch.device("cpu")
    base = patches.decode_rank(run, 0, [store.read_part(1, 0, 1)], None, None, cpu, "here", True)
    sink = HeldCopies(run, cpu)
    patches.apply(run, 0, base, sink)
    forge_value(store, 2)
    with pytest.raises(ChecksumError, match=rf"^here step 2: payload 0 \(a, b, c, d and 1 more\) {MESSAGE}$"):
        patches.decode_rank(run, 0, [store.read_part(2, 0, 1)], base.state, sink, cpu, "here", False)
    assert first_names(list("abcd")) == "a, b, c, d"  # none left out: nothing more said
