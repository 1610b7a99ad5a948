"""What signing costs per part: Ed25519 sign and verify of a marker's statement, against the
decode of the part it binds.

    PYTHONPATH=src python scripts/bench_signing.py [--elements 16000000] [--changed 0.01] [--repeat 200]

A chain of one base and a few deltas (a fraction `--changed` of the bf16 elements moved by one
ULP a step) is published signed to a temporary folder; then, per part: the trainer's signature
of its marker (statement encoding included), a reader's check of it (`Trust.check_part`, as
`Store.read_marker` runs it), and the loader's fetch, decode and verify of the step
(`LoadReport.seconds`, a delta step from the step before).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_delta import DeltaLoader, DeltaPublisher, LoaderSettings, PublisherSettings
from lightning_delta import format as fmt
from lightning_delta.signing import SigningKey, keygen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elements", type=int, default=16_000_000)
    p.add_argument("--changed", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=200)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        key_path = str(Path(tmp, "key"))
        keygen(key_path)
        url = str(Path(tmp, "chain"))
        g = torch.Generator().manual_seed(0)
        weights = {"w": (torch.randn(args.elements, generator=g) * 0.02).to(torch.bfloat16)}
        settings = PublisherSettings(base_every=1000, signing_key=key_path)
        with DeltaPublisher(url, weights, settings) as pub:
            for step in range(1, args.steps + 1):
                bits = weights["w"].view(torch.int16)
                bits[torch.rand(args.elements, generator=g) < args.changed] += 1
                pub.publish(step)
        loader = DeltaLoader(url, LoaderSettings(trusted_keys=(key_path + ".pub",)))
        loader.state_dict(1)
        decode = []
        for step in range(2, args.steps + 1):
            loader.state_dict(step)
            assert loader.last_report is not None
            decode.append(loader.last_report.seconds)
        store, run = loader.store, loader.store.run()
        trust = store.trust
        assert trust is not None
        marker = store.read_marker(args.steps, 0, 1)
        place = fmt.PartPlace(args.steps, 0, 1, False)
        key = SigningKey.load(key_path)

        def timed(fn) -> float:
            samples = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - started)
            return statistics.median(samples)

        sign = timed(lambda: key.sign(fmt.part_signed_bytes(run.run_id, run.sha256, place, marker)))
        verify = timed(lambda: trust.check_part(run, marker, place, "bench"))
        check_run = timed(lambda: trust.check_run(run, "bench"))
        part = statistics.median(decode)
        print(f"part: {args.elements:,} bf16 elements, {args.changed:.1%} changed, {marker.size:,} bytes")
        print(f"sign a marker       {sign * 1e6:9.1f} us   (trainer, per part)")
        print(f"verify a marker     {verify * 1e6:9.1f} us   (reader, per marker read)")
        print(f"verify the manifest {check_run * 1e6:9.1f} us   (reader, once)")
        print(f"fetch+decode+check  {part * 1e3:9.2f} ms   (reader, the delta step)")
        print(f"verify / decode     {verify / part:9.2%}")


if __name__ == "__main__":
    main()
