"""One Store conformance suite over a local directory, fsspec's memory store and a real S3
endpoint (moto's server on 127.0.0.1, as s3fs's own tests do), plus the 2-rank run against S3."""

from __future__ import annotations

import time
import uuid

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, DictObjects, bitwise_equal, torchrun
from lightning_delta import (
    ChainError,
    ConflictError,
    DeltaLoader,
    DeltaPublisher,
    FormatError,
    PublishError,
    PublisherSettings,
    Store,
    StoreError,
)
from lightning_delta import format as fmt
from tinylm import TinyLM


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "store"))
    if request.param == "memory":
        fsspec.filesystem("memory").store.clear()
        return Store(f"memory://chain-{uuid.uuid4().hex}")
    url, options = request.getfixturevalue("s3_url")
    return Store(url, options)


RUN = fmt.RunManifest(
    "run",
    2,
    0.0,
    (fmt.TensorSpec("w", "bfloat16", (2,)),),
    (((fmt.SliceSpec(0, 0, 1),),), ((fmt.SliceSpec(0, 1, 1),),)),
)


class TestObjectStoreConformance:
    """The few verbs of the object-store protocol, on every fsspec backend we ship for."""

    def test_get_put_create_list_delete(self, store):
        objects = store.objects
        objects.put("steps/000000000/000000000001/a", b"one")
        assert objects.create("steps/000000000/000000000001/b", b"two")
        assert not objects.create("steps/000000000/000000000001/b", b"other")  # taken: nothing written
        assert objects.get("steps/000000000/000000000001/b") == b"two"
        assert objects.get("steps/000000000/000000000001/a", 1, 2) == b"n"
        assert objects.list("steps/000000000/000000000001") == ["a", "b"]
        assert store.published_steps() == [1]
        objects.delete(["steps/000000000/000000000001/a"])
        assert objects.list("steps/000000000/000000000001") == ["b"]
        assert objects.get("steps/000000000/000000000001/a") is None
        assert objects.list("steps/000000000404") == []
        objects.delete_prefix("steps/000000000/000000000001")
        assert store.published_steps() == []


class TestStoreConformance:
    def test_a_step_is_visible_only_when_every_rank_committed(self, store):
        store.objects.put(fmt.blob_path(3, 1, 2), _blob(_header(1, 2)))  # crashed before its marker
        store.commit_part(_header(0, 2), _blob(_header(0, 2)))
        store.commit_part(_delta(1, 2), _blob(_delta(1, 2)), bridge=True)  # a bridge does not complete a step
        assert store.committed_ranks(3) == {2: {0}} and not store.is_complete(3, 2)
        for rank in (0, 1):
            store.commit_part(_header(rank, 2, step=4), _blob(_header(rank, 2, step=4)))
        assert store.is_complete(4, 2) and not store.is_complete(4, 1)

    def test_a_committed_part_is_never_overwritten(self, store):
        blob = _blob(_header(0, 1))
        store.commit_part(_header(0, 1), blob)
        with pytest.raises(ConflictError, match="another publisher wrote this step"):
            store.commit_part(_header(0, 1), _blob(_header(0, 1), payload=b"x"))
        assert store.objects.get(fmt.blob_path(3, 0, 1)) == blob

    def test_heads_and_markers_are_read_without_the_payload(self, store):
        run = store.claim(RUN)
        header = _header(0, 2, manifest=run.sha256)
        store.commit_part(header, _blob(header, payload=b"x"))
        store.commit_part(_delta(0, 2, manifest=run.sha256), _blob(_delta(0, 2, manifest=run.sha256)), bridge=True)
        refs = store.part_refs(3, 0, 2)
        before = store.bytes_read
        head = store.read_head(refs[0], 0, 2)
        assert head.header == header and head.entries == (fmt.PayloadEntry(1, 1, 7),)
        assert store.bytes_read - before < 1000
        assert [(r.kind, r.prev_step, r.bridge) for r in refs] == [
            (fmt.Kind.BASE, None, False),
            (fmt.Kind.DELTA, 2, True),
        ]
        assert refs[0].size == len(_blob(header, payload=b"x"))
        assert store.read_part(3, 0, 2, bridge=True).header == _delta(0, 2, manifest=run.sha256)

    def test_publish_and_load_end_to_end(self, store):
        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        truth = {}
        with DeltaPublisher(store, model, PublisherSettings(base_every=3)) as pub:
            for step in range(1, 6):
                model(torch.randint(0, 97, (2, 9))).square().mean().backward()
                opt.step()
                opt.zero_grad()
                truth[step] = {
                    k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items() if k != "scratch"
                }
                pub.publish(step)
        loader = DeltaLoader(store)
        assert loader.steps() == [1, 2, 3, 4, 5]
        for step, expected in truth.items():
            state = loader.state_dict(step)[1]
            assert all(bitwise_equal(state[k], v) for k, v in expected.items())


