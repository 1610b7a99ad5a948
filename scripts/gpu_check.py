"""The GPU check: run it whenever a GPU is lent (about two minutes on one H200), record its table.

    python scripts/gpu_check.py                                  # the current CUDA device
    python scripts/gpu_check.py --device cpu --scale 0.001       # the CPU smoke run CI does

Prints one table:
  * follow: a model of lone large tensors (each its own payload, published from a view of the live
    weights) and many small ones (one concatenated payload) is trained with an Adam-like update on
    the device, published, and followed into a module on the device; every step bit-exact;
  * syncs: host synchronizations `DeltaPublisher.publish` makes on the training thread (counted
    with `torch.cuda.set_sync_debug_mode`, the worker threads' left out), per publish;
  * memory: the publisher's peak device memory for a base and three deltas of a 2^28-element shard
    (fp32 masters, bf16 shipped), beyond the masters, per shard element;
  * codec: diff + pack of a 2 GB bf16 shard at 2% changed (SPARSE, `Context.NONE`), next to a
    device memcpy of it (the goal is <= 5 ms on an H200), and its decode on the device;
  * engine: the live-engine follower (what the vLLM backend runs) takes steps at 2% and 0.5% into
    a 1 GB bf16 model in device memory, through the device walk's Triton kernels and through torch
    (`ApplyBackend`), against a dense reload of it from pinned host memory in the same run, with
    its peak device memory beyond the model and the host syncs of one update;
  * replica: two processes, each on its own device (GPUs 0 and 1 under NCCL; skipped with fewer
    than two GPUs; the CPU under gloo), publish a chain as two trainer ranks and follow it as the
    two workers of one replica, each into a module on its own device; every step bit-exact, and
    no thread of the second process touches GPU 0 (its process is not on GPU 0's list);
  * `scripts/bench_device.py` is the rest of the device-side numbers (run it after this).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_delta import DeltaLoader, DeltaPublisher, FollowSettings, LoaderSettings, PublisherSettings, Store, codec
from lightning_delta.apply import ApplyBackend
from lightning_delta.engine import EngineFollower
from lightning_delta.viewmap import ViewMap

ROWS: list[tuple[str, str]] = []


def row(what: str, value: str) -> None:
    ROWS.append((what, value))
    print(f"{what}: {value}", flush=True)


def synchronized(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], object], repeats: int = 3) -> float:
    """Best of `repeats`, in seconds, with CUDA events on the current stream (wall clock on the CPU)."""
    best = float("inf")
    for _ in range(repeats):
        synchronized(device)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, begin.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - started)
    return best


def adam_like(masters: dict[str, torch.Tensor], density: float, g: torch.Generator) -> None:
    """Every weight moves by about the same amount, so about `density` of the bf16 casts change."""
    for t in masters.values():
        noise = torch.randn(t.shape, generator=g, device="cpu").to(t.device)
        t.add_(torch.sign(noise) * t.abs().median() * density * 2**-10)


def syncs_on_this_thread(device: torch.device, fn: Callable[[], object]) -> int:
    """Host syncs `fn` makes on the calling thread (CUDA's sync debug mode warns at each)."""
    if device.type != "cuda":
        fn()
        return 0
    me, seen = threading.get_ident(), []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: seen.append(  # type: ignore[assignment]
            (threading.get_ident(), str(message))
        )
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for thread, message in seen if thread == me and "synchroniz" in message)


