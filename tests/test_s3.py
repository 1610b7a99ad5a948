"""Faults and concurrency against a real S3 endpoint (moto's server on 127.0.0.1)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid

import fsspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import ROOT, bf16_state, bitwise_equal
from lightning_delta import (
    ChainError,
    ChecksumError,
    DeltaLoader,
    DeltaPublisher,
    FormatError,
    PublisherSettings,
    SnapshotNotFoundError,
    Store,
)
from lightning_delta import format as fmt
from tinylm import TinyLM


def train(publisher: DeltaPublisher, model: TinyLM, steps: range, pause: float = 0.0, on_step=None) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    truth = {}
    for step in steps:
        model(torch.randint(0, 97, (2, 9))).square().mean().backward()
        opt.step()
        opt.zero_grad()
        truth[step] = bf16_state(model)
        publisher.publish(step)
        if on_step:
            on_step(step)
        time.sleep(pause)
    return truth


def test_publishing_rides_out_an_endpoint_restart(aws_env):
    """The endpoint goes away in the middle of a run and comes back once an upload has failed on
    it: botocore's retries (set through storage_options) carry the uploads over, nothing is lost,
    every step is exact."""
    from aiobotocore.session import AioSession
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    restarted, failures = [], []

    def on_retry(caught_exception=None, **_) -> None:  # botocore decides after every attempt
        if caught_exception is not None and server in stopped:
            failures.append(type(caught_exception).__name__)
            if not restarted:  # moto keeps its state in this process: a restart on the port resumes it
                restarted.append(ThreadedMotoServer(ip_address="127.0.0.1", port=port))
                restarted[0].start()

    session, stopped = AioSession(), []
    session.register("needs-retry.s3", on_retry)
    options = {
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
        "config_kwargs": {"retries": {"max_attempts": 10, "mode": "standard"}, "connect_timeout": 1},
        "session": session,
    }
    bucket = f"restart-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir(bucket)
    url = f"s3://{bucket}/run"

    def outage(step: int) -> None:
        if step == 4:
            server.stop()
            stopped.append(server)

    torch.manual_seed(0)
    model = TinyLM()
    try:
        with DeltaPublisher(url, model, PublisherSettings(base_every=5), storage_options=options) as publisher:
            truth = train(publisher, model, range(1, 11), on_step=outage)
        assert failures and failures[0] == "EndpointConnectionError"  # an upload did meet the outage
        loader = DeltaLoader(url, storage_options=options)
        assert loader.steps() == list(range(1, 11))
        for step in loader.steps():
            state = loader.state_dict(step)[1]
            assert all(bitwise_equal(state[k], v) for k, v in truth[step].items()), step
    finally:
        for s in restarted:
            s.stop()


@pytest.mark.parametrize(
    "damage, error",
    [
        ("truncate", FormatError),
        ("flip", ChecksumError),
        ("delete blob", FormatError),
        ("delete marker", ChainError),
    ],
)
def test_an_object_damaged_on_s3_is_refused_and_the_chain_recovers_at_the_next_base(s3_url, damage, error):
    url, options = s3_url
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(url, model, PublisherSettings(base_every=4), storage_options=options) as publisher:
        truth = train(publisher, model, range(1, 9))  # bases at 1 and 5
    fs = fsspec.filesystem("s3", **options)
    blob = f"{url}/{fmt.blob_path(3, 0, 1)}".removeprefix("s3://")
    if damage == "truncate":
        fs.pipe_file(blob, fs.cat_file(blob)[:-10])
    elif damage == "flip":
        data = bytearray(fs.cat_file(blob))
        data[-5] ^= 0x10
        fs.pipe_file(blob, bytes(data))
    elif damage == "delete blob":
        fs.rm(blob)
    else:
        fs.rm(blob + ".commit")
    loader = DeltaLoader(url, storage_options=options)
    with pytest.raises(error):
        loader.state_dict(4)  # a delta on top of the damaged step 3
    with pytest.raises(SnapshotNotFoundError if damage == "delete marker" else error):
        loader.state_dict(3)
    for step in (2, 5, 8):  # before the damage, and from the next base on: intact
        state = loader.state_dict(step)[1]
        assert all(bitwise_equal(state[k], v) for k, v in truth[step].items()), step


@pytest.mark.slow
def test_three_follower_processes_one_late_end_on_the_trainers_last_step(s3_url, tmp_path):
    url, options = s3_url
    endpoint = options["client_kwargs"]["endpoint_url"]

    def follower(name: str) -> subprocess.Popen:
        cmd = [sys.executable, str(ROOT / "tests" / "follow_job.py"), url, endpoint, str(tmp_path / name), "50"]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def has_followed(name: str) -> bool:
        progress = tmp_path / f"{name}.safetensors.progress"
        return progress.exists() and bool(progress.read_text().strip())

    def on_step(step: int) -> None:
        if step == 10:  # the first two hand out a step before the rest is written, however slow they start
            deadline = time.monotonic() + 240
            while not (has_followed("a") and has_followed("b")):
                assert time.monotonic() < deadline, "followers never handed out a step"
                assert all(p.poll() is None for p in procs), "a follower died"
                time.sleep(0.05)
        if step == 30:
            late.append(follower("late.safetensors"))

    torch.manual_seed(0)
    model = TinyLM()
    procs = [follower("a.safetensors"), follower("b.safetensors")]
    late: list[subprocess.Popen] = []
    with DeltaPublisher(url, model, PublisherSettings(base_every=10), storage_options=options) as publisher:
        truth = train(publisher, model, range(1, 51), pause=0.05, on_step=on_step)
    for proc in procs + late:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    for name in ("a", "b", "late"):
        path = tmp_path / f"{name}.safetensors"
        state = load_file(path)
        assert state.keys() == truth[50].keys()
        assert all(bitwise_equal(state[k], v) for k, v in truth[50].items()), name
        with safe_open(path, "pt") as f:
            seen = json.loads(f.metadata()["seen"])
        assert seen[-1] == 50 and seen == sorted(set(seen)), (name, seen)
        if name == "late":
            assert seen[0] >= 30  # it joined late: started from what was newest, not from step 1
        else:
            assert len(seen) > 1  # it followed while the chain was written


def test_credentials_never_reach_logs_reprs_or_errors(s3_endpoint, caplog, tmp_path):
    secret = "SECRET-" + uuid.uuid4().hex
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}, "key": "testing", "secret": secret}
    bucket = f"creds-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir(bucket)
    url = f"s3://{bucket}/run"
    caplog.set_level(logging.DEBUG)
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(url, model, PublisherSettings(base_every=2), storage_options=options) as publisher:
        train(publisher, model, range(1, 4))
    store = Store(url, options)
    loader = DeltaLoader(store)
    loader.state_dict()
    messages = [repr(store), str(loader.store.url)]
    for attempt in (
        lambda: loader.state_dict(99),
        lambda: Store(url.replace("creds-", "nobucket-"), options).objects.put("nothing", b""),
    ):
        try:
            attempt()
        except Exception as err:  # the errors a user would see and paste into an issue
            messages.append(f"{type(err).__name__}: {err}")
    assert len(messages) == 4
    assert not any(secret in m for m in messages + [r.getMessage() for r in caplog.records])


CRASHING_TRAINER = """
import os, sys, torch
sys.path.insert(0, {scripts!r})
from lightning_delta import DeltaPublisher, PublisherSettings
from lightning_delta.objects import FsspecObjects
from tinylm import TinyLM

