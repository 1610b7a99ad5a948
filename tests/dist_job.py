"""One rank of a multi-process Lightning run, started by tests with torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_job.py STORE TRUTH --strategy fsdp2

It trains TinyLM with AdamW at an RL-like learning rate and `DeltaCallback`, and rank 0 saves the
true full bf16 state after every optimizer step to TRUTH/step-XXXXXX.safetensors, gathered by
itself (DTensor.full_tensor), so the test can compare what the loader rebuilds against it.
With `--probe`, DeltaCallback publishes the log-probs of a fixed batch after every step (a no-grad
forward, the documented probe), and rank 0 saves the same values to TRUTH/probe-XXXXXX.pt.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import jobs
from lightning_delta import DeltaCallback, PublisherSettings
from lightning_delta.shards import named_tensors
from tinylm import TinyLM


class LM(pl.LightningModule):
    def __init__(self, lr: float, sharded: bool) -> None:
        super().__init__()
        self.lr, self.sharded = lr, sharded
        self.model = TinyLM()

    def configure_model(self) -> None:
        if self.sharded:
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


PROBE = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))


def probe(pl_module: LM) -> torch.Tensor:
    """Log-probs of a fixed batch: a forward on every rank (FSDP2 gathers the shards)."""
    return torch.log_softmax(pl_module.model(PROBE).float(), dim=-1)


class RecordTruth(pl.Callback):
    def __init__(self, out: str, probed: bool) -> None:
        self.out, self.probed, self.last = out, probed, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last:
            return
        self.last = trainer.global_step
        full = {}
        for name, t in named_tensors(pl_module.model).items():
            t = t.full_tensor() if isinstance(t, DTensor) else t  # a collective on every rank
            full[name] = t.detach().to(torch.bfloat16).contiguous()
        expected = probe(pl_module) if self.probed else None  # a collective too
        if trainer.global_rank == 0:
            save_file(full, os.path.join(self.out, f"step-{trainer.global_step:06d}.safetensors"))
            if expected is not None:
                torch.save(expected, os.path.join(self.out, f"probe-{trainer.global_step:06d}.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("truth")
    p.add_argument("--strategy", choices=["fsdp2", "ddp"], default="fsdp2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--base-every", type=int, default=10)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--endpoint", help="S3 endpoint URL (a test's moto server)")
    p.add_argument("--probe", action="store_true", help="publish a probe's log-probs with every step")
    p.add_argument("--signing-key", help="sign the chain with this private key (every rank its own parts)")
    args = p.parse_args()
    os.makedirs(args.truth, exist_ok=True)
    torch.manual_seed(0)  # same initial weights and data on every rank
    data = TensorDataset(torch.randint(0, 97, (args.steps * args.accumulate * 2 * 4, 17)))
    sharded = args.strategy == "fsdp2"
    options = {"client_kwargs": {"endpoint_url": args.endpoint}} if args.endpoint else None
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if sharded
        else DDPStrategy(process_group_backend="gloo")
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=[
            DeltaCallback(
                args.store,
                PublisherSettings(base_every=args.base_every, signing_key=args.signing_key),
                submodule="model",
                storage_options=options,
                probe=probe if args.probe else None,
            ),
            RecordTruth(args.truth, args.probe),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LM(args.lr, sharded), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
    jobs.end()