def follow_check(device: torch.device, scale: float) -> None:
    large, small = max(int((1 << 22) * scale), 4096 + 1), 64
    g = torch.Generator().manual_seed(0)
    masters = {f"big{i}.weight": (torch.randn(large, generator=g) * 0.02).to(device) for i in range(4)}
    masters.update({f"norm{i}.weight": (1 + 0.01 * torch.randn(4096, generator=g)).to(device) for i in range(small)})
    module = torch.nn.Module()
    for name, t in masters.items():
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros_like(t, dtype=torch.bfloat16), requires_grad=False)
        module.add_module(name.split(".")[0], layer)
    truth, syncs = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        settings = PublisherSettings(base_every=3)
        with DeltaPublisher(tmp, masters, settings) as publisher:  # masters on the device: AUTO codes CLASSED there
            for step in range(1, 7):
                adam_like(masters, 0.02, g)
                publisher.flush()  # the worker threads idle: what is counted is publish's own
                syncs.append(syncs_on_this_thread(device, lambda s=step: publisher.publish(s)))
                truth[step] = {k: v.to(torch.bfloat16).cpu() for k, v in masters.items()}
        loader = DeltaLoader(tmp, LoaderSettings(device=str(device)))
        exact = []
        for followed in loader.follow(FollowSettings(poll_seconds=0.01, jump=False)):
            followed.apply_to(module)
            state = {f"{n}.weight": layer.weight.detach().cpu() for n, layer in module.named_children()}
            exact.append(
                all(
                    torch.equal(state[k].view(torch.int16), v.view(torch.int16))
                    for k, v in truth[followed.step].items()
                )
            )
            if followed.step == 6:
                break
    payloads = loader.store.run().manifest.ranks[0]
    lone = sum(len(p) == 1 for p in payloads)
    kind = "CLASSED" if settings.codec.conditions(device) else "SPARSE"
    row(
        f"follow on the device, 6 steps ({kind} deltas), every step bit-exact",
        f"{all(exact) and len(exact) == 6} ({len(payloads)} payloads, {lone} of one tensor)",
    )
    row("host syncs on the training thread per publish (steps 1-6)", " ".join(map(str, syncs)))


def memory_check(device: torch.device, scale: float) -> None:
    numel = max(int((1 << 28) * scale), 1 << 12)
    g = torch.Generator().manual_seed(1)
    masters = {"shard": (torch.randn(numel, generator=g) * 0.02).to(device)}
    if device.type != "cuda":
        row("publisher peak device memory, a base and 3 deltas", "n/a on the CPU")
        return
    for context in (codec.Context.EXPONENT, codec.Context.NONE):
        synchronized(device)
        masters_only, peak = torch.cuda.memory_allocated(device), 0
        settings = PublisherSettings(base_every=100, codec=codec.CodecOptions(context=context))
        with tempfile.TemporaryDirectory() as tmp, DeltaPublisher(tmp, masters, settings) as publisher:
            for step in range(1, 5):
                if step > 1:
                    adam_like(masters, 0.02, g)  # the update's own temporaries are not the publisher's
                synchronized(device)
                torch.cuda.reset_peak_memory_stats(device)
                publisher.publish(step)
                publisher.flush()  # the worker's packing and copies count too
                synchronized(device)
                peak = max(peak, torch.cuda.max_memory_allocated(device) - masters_only)
        kind = "CLASSED" if context == codec.Context.EXPONENT else "SPARSE"
        row(
            f"publisher peak device memory beyond the fp32 masters, a base and 3 {kind} deltas of {numel:,} elements",
            f"{peak / 2**20:.0f} MiB, {peak / numel:.2f} bytes per element",
        )


def codec_check(device: torch.device, scale: float) -> None:
    numel = max(int((1 << 30) * scale), 1 << 12)  # 2 GB of bf16
    g = torch.Generator(device=device).manual_seed(2)
    old = (torch.randn(numel, generator=g, device=device) * 0.02).to(torch.bfloat16)
    new = old.clone()
    moved = torch.rand(numel, generator=g, device=device) < 0.02
    new.view(torch.int16)[moved] += 1
    del moved
    plain = codec.CodecOptions(context=codec.Context.NONE)
    copy = torch.empty_like(new)
    memcpy = timed(device, lambda: copy.copy_(new))
    mask = old.view(torch.int16) != new.view(torch.int16)
    count = int(mask.sum())
    both = timed(device, lambda: codec.pack_delta(codec.diff_counted(old, new, mask, count), new))
    row(f"device memcpy of a {2 * numel / 1e9:.2f} GB bf16 shard", f"{memcpy * 1e3:.2f} ms")
    row(
        "diff + pack of it at 2% (SPARSE), counted as the publisher does",
        f"{both * 1e3:.2f} ms ({both / memcpy:.1f}x the memcpy)",
    )
    payload = codec.serialize(codec.pack_delta(codec.diff(old, new), new).cpu(), plain)
    decode = timed(
        device, lambda: codec.decode_steps(payload, numel=numel, dtype=torch.bfloat16, device=device, exponents=None)
    )
    row(
        "decode of its payload on the device (positions and steps)",
        f"{decode * 1e3:.2f} ms ({len(payload) / 1e6:.1f} MB payload)",
    )


