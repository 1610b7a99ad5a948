"""The device-side numbers in one prepared script, for a machine with a GPU (CPU works too).

    python scripts/bench_device.py --device cuda                 # 1 GiB shard, 2% changed
    python scripts/bench_device.py --device cpu --numel 16777216 # a quick check of the script
    python scripts/bench_device.py --device cpu --numel 33554432 --accelerator-path

Prints, each the best of `--repeats` with the device synchronized around it:
  * codec: diff, pack, device-to-host copy and serialize of a delta of a bf16 shard, and its
    decode, each as GB/s of the dense shard, next to a device memcpy of the same bytes; then the
    same for a CLASSED delta (format 5, `Context.EXPONENT`) of an Adam-like update, whose small
    weights change more often than large ones;
  * publisher: for a shard of that size whose fp32 masters moved like an RL step, the time
    `DeltaPublisher.publish` holds the calling thread, the time it adds to the training stream
    (CUDA events on that stream, not a device-wide synchronize) and the host syncs it makes
    (`torch.cuda.set_sync_debug_mode`), against a bare cast + diff;
  * loader: a follower's step of that shard from a local store (read, decode, verify every
    checksum, assemble the full tensor), and the first load from the base.

`--accelerator-path` (on the CPU) leaves out the codec rows and publishes masters that say they are
not on the CPU, so the publisher diffs them as it does on a GPU (a mask, one transfer of every
group's count, `nonzero_static`): that path's work in CPU time, never a stand-in for a GPU figure.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

from lightning_delta import DeltaLoader, DeltaPublisher, LoaderSettings, PublisherSettings, codec
from lightning_delta.checksum import checksum


def timed(device: torch.device, repeats: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def publish_cost(device: torch.device, publish: Callable[[], object]) -> tuple[float, float, int]:
    """Seconds `publish` holds the host, seconds it adds to the current (training) stream, timed
    with events on that stream rather than a device-wide synchronize, and host syncs it made."""
    if device.type != "cuda":
        started = time.perf_counter()
        publish()
        held = time.perf_counter() - started
        return held, held, 0
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        begin.record()
        started = time.perf_counter()
        publish()
        held = time.perf_counter() - started
        end.record()
        torch.cuda.set_sync_debug_mode("default")
    end.synchronize()
    synced = sum("synchroniz" in str(w.message) for w in caught)
    return held, begin.elapsed_time(end) / 1e3, synced


def rl_step(master: torch.Tensor, density: float) -> torch.Tensor:
    """An update that changes about `density` of the bf16 casts, nearly all by one ULP: a bf16 ULP
    is 2^-8..2^-7 of the value, so a relative move of ~density * 2^-7 crosses one that often."""
    return torch.randn_like(master) * master.abs() * density * 2**-7


def adam_step(master: torch.Tensor, density: float) -> torch.Tensor:
    """An update of the same size for every weight, as Adam's normalised steps are: a weight
    changes in bf16 about as often as the step crosses its ULP, so small weights change most."""
    return torch.sign(torch.randn_like(master)) * master.abs().median() * density * 2**-10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=1 << 29, help="shard elements (default: 1 GiB of bf16)")
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accelerator-path", action="store_true", help="no codec rows; publish as a GPU diffs")
    args = parser.parse_args()
    device, n = torch.device(args.device), args.numel
    gb = 2 * n / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: a {gb:.2f} GB bf16 shard, {args.density:.1%} of elements changed, torch {torch.__version__}")

    torch.manual_seed(0)
    master = torch.randn(n, device=device) * 0.02
    old = master.to(torch.bfloat16)
    master += rl_step(master, args.density)
    if not args.accelerator_path:
        codec_rows(device, master, old, args)

    weights = {"shard": torch.nn.Parameter(master)}
    source = (
        (lambda: {"shard": weights["shard"].detach().as_subclass(SaysAccelerator)})
        if args.accelerator_path
        else weights
    )
    bare = timed(device, args.repeats, lambda: codec.diff(old, weights["shard"].detach().to(torch.bfloat16)))
    with tempfile.TemporaryDirectory() as tmp:
        with DeltaPublisher(tmp, source, PublisherSettings(base_every=1000)) as publisher:
            publisher.publish(1)  # the base
            publisher.flush()
            host, stream, syncs = [], [], []
            for step in range(2, 2 + args.repeats):
                with torch.no_grad():
                    weights["shard"] += rl_step(weights["shard"], args.density)
                held, on_stream, synced = publish_cost(device, lambda s=step: publisher.publish(s))
                host.append(held)
                stream.append(on_stream)
                syncs.append(synced)
                publisher.flush()
        print(
            f"\npublish (default options): holds the calling thread {min(host) * 1e3:.1f} ms, adds "
            f"{min(stream) * 1e3:.1f} ms to the training stream, {max(syncs)} host syncs; "
            f"bare cast + diff {bare * 1e3:.1f} ms ({min(stream) / bare:.2f}x)"
        )
        loader = DeltaLoader(tmp, LoaderSettings(device=str(device)))
        loaded = [timed(device, 1, lambda: loader.state_dict(1))]
        loaded += [timed(device, 1, lambda s=step: loader.state_dict(s)) for step in range(2, 2 + args.repeats)]
        print(
            f"a follower's step (read, decode, verify, assemble) {min(loaded[1:]) * 1e3:.1f} ms "
            f"({gb / min(loaded[1:]):.1f} GB/s of the shard); the first load, from the base, {loaded[0] * 1e3:.1f} ms"
        )


class SaysAccelerator(torch.Tensor):
    """A CPU tensor that says it is not on the CPU: the publisher takes its accelerator path."""

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False


def codec_rows(device: torch.device, master: torch.Tensor, old: torch.Tensor, args: argparse.Namespace) -> None:
    """The codec's stages on the shard, SPARSE (an RL step) and CLASSED (an Adam-like one)."""
    n, gb = args.numel, 2 * args.numel / 1e9
    new = master.to(torch.bfloat16)
    plain = codec.CodecOptions(context=codec.Context.NONE)  # SPARSE rows: AUTO would code CLASSED on a GPU
    change = codec.diff(old, new)
    print(f"changed: {change.index.numel() / n:.2%}")

    copy = torch.empty_like(new)
    rows = {
        "memcpy (device)": timed(device, args.repeats, lambda: copy.copy_(new)),
        "diff": timed(device, args.repeats, lambda: codec.diff(old, new)),
        "pack": timed(device, args.repeats, lambda: codec.pack_delta(change, new)),
    }
    packed = codec.pack_delta(change, new)
    rows["device-to-host copy of the packed change"] = timed(device, args.repeats, packed.cpu)
    host = packed.cpu()
    rows["serialize (host, zstd-1)"] = timed(device, args.repeats, lambda: codec.serialize(host, plain))
    payload = codec.serialize(host, plain)
    rows["encode, all of the above"] = timed(device, args.repeats, lambda: codec.encode(old, new, plain))
    rows["decode (to the device)"] = timed(device, args.repeats, lambda: codec.decode(old, payload))
    rows["checksum, full rehash"] = timed(device, args.repeats, lambda: checksum(new.view(torch.int16)))
    assert torch.equal(codec.decode(old, payload).view(torch.int16), new.view(torch.int16))
    print(f"payload {len(payload):,} bytes ({len(payload) / (2 * n):.2%} of dense)\n")
    adam = (master + adam_step(master, args.density)).to(torch.bfloat16)
    classed = codec.CodecOptions(context=codec.Context.EXPONENT)
    kept = codec.diff(old, adam, exponents=True)
    rows["CLASSED: diff keeping the old exponents"] = timed(
        device, args.repeats, lambda: codec.diff(old, adam, exponents=True)
    )
    rows["CLASSED: pack"] = timed(device, args.repeats, lambda: codec.pack_delta(kept, adam))
    rows["CLASSED: encode, all stages"] = timed(device, args.repeats, lambda: codec.encode(old, adam, classed))
    classed_payload, plain_payload = codec.encode(old, adam, classed), codec.encode(old, adam, plain)
    rows["CLASSED: decode (to the device)"] = timed(device, args.repeats, lambda: codec.decode(old, classed_payload))
    assert torch.equal(codec.decode(old, classed_payload).view(torch.int16), adam.view(torch.int16))
    print(
        f"Adam-like update: {kept.index.numel() / n:.2%} changed, CLASSED payload {len(classed_payload):,} bytes, "
        f"SPARSE {len(plain_payload):,} ({len(classed_payload) / len(plain_payload):.2f}x)\n"
    )
    print("| stage | ms | GB/s of the dense shard |\n|---|---:|---:|")
    for stage, seconds in rows.items():
        print(f"| {stage} | {seconds * 1e3:.1f} | {gb / seconds:.1f} |")


if __name__ == "__main__":
    main()
