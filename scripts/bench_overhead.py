"""What `DeltaCallback` costs a training step: the same Lightning loop with and without it.

    python scripts/bench_overhead.py                    # ~10M-parameter TinyLM, ~1 s steps
    python scripts/bench_overhead.py --slow-store 1.5   # and a run whose every store write sleeps 1.5 s

Prints, from one run: the median step time without and with the callback and their ratio, the
median time the callback blocked a step (its `on_train_batch_end`), and the median time of a bare
diff of the same shard (cast the live weights to bf16 and `codec.diff` them against the previous
step).  With `--slow-store`, a third run publishes through an fsspec filesystem that sleeps on
every write, with `Backlog.COALESCE`: training keeps its speed, published steps thin out, and every
published step is then rebuilt and compared bit for bit with the weights the trainer held.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import fsspec
import lightning.pytorch as pl
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
from lightning_delta import Backlog, DeltaCallback, DeltaLoader, PublisherSettings, codec
from lightning_delta.shards import named_tensors
from tinylm import TinyLM


class SlowFileSystem(LocalFileSystem):
    """A local directory whose every write first sleeps `delay` seconds: a congested uplink."""

    protocol = ("slowfile",)

    def __init__(self, delay: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay = delay

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(str(path).removeprefix("slowfile://"))

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        time.sleep(self.delay)
        super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)


class Policy(pl.LightningModule):
    def __init__(self, model: TinyLM, lr: float) -> None:
        super().__init__()
        self.policy, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.policy(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class StepClock(pl.Callback):
    """Wall time from one batch start to the next: the whole step, every callback included.

    It also keeps the bf16 weights after each step when asked, as the truth to compare against.
    """

    def __init__(self, keep_truth: bool = False) -> None:
        self.starts: list[float] = []
        self.truth: dict[int, dict[str, torch.Tensor]] = {}
        self.keep_truth = keep_truth

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.keep_truth:
            tensors = named_tensors(pl_module.policy)
            self.truth[trainer.global_step] = {k: v.detach().to(torch.bfloat16).clone() for k, v in tensors.items()}

    def step_seconds(self, warmup: int) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.starts)][warmup:]


class TimedDeltaCallback(DeltaCallback):
    """`DeltaCallback`, timing how long each publish holds the training thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blocked: list[float] = []
        self.blocked_at: dict[int, float] = {}  # step -> seconds
        self.uploads: dict[int, float] = {}  # step -> worker ms

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        started = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.blocked.append(time.perf_counter() - started)
        self.blocked_at[trainer.global_step] = self.blocked[-1]
        if self.publisher is not None and self.publisher.last_upload is not None:
            self.uploads[self.publisher.last_upload.step] = self.publisher.last_upload.upload_ms


def train(args: argparse.Namespace, callbacks: list[pl.Callback]) -> Policy:
    torch.manual_seed(args.seed)
    model = TinyLM(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
    tokens = torch.randint(0, args.vocab, (args.steps * args.batch, args.context + 1))
    module = Policy(model, args.lr)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=args.batch))
    return module