def engine_check(device: torch.device, scale: float) -> None:
    """The live-engine follower (`EngineFollower`, what the vLLM backend runs) on a model of four
    2^27-element bf16 tensors in device memory, through each apply backend that runs there (on a
    GPU the device walk's Triton kernels and torch's decoder; on the CPU the CPU walk and torch),
    against a dense reload of the same model from host memory in the same run."""
    numel = max(int((1 << 27) * scale), 1 << 12)
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16).to(device) for i in range(4)}
    params = {name: torch.zeros_like(t) for name, t in state.items()}
    fractions = {2: 0.02, 3: 0.02, 4: 0.005, 5: 0.005}
    total = 2 * 4 * numel
    timings_of: dict[ApplyBackend, float] = {}
    backends = [ApplyBackend.DEVICE, ApplyBackend.TORCH] if device.type == "cuda" else [ApplyBackend.CPU_WALK]
    with tempfile.TemporaryDirectory() as tmp:
        with DeltaPublisher(tmp, state, PublisherSettings(base_every=100)) as publisher:  # uniform changes: SPARSE
            publisher.publish(1)
            truth = {1: {k: v.clone() for k, v in state.items()}}
            for step, fraction in fractions.items():
                for t in state.values():
                    moved = torch.rand(t.numel(), generator=g).to(device) < fraction
                    t.view(torch.int16)[moved] += 1
                publisher.publish(step)
                truth[step] = {k: v.clone() for k, v in state.items()}
        store = Store(tmp)
        specs = {t.name: (t.shape, torch.bfloat16) for t in store.run().manifest.tensors}
        view_map = ViewMap.learn(specs, lambda name, t: params[name].copy_(t), params)
        for backend in backends:
            follower = EngineFollower(store, view_map, lambda: params, None, device=device, apply=backend)
            if follower.walks_with != backend:  # the log says what failed
                row(f"engine follower ({backend.value})", "its kernels failed their proof: the rows below are torch's")
            follower.write(follower.prepare(1))
            timings: dict[float, list[float]] = {0.02: [], 0.005: []}
            exact, peak, syncs = True, 0, []
            for step, fraction in fractions.items():
                synchronized(device)
                before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                started = time.perf_counter()
                follower.update(step)
                synchronized(device)
                timings[fraction].append(time.perf_counter() - started)
                if device.type == "cuda":
                    peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
                exact &= all(
                    torch.equal(params[k].view(torch.int16), v.view(torch.int16)) for k, v in truth[step].items()
                )
            for _ in range(2):  # step 2 again from step 1, counting the waits of one update
                follower.write(follower.prepare(1))
                syncs.append(syncs_on_this_thread(device, functools.partial(follower.update, 2)))
            follower.close()
            two, half = min(timings[0.02]), min(timings[0.005])
            row(
                f"engine follower ({backend.value}), {total / 1e9:.2f} GB bf16 in device memory: "
                "update_weights at 2% / 0.5% changed",
                f"{two * 1e3:.1f} / {half * 1e3:.1f} ms (0.5%/2%: {half / two:.2f}), every step bit-exact: {exact}",
            )
            row(
                f"engine follower ({backend.value}): peak device memory beyond the model during a delta step; "
                "host syncs per update",
                (f"{peak / 2**20:.0f} MiB ({peak / total:.3f}x the model)" if device.type == "cuda" else "n/a")
                + f"; {min(syncs)}",
            )
            timings_of[backend] = two
    pinned = {k: v.cpu().pin_memory() if device.type == "cuda" else v.cpu() for k, v in state.items()}
    pageable = {k: v.cpu() for k, v in state.items()}
    dense_pinned = timed(device, lambda: [params[k].copy_(v) for k, v in pinned.items()])
    dense = timed(device, lambda: [params[k].copy_(v) for k, v in pageable.items()])
    row(
        "a dense reload of it from pinned / pageable host memory; each backend's 2% step over the pinned one",
        f"{dense_pinned * 1e3:.1f} / {dense * 1e3:.1f} ms; "
        + ", ".join(f"{b.value} {t / dense_pinned:.2f}x" for b, t in timings_of.items()),
    )