def _header(rank: int, world: int, step: int = 3, manifest: str = "0" * 64) -> fmt.PartHeader:
    return fmt.PartHeader(manifest, step, None, fmt.Kind.BASE, rank, world, 0.0, 0)


def _delta(rank: int, world: int, step: int = 3, manifest: str = "0" * 64) -> fmt.PartHeader:
    return fmt.PartHeader(manifest, step, step - 1, fmt.Kind.DELTA, rank, world, 0.0, 0)


def _blob(header: fmt.PartHeader, payload: bytes = b"") -> bytes:
    return fmt.encode_blob(header, [fmt.PayloadEntry(len(payload), len(payload), 7)], [payload])


def test_a_second_run_on_a_used_prefix_is_refused_before_it_publishes(tmp_path):
    url = str(tmp_path / "store")
    with DeltaPublisher(url, TinyLM()) as first:
        first.publish(1)
    with pytest.raises(PublishError, match=f"belongs to run {first.run_id}.*run_id='{first.run_id}'"):
        DeltaPublisher(url, TinyLM())
    assert DeltaLoader(url).steps() == [1]


def test_a_resumed_publisher_continues_its_run_from_a_base(tmp_path):
    url = str(tmp_path / "store")
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(url, model) as first:
        first.publish(1)
        first.publish(2)
    with torch.no_grad():
        model.head.weight.add_(1.0)
    with DeltaPublisher(url, model, run_id=first.run_id) as resumed:
        with pytest.raises(ValueError, match="2 after 2"):  # a step number is never published twice
            resumed.publish(2)
        resumed.publish(3)
    assert Store(url).read_part(3, 0, 1).header.kind == fmt.Kind.BASE
    step, state = DeltaLoader(url).state_dict()
    assert step == 3 and bitwise_equal(state["head.weight"], model.head.weight.detach().to(torch.bfloat16))


def test_a_resumed_publisher_must_have_the_runs_world_size(tmp_path):
    url = str(tmp_path / "store")
    tensors = (fmt.TensorSpec("w", "bfloat16", (2,)),)
    ranks = (((fmt.SliceSpec(0, 0, 1),),), ((fmt.SliceSpec(0, 1, 1),),))
    Store(url).claim(fmt.RunManifest("two-ranks", 2, 0.0, tensors, ranks))
    with pytest.raises(PublishError, match="has 2 ranks, this publisher 1"):
        DeltaPublisher(url, TinyLM(), run_id="two-ranks")


def test_a_resumed_publisher_must_have_the_runs_layout(tmp_path):
    url = str(tmp_path / "store")
    with DeltaPublisher(url, TinyLM(dim=32)) as first:
        first.publish(1)
    with pytest.raises(PublishError, match="another layout"):
        DeltaPublisher(url, TinyLM(dim=16), run_id=first.run_id)


@pytest.mark.slow
def test_fsdp2_run_publishes_to_s3_bit_exactly(s3_url, tmp_path):
    url, options = s3_url
    truth = tmp_path / "truth"
    endpoint = options["client_kwargs"]["endpoint_url"]
    torchrun(
        ROOT / "tests" / "dist_job.py",
        url,
        str(truth),
        "--strategy",
        "fsdp2",
        "--steps",
        "12",
        "--base-every",
        "5",
        "--endpoint",
        endpoint,
    )
    loader = DeltaLoader(url, storage_options=options)
    assert loader.steps() == list(range(1, 13))
    for step in loader.steps():
        state = loader.state_dict(step)[1]
        expected = load_file(truth / f"step-{step:06d}.safetensors")
        assert all(bitwise_equal(state[k], v) for k, v in expected.items()), step


