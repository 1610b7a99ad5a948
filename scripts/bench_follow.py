"""The follower at the cost of the change: the patch path beside the full-state path, in one run.

    python scripts/bench_follow.py                          # 8 x 25M bf16 (400 MB), one CPU thread
    python scripts/bench_follow.py --numel 1000000          # a quick check of the script
    python scripts/bench_follow.py --before /tmp/ld-before/src   # also the code of an earlier checkout

A two-rank trainer publishes a chain of a bf16 model of `--tensors` tensors: a base at step 0,
then steps 1-3 changing 2% of the elements (nearly all by one ULP) and steps 4-6 changing 0.5%.
Each follower runs in a fresh process with one CPU thread and a module of its own, loads the base,
then follows steps 1-6 in sync:

* patch: `DeltaLoader.apply_to(module, step)`; the module is the held state, a step is decoded
  against it and only its changes are written;
* full: `DeltaLoader.state_dict(step)`, then a `copy_` of every tensor into the module (what a
  caller that wants full tensors does);
* before: `apply_to(module, step)` of the code under `--before` (an earlier checkout's `src`).

Reported per path: the base step's time (a replica joining: a fresh process, so its kernels' first
load is in it) and each step's over a warm `copy_` of the whole model, the ratio of the 0.5%
steps to the 2% steps, the follower's peak resident memory beyond the module while following
(Linux's VmHWM, reset after the base), and that the module ends bit-exact.  Then the patch path
with a replica of two workers (gloo), each decoding half the trainer ranks: per-worker decode
time beside one worker's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

STEPS = {1: 0.02, 2: 0.02, 3: 0.02, 4: 0.005, 5: 0.005, 6: 0.005}


def initial(tensors: int, numel: int) -> dict[str, torch.Tensor]:
    """The trainer's bf16 weights at step 0."""
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16) for i in range(tensors)}


def evolve(state: dict[str, torch.Tensor], step: int) -> None:
    """Step `step` in place: a seeded `STEPS[step]` of the elements move, 90% by one ULP."""
    for i, t in enumerate(state.values()):
        g = torch.Generator().manual_seed(1000 * step + i)
        changed = torch.rand(t.numel(), generator=g) < STEPS[step]
        by = torch.where(torch.rand(t.numel(), generator=g) < 0.9, 1, 7).to(torch.int16)
        bits = t.view(torch.int16)
        bits[changed] += by[changed]


def weights(tensors: int, numel: int, step: int) -> dict[str, torch.Tensor]:
    state = initial(tensors, numel)
    for s in range(1, step + 1):
        evolve(state, s)
    return state


def status(field: str) -> int:
    """A /proc/self/status field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS


def publish(url: str, tensors: int, numel: int) -> None:
    """Two trainer ranks (gloo, this machine) publish the chain, each its half of the tensors."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--publish", url, str(rank), tmp, str(tensors), str(numel)], env=env
            )
            for rank in range(2)
        ]
        if any(p.wait() for p in procs):
            raise SystemExit("publishing failed")


def publish_rank(url: str, rank: int, tmp: str, tensors: int, numel: int) -> None:
    import torch.distributed as dist

    from lightning_delta import DeltaPublisher, PublisherSettings

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    state = initial(tensors, numel)
    with DeltaPublisher(url, lambda: state, PublisherSettings(base_every=1000)) as publisher:
        for step in range(0, 7):
            if step:
                evolve(state, step)
            publisher.publish(step)
    dist.destroy_process_group()


