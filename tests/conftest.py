from __future__ import annotations

import contextlib
import enum
import hashlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest
import torch
from torch import Tensor

from lightning_delta import DeltaPublisher, PublisherSettings
from lightning_delta.shards import named_tensors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the example model (scripts/tinylm.py) is shared with the tests

from tinylm import TinyLM  # noqa: E402

# Triton's interpreter runs the device walk's kernels on the CPU (tests/test_kernels.py). It must be
# chosen before `triton.language` is first imported, whoever imports it (transformers and peft do,
# through torch, when the test modules are collected), since Triton decorates its own helpers then.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-vLLM tests first.  CI runs the suite on two workers (`pytest -n 2 --dist loadfile`:
    a file's tests share a worker, and its module fixtures, such as the chains the vLLM scenarios
    copy); test_vllm.py is half of the suite's time, so one worker starts it at once while the other
    takes every other file, where collected last it would run alone at the end (xdist's own order,
    the files with the most tests first, is turned off in pyproject: `--no-loadscope-reorder`)."""
    items.sort(key=lambda item: item.path.name != "test_vllm.py")  # stable: otherwise in collection order


def needs(*packages: str) -> None:
    """At the top of a test module that needs packages of the `test` extra: skip the module where
    one is missing (a partial local install), but fail it where `CI` is set, since CI installs the
    extra and a broken install must never pass as skipped tests (`pytest.importorskip` would)."""
    absent = [p for p in packages if importlib.util.find_spec(p) is None]
    if not absent:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{', '.join(absent)} missing under CI, which installs the test extra: the install is broken")
    pytest.skip(f"needs {', '.join(absent)}: pip install -e '.[test]'", allow_module_level=True)


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Same shape and the same bit patterns: `allclose` would let a lossy codec pass."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def bf16_state(module: torch.nn.Module) -> dict[str, Tensor]:
    """A bf16 copy of every tensor the publisher ships: what a loader must rebuild exactly."""
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in named_tensors(module).items()}


def train(publisher: DeltaPublisher | None, model: TinyLM, steps: int, lr: float = 1e-4, seed: int = 0):
    """AdamW steps on random tokens; returns the true bf16 state after each step."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    truth = {}
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 97, (4, 17), generator=g)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        truth[step] = bf16_state(model)
        if publisher is not None:
            publisher.publish(step)
    return truth


def published_run(store_url: str, steps: int, base_every: int = 25) -> dict[int, dict[str, torch.Tensor]]:
    """A seeded TinyLM trained for `steps` steps, each one published; its true bf16 state per step."""
    torch.manual_seed(0)
    model = TinyLM()
    with DeltaPublisher(store_url, model, PublisherSettings(base_every=base_every)) as pub:
        return train(pub, model, steps)


