"""What each reader of a chain moves, counted by the file system, next to the seed's formula.

    python scripts/make_sequence.py runs/seq51 --steps 51
    python scripts/bench_traffic.py runs/seq51 --base-every 25 --steps 51   # a 50-step window

Publishes every step of a `make_sequence.py` sequence with `DeltaPublisher`, then follows it with
real `DeltaLoader`s through a file system that counts every byte it hands out (not the library's
own count), and checks every step bit for bit against the sequence:

* in sync: a follower that holds the first step and loads every later one;
* late joiner: a fresh loader at the window's middle step, then in sync to the end;
* full every step: the dense bf16 model once per step;
* the tensor codec's bytes for the same steps (the payloads of the deltas and bridges an in-sync
  follower needs), and the seed's formula `[f + (W - f) * delta] / W` with the measured delta.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load_file

from lightning_delta import DeltaLoader, DeltaPublisher, PublisherSettings, Store
from lightning_delta import format as fmt


class CountingFileSystem(LocalFileSystem):
    """A local file system that counts the bytes every read returns."""

    protocol = "counted"
    read_bytes = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.removeprefix("counted://"))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs) -> bytes:
        data = super().cat_file(path, start=start, end=end, **kwargs)
        CountingFileSystem.read_bytes += len(data)
        return data


fsspec.register_implementation("counted", CountingFileSystem, clobber=True)


def follow(url: str, steps: list[int], truth: dict[int, dict[str, torch.Tensor]]) -> list[int]:
    """Bytes read for each of `steps`, loaded in order by one loader, each checked exactly."""
    loader = DeltaLoader(url)
    moved = []
    for step in steps:
        before = CountingFileSystem.read_bytes
        got, state = loader.state_dict(step)
        moved.append(CountingFileSystem.read_bytes - before)
        expected = truth[step]
        assert got == step and state.keys() == expected.keys(), step
        for name, tensor in expected.items():
            assert torch.equal(state[name].view(torch.int16), tensor.view(torch.int16)), (step, name)
        report = loader.last_report
        assert report is not None and report.bytes_read == moved[-1], "the loader's count is not the file system's"
    return moved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sequence", type=Path, help="a folder of step-XXXXXX.safetensors (make_sequence.py)")
    p.add_argument("--base-every", type=int, default=25)
    p.add_argument("--steps", type=int, help="publish only the first STEPS files (the window is one fewer)")
    args = p.parse_args()
    files = sorted(args.sequence.glob("step-*.safetensors"))[: args.steps]
    truth = {i + 1: load_file(f) for i, f in enumerate(files)}  # step 1 is the sequence's first file
    steps = sorted(truth)
    weights = {name: t.clone() for name, t in truth[1].items()}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"counted://{tmp}/store"
        with DeltaPublisher(url, lambda: weights, PublisherSettings(base_every=args.base_every)) as publisher:
            for step in steps:
                for name, tensor in truth[step].items():
                    weights[name].copy_(tensor)
                publisher.publish(step)
                publisher.flush()
        store = Store(url)
        window = steps[1:]  # an in-sync follower holds the first step
        dense = 2 * sum(t.numel() for t in truth[1].values())
        in_sync = follow(url, steps, truth)[1:]
        join = window[len(window) // 2]
        late = follow(url, [s for s in window if s >= join], truth)
        refs = {s: store.part_refs(s, 0, 1) for s in steps}
        needed = [next(r for r in refs[s] if r.kind == fmt.Kind.DELTA) for s in window]
        codec_bytes = sum(sum(e.length for e in store.read_part(r.step, 0, 1, bridge=r.bridge).entries) for r in needed)
        newest_base = max(s for s in steps if s <= join and refs[s][0].kind == fmt.Kind.BASE)
        bound = sum(refs[s][0].size for s in steps if newest_base < s <= join) + refs[newest_base][0].size
        bases = [s for s in window if refs[s][0].kind == fmt.Kind.BASE]
        deltas = [refs[s][0].size for s in window if refs[s][0].kind == fmt.Kind.DELTA]
        delta = sum(deltas) / len(deltas) / dense
        formula = (len(bases) + (len(window) - len(bases)) * delta) / len(window)
        full = len(window) * dense
        manifest = len(store.objects.get(fmt.RUN_MANIFEST) or b"")

    w = len(window)
    print(
        f"{args.sequence}: {w}-step window (steps {window[0]}..{window[-1]}), base_every={args.base_every}, "
        f"bases in the window at {bases}, model {dense:,d} bytes bf16; every load checked bit for bit"
    )
    print(f"{'reader':34}{'bytes':>14}{'of full every step':>20}")
    rows = [
        ("full model every step", full),
        ("in-sync follower", sum(in_sync)),
        (f"late joiner at step {join}, to the end", sum(late)),
        ("tensor codec, same steps", codec_bytes),
    ]
    for name, value in rows:
        print(f"{name:34}{value:14,d}{100 * value / full:19.2f}%")
    print(
        f"{'seeds formula, measured delta':34}{'':>14}{100 * formula:19.2f}%"
        f"   (f={len(bases)}, W={w}, delta={delta:.4f})"
    )
    print(
        f"in-sync follower / tensor codec: {sum(in_sync) / codec_bytes:.3f}x; largest step read "
        f"{max(in_sync):,d} bytes (a base is {refs[1][0].size:,d})"
    )
    markers = late[0] - manifest - bound
    ok = 0 <= markers <= 200 * (join - newest_base + 2)  # a marker per part on the path and the bridge's
    print(
        f"late joiner's first load: {late[0]:,d} bytes = base {newest_base} and the deltas to {join} "
        f"({bound:,d}) + run manifest ({manifest:,d}) + commit markers ({markers:,d}): "
        f"{'one base and the deltas after it' if ok else 'MORE than one base and the deltas after it'}"
    )


if __name__ == "__main__":
    main()