def replica_check(device: torch.device, scale: float) -> None:
    what = "replica of 2 workers on devices 0 and 1: every step bit-exact; no process on another's device"
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        row(what, f"skipped: needs 2 GPUs, {torch.cuda.device_count()} here")
        return
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        workers = [spawn.Process(target=replica_worker, args=(r, tmp, device.type, scale)) for r in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)  # a hang (NCCL on the wrong device) is a result, not a stuck check
        if any(w.is_alive() or w.exitcode != 0 for w in workers):
            for worker in workers:
                worker.kill()
            row(what, f"failed: exit codes {[w.exitcode for w in workers]} (None: hung)")
            return
        reports = [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(2)]
    row(what, f"{all(r['exact'] for r in reports)}; {reports[1]['device 0']}")


def replica_worker(rank: int, tmp: str, device_type: str, scale: float) -> None:
    """One of the replica check's processes: a trainer rank, then a worker of the replica, on
    device `rank`, which only the main thread is told (`set_device`), as in a training script."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(0)  # the same masters on both ranks, as under DDP
    numel = max(int((1 << 22) * scale), 4096 + 1)
    masters = {f"w{i}": (torch.randn(numel, generator=g) * 0.02).to(device) for i in range(4)}
    store, truth = os.path.join(tmp, "store"), {}
    with DeltaPublisher(store, masters, PublisherSettings(base_every=3), process_group=dist.group.WORLD) as publisher:
        for step in range(1, 6):
            adam_like(masters, 0.02, g)
            publisher.publish(step)
            truth[step] = {k: v.to(torch.bfloat16).cpu() for k, v in masters.items()}
    dist.barrier()
    module = torch.nn.Module()
    for name, t in masters.items():
        module.register_parameter(name, torch.nn.Parameter(torch.zeros_like(t, dtype=torch.bfloat16), False))
    loader = DeltaLoader(store, LoaderSettings(device=str(device)), process_group=dist.group.WORLD)
    exact = []
    for followed in loader.follow(FollowSettings(poll_seconds=0.01, jump=False, timeout=120)):
        followed.apply_to(module)
        held = {k: v.detach().cpu().view(torch.int16) for k, v in module.named_parameters()}
        exact.append(all(torch.equal(held[k], v.view(torch.int16)) for k, v in truth[followed.step].items()))
        if followed.step == 5:
            break
    dist.barrier()
    untouched = "n/a on the CPU"
    if device.type == "cuda":  # a CUDA context on device 0 in process 1: a thread that ignored its device
        untouched = f"device 0 untouched by process 1: {not torch._C._cuda_hasPrimaryContext(0)}"
    report = {"exact": len(exact) == 5 and all(exact), "device 0": untouched}
    Path(tmp, f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=float, default=1.0, help="shrink every size (the CPU smoke run)")
    p.add_argument(
        "--checks", nargs="*", default=["follow", "memory", "codec", "engine", "replica"], help="which checks"
    )
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"GPU check on {name}, torch {torch.__version__}, scale {args.scale}", flush=True)
    checks = {
        "follow": follow_check,
        "memory": memory_check,
        "codec": codec_check,
        "engine": engine_check,
        "replica": replica_check,
    }
    for name in args.checks:
        checks[name](device, args.scale)
    print("\n| check | result |\n|---|---|")
    for what, value in ROWS:
        print(f"| {what} | {value} |")


if __name__ == "__main__":
    main()