def test_a_part_copied_to_another_step_is_refused_by_both_readers():
    store = Store(DictObjects())
    run = store.claim(RUN)
    blob = _blob(_header(0, 2, manifest=run.sha256))
    store.commit_part(_header(0, 2, manifest=run.sha256), blob)
    store.commit_part(_header(0, 2, step=4), blob)  # step 3's part, stored as step 4
    for read in (store.read_part, lambda *where: store.read_head(store.part_refs(*where)[0], *where[1:])):
        with pytest.raises(FormatError, match="holds step 3"):
            read(4, 0, 2)


def test_the_one_parser_checks_a_part_against_its_marker_its_run_and_its_layout():
    store = Store(DictObjects())
    run = store.claim(RUN)
    cases = {
        "another run": (_header(0, 2), ChainError),  # the manifest digest of another run
        # a base under a delta's marker
        "^its header and its commit marker disagree on what it is$": (_header(0, 2, manifest=run.sha256), FormatError),
    }
    for step, (match, (header, error)) in enumerate(cases.items(), start=5):
        header = fmt.PartHeader(header.manifest, step, header.prev_step, header.kind, 0, 2, 0.0, 0)
        blob = _blob(header)
        ref = fmt.PartRef(
            step,
            fmt.Kind.DELTA if "disagree" in match else fmt.Kind.BASE,
            step - 1 if "disagree" in match else None,
            len(blob),
        )
        with pytest.raises(error, match=match):
            fmt.parse_part(blob, ref, 0, run)
    header = _header(0, 2, manifest=run.sha256)
    two = fmt.encode_blob(header, [fmt.PayloadEntry(0, 0, 7)] * 2, [b"", b""])
    with pytest.raises(FormatError, match="2 payloads, the run's layout 1"):
        fmt.parse_part(two, fmt.PartRef(3, fmt.Kind.BASE, None, len(two)), 0, run)
    many = fmt.encode_blob(header, [fmt.PayloadEntry(0, 5, 7)], [b""])
    with pytest.raises(FormatError, match="5 of a payload's 1 elements"):
        fmt.parse_part(many, fmt.PartRef(3, fmt.Kind.BASE, None, len(many)), 0, run)


def test_a_transaction_on_fsspecs_shared_instance_does_not_capture_our_writes(tmp_path):
    """Lightning saves checkpoints inside `fs.transaction` on fsspec's cached local instance; our
    upload thread must keep committing meanwhile (it used to fail with FileNotFoundError)."""
    store = Store(str(tmp_path / "store"))
    with fsspec.filesystem("file").transaction:
        store.commit_part(_header(0, 1), _blob(_header(0, 1)))
        assert store.is_complete(3, 1)


def test_a_request_without_an_answer_is_logged_once(tmp_path, caplog, monkeypatch):
    import threading

    from fsspec.implementations.local import LocalFileSystem

    from lightning_delta import objects as objects_module

    answered = threading.Event()

    class Hanging(LocalFileSystem):
        def cat_file(self, *args, **kwargs):
            assert answered.wait(120)
            return super().cat_file(*args, **kwargs)

    monkeypatch.setattr(objects_module, "SLOW_SECONDS", 0.01)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "x").write_bytes(b"data")
    objects = objects_module.FsspecObjects.over(Hanging(skip_instance_cache=True), str(tmp_path / "store"))
    caplog.set_level("WARNING", logger="lightning_delta.objects")
    reader = threading.Thread(target=lambda: [objects.get("x") for _ in range(3)])
    reader.start()
    deadline = time.monotonic() + 120
    while not caplog.records:  # the request hangs until the warning is out
        assert time.monotonic() < deadline
        time.sleep(0.01)
    answered.set()
    reader.join()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "no answer from the local file system" in messages[0] and "reading x" in messages[0]


def test_a_local_store_failure_names_the_file_system(tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    from lightning_delta.objects import FsspecObjects

    class Denied(LocalFileSystem):
        def cat_file(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied")

    store = Store(FsspecObjects.over(Denied(skip_instance_cache=True), str(tmp_path / "store")))
    with pytest.raises(StoreError, match=r"store \(the local file system\): access denied while reading run\.json"):
        store.manifest()


def test_an_unwritable_local_prefix_is_a_store_error_naming_the_path(tmp_path):
    (tmp_path / "file").write_text("a regular file, not a folder")
    url = str(tmp_path / "file" / "store")
    with pytest.raises(
        StoreError,
        match=rf"{url} \(the local file system\): Not a directory \(a part of the path is a regular file\) "
        r"while writing run\.json",
    ):
        DeltaPublisher(url, TinyLM())