def assert_state(state: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    assert state.keys() == truth.keys()
    for name in truth:
        assert bitwise_equal(state[name], truth[name]), name


class Verdict(enum.Enum):
    """What became of a damaged payload: each is a guarantee kept; a wrong tensor with the
    trainer's checksum is none of them."""

    REFUSED = "a FormatError"
    SAME = "the very same bits (a bit the format ignores)"
    CAUGHT = "other bits, which the trainer's value checksum tells apart"


def verdict(decode: Callable[[], Tensor], truth: Tensor) -> Verdict:
    """Decode a damaged payload: refused, the same tensor, or one the value checksum catches;
    fails the test on anything else (another exception, another shape or dtype, or a wrong tensor
    whose checksum is the trainer's)."""
    from lightning_delta import FormatError
    from lightning_delta.checksum import checksum

    try:
        out = decode()
    except FormatError:
        return Verdict.REFUSED
    assert out.shape == truth.shape and out.dtype == truth.dtype
    if bitwise_equal(out, truth):
        return Verdict.SAME
    bits = out.reshape(-1).view(torch.int16)
    assert checksum(bits) != checksum(truth.reshape(-1).view(torch.int16)), "wrong values, the trainer's checksum"
    return Verdict.CAUGHT


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` under torchrun on CPU/gloo; fail the test with the ranks' output on error."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        # c10d rendezvous on a port the store itself picks: no window in which another process
        # can take a port chosen in advance
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return run_all(cmd, env, timeout, "torchrun")


def run_all(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run `cmd` in a process group of its own, so that a run that hangs is killed with every
    process it started (ranks, engine workers), not only its first; fail the test on error."""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stray = _descendants(proc.pid)  # torchrun starts its ranks in sessions of their own
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in stray:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"{what} hung for {timeout} s:\n{stdout[-4000:]}\n{stderr[-8000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({proc.returncode}):\n{stdout[-4000:]}\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _descendants(root: int) -> list[int]:
    """Every process below `root`, from /proc (Linux): those that left its process group too."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture(scope="session")
def aws_env() -> None:
    """Test credentials for moto, in the environment (subprocesses inherit them)."""
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")


@pytest.fixture(scope="session")
def s3_endpoint(aws_env):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_url(s3_endpoint) -> tuple[str, dict]:
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    bucket = f"chain-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    return f"s3://{bucket}/run", options


def replace_blob(store, step: int, rank: int, world: int, blob: bytes, *, bridge: bool = False) -> None:
    """Overwrite a committed part with `blob` and re-sign its marker (same kind and predecessor),
    as a store that lies consistently would: only what is inside the blob can catch it."""
    from lightning_delta import format as fmt
    from lightning_delta import records

    marker = store.read_marker(step, rank, world, bridge=bridge)
    store.objects.put(fmt.blob_path(step, rank, world, bridge=bridge), blob)
    signed = fmt.CommitMarker(len(blob), hashlib.sha256(blob).hexdigest(), marker.kind, marker.prev_step)
    store.objects.put(fmt.commit_path(step, rank, world, bridge=bridge), records.dumps(signed))


class DictObjects:
    """An `ObjectStore` in a dict: the chain layer's tests fake the protocol, not fsspec."""

    def __init__(self, url: str = "dict://chain") -> None:
        self.url, self.bytes_read, self.objects = url, 0, {}

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        data = self.objects.get(key)
        if data is None:
            return None
        data = data[start:end]
        self.bytes_read += len(data)
        return data

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = bytes(data)

    def create(self, key: str, data: bytes) -> bool:
        if key in self.objects:
            return False
        self.put(key, data)
        return True

    def list(self, key: str) -> list[str]:
        prefix = f"{key}/"
        return sorted({k[len(prefix) :].split("/")[0] for k in self.objects if k.startswith(prefix)})

    def delete(self, keys) -> None:
        for key in list(keys):
            self.delete_prefix(key)

    def delete_prefix(self, key: str) -> None:
        for k in [k for k in self.objects if k == key or k.startswith(f"{key}/")]:
            del self.objects[k]


class Revealing:
    """A published chain's objects, shown to a follower in a given order: one more batch at each
    poll (each listing of `steps`), the way a replicated bucket fills, in no particular order."""

    def __init__(
        self, objects: dict[str, bytes], order: list[str], batches: list[int], hidden: frozenset = frozenset()
    ):
        self.url, self.bytes_read = "dict://replica", 0
        self.all, self.order, self.batches, self.hidden = objects, order, batches, hidden
        self.shown: set[str] = set()
        self.polls = 0

    def _reveal(self) -> None:
        count = self.batches[self.polls % len(self.batches)]
        self.polls += 1
        for key in [k for k in self.order if k not in self.shown and k not in self.hidden][:count]:
            self.shown.add(key)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        if key not in self.shown:
            return None
        data = self.all[key][start:end]
        self.bytes_read += len(data)
        return data

    def list(self, key: str) -> list[str]:
        if key == "steps":
            self._reveal()
        prefix = f"{key}/"
        return sorted({k[len(prefix) :].split("/")[0] for k in self.shown if k.startswith(prefix)})

    def put(self, key: str, data: bytes) -> None:
        raise AssertionError("a follower never writes")

    create = delete = delete_prefix = put  # type: ignore[assignment]


class HookedObjects:
    """The local (or any fsspec) object store, calling the test's hooks before each write, read and
    listing (with the key): how tests slow, stall, fail or watch a store without touching the
    library's internals."""

    def __init__(self, url: str, before_write=None, *, before_read=None, on_list=None) -> None:
        from lightning_delta.objects import FsspecObjects

        self.inner = FsspecObjects(url)
        self.url = self.inner.url
        nothing = lambda key: None  # noqa: E731
        self.before_write, self.before_read, self.on_list = (
            before_write or nothing,
            before_read or nothing,
            on_list or nothing,
        )

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        self.before_read(key)
        return self.inner.get(key, start, end)

    def put(self, key: str, data: bytes) -> None:
        self.before_write(key)
        self.inner.put(key, data)

    def create(self, key: str, data: bytes) -> bool:
        self.before_write(key)
        return self.inner.create(key, data)

    def list(self, key: str) -> list[str]:
        self.on_list(key)
        return self.inner.list(key)

    def delete(self, keys) -> None:
        self.inner.delete(keys)

    def delete_prefix(self, key: str) -> None:
        self.inner.delete_prefix(key)


class Said(logging.Handler):
    """A log handler that sets an event once a message containing `text` is logged: a test waits
    on what a background thread said, not on a clock."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text, self.event, self.messages = text, threading.Event(), []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.text in message:
            self.messages.append(message)
            self.event.set()
