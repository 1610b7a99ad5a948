"""Train a tiny Llama (transformers) with Lightning at an RL-like learning rate, publishing a delta chain.

    python scripts/train.py                                   # local store runs/demo/store
    python scripts/train.py delta.base_every=10 steps=60 store.url=/tmp/chain
    python scripts/train.py store=s3 store.url=s3://bucket/run1

The objective is a stand-in for an RL loss (cross-entropy on synthetic sequences); what matters
here is the optimizer: AdamW with fp32 masters at lr ~1e-6, whose bf16 casts change a few percent
of elements per step.  With each step it also publishes the log-probs of a fixed probe batch,
computed from the bf16 weights that ship, which scripts/generate.py recomputes after each swap.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import hydra
import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
from lightning_delta import DeltaCallback, Store
from lightning_delta.config import TrainConfig, register_configs
from lightning_delta.format import Kind
from lightning_delta.traffic import stored_bytes, window_cost
from tinylm import probe_batch, probe_logprobs, tiny_llama

register_configs()
# A demo's output is its own lines: no tips, no device banners, no warnings about Lightning's internals.
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


class EveryTenSteps(pl.Callback):
    """One line per ten optimizer steps instead of a progress bar (a max_steps run has no epochs)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % 10 == 0:
            print(f"step {trainer.global_step:4d}/{trainer.max_steps}  loss {float(outputs['loss']):.4f}  published")


class PolicyModule(pl.LightningModule):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.lr = cfg.lr
        self.policy = tiny_llama(**vars(cfg.model))
        self.shipped = tiny_llama(**vars(cfg.model)).to(torch.bfloat16)  # the rollout side's view
        self.probe_tokens = probe_batch(cfg.model, cfg.probe_seed)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.policy(tokens, labels=tokens).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def probe(self) -> torch.Tensor:
        """Log-probs of the probe batch under the bf16 weights that are published."""
        self.shipped.load_state_dict({k: v.to(torch.bfloat16) for k, v in self.policy.state_dict().items()})
        return probe_logprobs(self.shipped, self.probe_tokens)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr, weight_decay=0.01)


@hydra.main(version_base="1.3", config_path="pkg://lightning_delta.conf", config_name="train")
def main(raw: DictConfig) -> None:
    cfg: TrainConfig = OmegaConf.to_object(raw)
    store = Store(cfg.store.url, cfg.store.storage_options)
    if store.published_steps():
        raise SystemExit(f"{store.url} already holds a chain; a run needs a prefix of its own (store.url=...)")
    pl.seed_everything(cfg.seed, verbose=False)
    tokens = torch.randint(0, cfg.model.vocab, (cfg.steps * cfg.batch_size, cfg.model.context + 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=cfg.steps,
        callbacks=[
            DeltaCallback(
                cfg.store.url,
                cfg.delta,
                storage_options=cfg.store.storage_options,
                submodule="policy",
                probe=PolicyModule.probe,
            ),
            EveryTenSteps(),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(PolicyModule(cfg), DataLoader(TensorDataset(tokens), batch_size=cfg.batch_size))
    summarize(store)


def summarize(store: Store) -> None:
    """What the chain stores per kind of step, and what a follower of every step moved, against
    shipping the full model every step (bytes of objects: parts, bridges and markers)."""
    steps = store.published_steps()
    world = store.manifest().world_size
    cost = window_cost(store, steps, None)
    refs = {s: [r for rank in range(world) for r in store.part_refs(s, rank, world)] for s in steps}
    for kind in Kind:
        sizes = [stored_bytes(refs[s]) for s in steps if refs[s][0].kind == kind]
        if sizes:
            mean = sum(sizes) / len(sizes)
            share = 100 * mean / cost.dense_bytes
            print(f"{kind.value:>5}: {len(sizes):3d} steps, {mean / 1024:8.1f} KiB stored each ({share:5.2f}% of bf16)")
    print(
        f"published {len(steps)} steps to {store.url}: {cost.stored / 1024:.1f} KiB stored; a follower of every "
        f"step moves {cost.in_sync / 1024:.1f} KiB, {100 * cost.share(cost.in_sync):.2f}% of the full model "
        f"every step ({cost.full_every_step / 1024:.1f} KiB)"
    )


if __name__ == "__main__":
    main()