real_create = FsspecObjects.create
def create(self, key, data):
    if key.endswith(".commit") and "/000000000005/" in key:
        os._exit(3)  # killed between step 5's blob and its commit marker
    return real_create(self, key, data)
FsspecObjects.create = create

torch.manual_seed(0)
model = TinyLM()
with DeltaPublisher({url!r}, model, PublisherSettings(base_every=3), storage_options={options!r}) as publisher:
    for step in range(1, 7):
        with torch.no_grad():
            next(model.parameters()).add_(1e-2)
        publisher.publish(step)
        publisher.flush()
"""


@pytest.mark.slow
def test_a_trainer_killed_mid_upload_leaves_no_visible_step_and_the_next_run_heals_the_chain(s3_url):
    url, options = s3_url
    script = CRASHING_TRAINER.format(scripts=str(ROOT / "scripts"), url=url, options=options)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    store, loader = Store(url, options), DeltaLoader(url, storage_options=options)
    assert store.published_steps() == [1, 2, 3, 4, 5]  # step 5's blob is there ...
    assert loader.steps() == [1, 2, 3, 4]  # ... but without its marker no reader sees it
    held = loader.state_dict(4)[0]
    # The run resumes (a new trajectory: another seed) past everything in the store, from a base.
    torch.manual_seed(1)
    model = TinyLM()
    run_id = store.manifest().run_id
    with DeltaPublisher(
        url, model, PublisherSettings(base_every=3), storage_options=options, run_id=run_id
    ) as publisher:
        truth = train(publisher, model, range(store.published_steps()[-1] + 1, 9))
    assert loader.steps() == [1, 2, 3, 4, 6, 7, 8]
    for step in (6, 7, 8):  # a loader that held step 4 re-syncs at the new run's base
        state = loader.state_dict(step)[1]
        assert all(bitwise_equal(state[k], v) for k, v in truth[step].items()), step
    assert held == 4 and loader.last_report.parts_read == 1  # step 8 came from held step 7


@pytest.mark.slow
def test_a_large_blob_goes_up_as_concurrent_multipart_parts_and_stays_exclusive(s3_url):
    url, options = s3_url
    store = Store(url, options)
    blob = bytes(range(256)) * (440 << 10)  # 110 MiB: s3fs switches to multipart at 100 MiB
    assert store.objects.create("big", blob)
    assert store.objects.get("big") == blob
    etag = fsspec.filesystem("s3", **options).info(f"{url}/big".removeprefix("s3://"))["ETag"]
    assert etag.strip('"').endswith("-3")  # three 50 MiB parts: a multipart upload
    assert not store.objects.create("big", blob)  # If-None-Match holds on the multipart completion too


FAST_FAIL = {"config_kwargs": {"retries": {"max_attempts": 1}}}


def test_an_unreachable_endpoint_is_one_line_naming_url_and_endpoint(aws_env, capsys):
    from lightning_delta import StoreError
    from lightning_delta.cli import main

    secret = "SECRET-" + uuid.uuid4().hex
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}, "key": "k", "secret": secret, **FAST_FAIL}
    with pytest.raises(StoreError, match=r"s3://bucket/run \(endpoint http://127\.0\.0\.1:1\): the endpoint is unr"):
        DeltaPublisher("s3://bucket/run", TinyLM(), storage_options=options)
    code = main(["inspect", "s3://bucket/run", "--storage-options", json.dumps(options)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "unreachable" in err and secret not in err


def test_a_missing_bucket_is_named(s3_endpoint):
    from lightning_delta import StoreError

    options = {"client_kwargs": {"endpoint_url": s3_endpoint}, **FAST_FAIL}
    with pytest.raises(StoreError, match="the bucket does not exist"):
        DeltaPublisher(f"s3://missing-{uuid.uuid4().hex[:8]}/run", TinyLM(), storage_options=options)


def test_missing_credentials_are_named(s3_endpoint):
    code = (
        "from lightning_delta import Store, StoreError\n"
        f"store = Store('s3://bucket/run', {{'client_kwargs': {{'endpoint_url': {s3_endpoint!r}}}}})\n"
        "try:\n    store.manifest()\nexcept StoreError as err:\n    print(err)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # no credentials anywhere, and never ask the instance-metadata address (not loopback) for some
    env.update(
        AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "no usable credentials" in proc.stdout and s3_endpoint in proc.stdout, proc.stderr[-2000:]


def test_a_mirror_copies_a_chain_from_one_bucket_to_another_and_on_to_a_local_zone(s3_url, tmp_path, capsys):
    from lightning_delta import Mirror
    from lightning_delta.cli import main

    url, options = s3_url
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(url, model, PublisherSettings(base_every=3), storage_options=options) as publisher:
        truth = train(publisher, model, range(1, 8))
    region = f"s3://region-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **options).mkdir(region.removeprefix("s3://"))
    region += "/run"
    given = json.dumps(options)
    argv = ["mirror", url, region, "--storage-options", given, "--dst-storage-options", given, "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["mirror_step"] == 7
    assert main(argv) == 0  # a second pass finds everything there and writes nothing
    assert json.loads(capsys.readouterr().out)["objects_copied"] == 0
    zone = str(tmp_path / "zone")
    with Mirror(region, zone, source_options=options) as mirror:
        assert mirror.sync().mirror_step == 7
    for where, opts in ((region, options), (zone, None)):
        loader = DeltaLoader(where, storage_options=opts)
        assert loader.steps() == list(range(1, 8))
        for step in (1, 4, 7):
            state = DeltaLoader(where, storage_options=opts).state_dict(step)[1]
            assert all(bitwise_equal(state[k], v) for k, v in truth[step].items()), (where, step)
