"""Follow a delta chain, swap each verified step into a local model copy, and generate from it.

    python scripts/generate.py                          # the chain scripts/train.py wrote
    python scripts/generate.py store.url=/tmp/chain loader.device=cuda

The model never sees a step that did not rebuild bit-exactly: `DeltaLoader.apply_to` verifies
every checksum and link before it copies anything.
"""

from __future__ import annotations

import os
import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, os.path.dirname(__file__))
from lightning_delta import DeltaLoader
from lightning_delta.config import GenerateConfig, register_configs
from tinylm import TinyLM

register_configs()


@torch.no_grad()
def greedy(model: TinyLM, prompt: torch.Tensor, new_tokens: int, context: int) -> list[int]:
    tokens = prompt
    for _ in range(new_tokens):
        logits = model(tokens[:, -context:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, prompt.shape[1] :].tolist()


@hydra.main(version_base="1.3", config_path="pkg://lightning_delta.conf", config_name="generate")
def main(raw: DictConfig) -> None:
    cfg: GenerateConfig = OmegaConf.to_object(raw)
    loader = DeltaLoader(cfg.store.url, storage_options=cfg.store.storage_options, device=cfg.loader.device)
    model = TinyLM(**vars(cfg.model)).to(cfg.loader.device).eval()
    prompt = torch.arange(4, device=cfg.loader.device).unsqueeze(0)
    steps = loader.steps()
    if not steps:
        raise SystemExit(f"no complete step in {cfg.store.url}: run scripts/train.py first")
    print(f"{'step':>5} {'kind':>5} {'fetched':>10} {'rebuild':>9}  generated")
    for step in steps:
        loader.apply_to(model, step)
        r = loader.last_report
        tokens = greedy(model, prompt, cfg.new_tokens, cfg.model.context)
        print(f"{r.step:5d} {r.kind.value:>5} {r.payload_bytes / 1024:8.1f}KiB {r.seconds * 1e3:7.1f}ms  {tokens}")
    print(f"applied {len(steps)} steps; every tensor of each rebuilt bit-exactly (checksums and chain links verified)")


if __name__ == "__main__":
    main()