def bare_diff_seconds(module: Policy, previous: dict[str, torch.Tensor], repeats: int = 5, copy: bool = False) -> float:
    """Median time to cast the live weights to bf16 and diff them against `previous` (and, for
    a base step, take the device-side copy of the shard the worker packs)."""
    live = named_tensors(module.policy)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for name, tensor in live.items():
            new = tensor.detach().flatten().to(torch.bfloat16)
            codec.diff(previous[name].flatten(), new)
            if copy:
                new.clone()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs without and with the callback")
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=320)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--heads", type=int, default=5)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument("--base-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--slow-store", type=float, default=0.0, help="seconds each write sleeps in a third run")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = sum(p.numel() for p in TinyLM(args.vocab, args.dim, args.layers, args.heads, args.context).parameters())
    print(
        f"TinyLM {params / 1e6:.1f}M parameters, batch {args.batch}x{args.context}, {args.steps} steps per run, "
        f"torch threads {torch.get_num_threads()}"
    )

    without, with_cb, blocked, worker, at_bases = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            # Alternate which run goes first, so that drift of the machine's speed cancels out.
            for with_delta in (False, True) if round_ % 2 == 0 else (True, False):
                clock = StepClock()
                if not with_delta:
                    train(args, [clock])
                    without.append(statistics.median(clock.step_seconds(args.warmup)))
                    continue
                delta = TimedDeltaCallback(
                    f"{tmp}/chain{round_}", PublisherSettings(base_every=args.base_every), submodule="policy"
                )
                module = train(args, [clock, delta])
                with_cb.append(statistics.median(clock.step_seconds(args.warmup)))
                blocked += delta.blocked[args.warmup :]
                # Base steps after the first (1 + k * base_every): a bridge diff plus a device copy.
                at_bases += [t for s, t in delta.blocked_at.items() if s > 1 and (s - 1) % args.base_every == 0]
                worker += [ms for step, ms in delta.uploads.items() if step > args.warmup]
            print(f"round {round_ + 1}: median step {without[-1]:.3f} s without, {with_cb[-1]:.3f} s with the callback")
        loader = DeltaLoader(f"{tmp}/chain{args.rounds - 1}")
        _, previous = loader.state_dict(loader.steps()[-2])
        bare = bare_diff_seconds(module, previous)
        bare_base = bare_diff_seconds(module, previous, copy=True)

    base, ours, held = statistics.median(without), statistics.median(with_cb), statistics.median(blocked)
    ratio = statistics.median(b / a for a, b in zip(without, with_cb, strict=True))
    print(f"\n| run | median step s | ratio |\n|---|---:|---:|\n| without DeltaCallback | {base:.3f} | 1.000 |")
    print(f"| with DeltaCallback | {ours:.3f} | {ratio:.3f} |")
    print("(ratio: the median over rounds of each round's with/without ratio)")
    print(
        f"\nblocked per step (median): {held * 1e3:.1f} ms; bare bf16 cast + diff of the same shard: "
        f"{bare * 1e3:.1f} ms; ratio {held / bare:.2f}"
    )
    print(f"worker thread per step (median): {statistics.median(worker):.1f} ms (pack, copy, compress, hash, write)")
    if at_bases:
        print(
            f"blocked at base steps after the first (median of {len(at_bases)}): "
            f"{statistics.median(at_bases) * 1e3:.1f} ms; bare cast + diff + device copy of the shard: "
            f"{bare_base * 1e3:.1f} ms (packing, checksum and compression run on the worker threads)"
        )

    if args.slow_store:
        slowed(args, base)


def slowed(args: argparse.Namespace, base_step: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clock = StepClock(keep_truth=True)
        delta = TimedDeltaCallback(
            f"slowfile://{tmp}/chain",
            PublisherSettings(base_every=args.base_every, backlog=Backlog.COALESCE, max_pending=1),
            submodule="policy",
            storage_options={"delay": args.slow_store},
        )
        started = time.perf_counter()
        train(args, [clock, delta])
        trained = time.perf_counter() - started
        loader = DeltaLoader(f"{tmp}/chain")
        steps = loader.steps()
        for step in steps:
            _, tensors = loader.state_dict(step)
            truth = clock.truth[step]
            assert tensors.keys() == truth.keys()
            for name, value in truth.items():
                assert torch.equal(tensors[name].view(torch.int16), value.view(torch.int16)), (step, name)
    step = statistics.median(clock.step_seconds(args.warmup))
    print(f"\nslowed store ({args.slow_store:.1f} s per write, 2 writes per step, Backlog.COALESCE, max_pending=1):")
    print(
        f"median step {step:.3f} s ({step / base_step:.3f}x the run without the callback), fit {trained:.1f} s "
        f"including the final flush; published {len(steps)} of {args.steps} steps: {steps}"
    )
    print(f"every published step rebuilt bit-exactly against the trainer's weights ({len(steps)} checked)")


if __name__ == "__main__":
    main()