def follow(url: str, path: str, tensors: int, numel: int, rank: int = 0, world: int = 1, tmp: str = "") -> dict:
    """One follower process: load the base into a module, then follow steps 1-6 in sync."""
    torch.set_num_threads(1)
    group = None
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
        group = dist.group.WORLD
    from lightning_delta import DeltaLoader

    module = torch.nn.Module()
    for i in range(tensors):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.ones(numel, dtype=torch.bfloat16), requires_grad=False)
        module.add_module(f"layer{i}", layer)
    params = [p for p in module.parameters()]
    spare = [torch.ones_like(p) for p in params]
    for _ in range(2):  # a warm copy of the whole model
        started = time.perf_counter()
        for p, s in zip(params, spare, strict=True):
            p.data.copy_(s)
        copy = time.perf_counter() - started
    del spare
    held = status("VmRSS")  # the module, the interpreter and torch: what is not the follower's
    loader = DeltaLoader(url, process_group=group) if group is not None else DeltaLoader(url)

    def load(step: int) -> None:
        if path != "full":
            loader.apply_to(module, step)
            return
        _, state = loader.state_dict(step)
        with torch.no_grad():
            for name, t in state.items():
                module.get_submodule(name.rsplit(".", 1)[0]).weight.copy_(t)

    started = time.perf_counter()
    load(0)  # a replica joining: a fresh process's first base step, compiling or loading its kernels included
    base = time.perf_counter() - started
    reset_peak()
    seconds, decode = {}, {}
    for step in range(1, 7):
        started = time.perf_counter()
        load(step)
        seconds[step] = time.perf_counter() - started
        report = getattr(loader, "last_report", None)
        decode[step] = (report.share_seconds, report.seconds) if hasattr(report, "share_seconds") else None
    peak = status("VmHWM") - held
    truth = weights(tensors, numel, 6)
    exact = all(
        torch.equal(
            module.get_submodule(f"layer{i}").weight.view(torch.int16), truth[f"layer{i}.weight"].view(torch.int16)
        )
        for i in range(tensors)
    )
    return {"copy": copy, "base": base, "seconds": seconds, "decode": decode, "peak": peak, "exact": exact}


def run_follower(url: str, path: str, tensors: int, numel: int, src: str | None = None, world: int = 1) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if src is not None:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory() as tmp:
        outs = [f"{tmp}/out-{r}.json" for r in range(world)]
        cmd = [sys.executable, __file__, "--follow", url, path, str(tensors), str(numel), tmp]
        procs = [subprocess.Popen([*cmd, str(r), str(world), outs[r]], env=env) for r in range(world)]
        if any(p.wait() for p in procs):
            raise SystemExit(f"the {path} follower failed")
        return [json.load(open(out)) for out in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--before", metavar="SRC", help="the `src` folder of an earlier checkout, followed as 'before'")
    args = p.parse_args()
    model = 2 * args.tensors * args.numel
    with tempfile.TemporaryDirectory() as tmp:
        url = f"{tmp}/chain"
        started = time.perf_counter()
        publish(url, args.tensors, args.numel)
        print(
            f"a {model / 1e6:.0f} MB bf16 model ({args.tensors} x {args.numel:,}), 2 trainer ranks, published in "
            f"{time.perf_counter() - started:.1f} s; steps 1-3 change 2%, 4-6 change 0.5%; one CPU thread\n"
        )
        paths = [("patch", None), ("full", None)] + ([("before", args.before)] if args.before else [])
        print(
            "| path | base step (join) | step 1 | 2 | 3 | 4 | 5 | 6 (x a warm copy) | 0.5% / 2% "
            "| peak beyond the module | exact |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        )
        for path, src in paths:
            (r,) = run_follower(url, "full" if path == "full" else "patch", args.tensors, args.numel, src)
            ratio = [r["seconds"][str(s)] / r["copy"] for s in range(1, 7)]
            small = sum(ratio[3:]) / sum(ratio[:3])
            cells = " | ".join(f"{x:.1f}" for x in [r["base"] / r["copy"], *ratio])
            peak = f"{r['peak'] / model:.2f}x ({r['peak'] / 1e6:.0f} MB)"
            print(f"| {path} | {cells} | {small:.2f} | {peak} | {r['exact']} |")
        print(f"\n(warm copy of the whole model: {r['copy'] * 1e3:.0f} ms)\n")
        (alone,) = run_follower(url, "patch", args.tensors, args.numel)
        pair = run_follower(url, "patch", args.tensors, args.numel, world=2)
        print(
            "| replica | own share, 2% step (s, mean of 1-3) | 0.5% (4-6) | with exchange and checks, 2% | 0.5% "
            "| exact |\n|---|---:|---:|---:|---:|---|"
        )
        for name, r in [("1 worker", alone)] + [(f"2 workers, worker {i}", x) for i, x in enumerate(pair)]:
            share = [r["decode"][str(s)][0] for s in range(1, 7)]
            total = [r["decode"][str(s)][1] for s in range(1, 7)]
            cells = [sum(share[:3]) / 3, sum(share[3:]) / 3, sum(total[:3]) / 3, sum(total[3:]) / 3]
            print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {r['exact']} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--publish":
        url, rank, tmp, tensors, numel = sys.argv[2:7]
        publish_rank(url, int(rank), tmp, int(tensors), int(numel))
    elif len(sys.argv) > 1 and sys.argv[1] == "--follow":
        url, path, tensors, numel, tmp, rank, world, out = sys.argv[2:10]
        result = follow(url, path, int(tensors), int(numel), int(rank), int(world), tmp)
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        main()
