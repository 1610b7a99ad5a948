"""Follow a delta chain, swap each verified step into a tiny Llama (transformers), generate from it.

    python scripts/generate.py                               # replay the chain scripts/train.py wrote
    python scripts/generate.py follow.jump=true follow.timeout=null   # follow a live run, newest step first
    python scripts/generate.py store.url=/tmp/chain loader.device=cuda

Each step is fetched and verified in the background while the model generates on the previous
one; the model never sees a step that did not rebuild bit-exactly.  Per step it prints how far
behind the store it is, what it fetched, how long rebuilding took, the pause of the swap itself,
how far its log-probs of the trainer's probe batch are from the trainer's (0: same numbers), and
their mean, which moves with the weights every step (at RL learning rates the greedy tokens rarely do).
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
from tinylm import probe_batch, probe_logprobs, tiny_llama

register_configs()


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, context: int) -> list[int]:
    tokens = prompt
    for _ in range(new_tokens):
        logits = model(tokens[:, -context:]).logits
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, prompt.shape[1] :].tolist()


@hydra.main(version_base="1.3", config_path="pkg://lightning_delta.conf", config_name="generate")
def main(raw: DictConfig) -> None:
    cfg: GenerateConfig = OmegaConf.to_object(raw)
    device = cfg.loader.device
    loader = DeltaLoader(cfg.store.url, cfg.loader, storage_options=cfg.store.storage_options)
    if not loader.steps():
        raise SystemExit(f"no complete step in {cfg.store.url}: run scripts/train.py first")
    model = tiny_llama(**vars(cfg.model)).to(device=device, dtype=torch.bfloat16).eval()
    prompt = torch.arange(4, device=device).unsqueeze(0)
    probe = probe_batch(cfg.model, cfg.probe_seed).to(device)
    columns = f"{'step':>5} {'kind':>5} {'behind':>6} {'fetched':>10} {'rebuild':>9} {'swap':>8}"
    columns += f" {'probe err':>9} {'probe logp':>10}"
    print(f"{columns}  generated")
    applied = 0
    for followed in loader.follow(cfg.follow):
        swap = followed.apply_to(model)
        r = followed.report
        logprobs = probe_logprobs(model, probe)
        error = f"{followed.probe_error(logprobs):9.2g}" if followed.probe else f"{'-':>9}"
        tokens = greedy(model, prompt, cfg.new_tokens, cfg.model.context)
        # The probe's mean log-prob moves every step: the weights change although greedy tokens rarely do.
        print(
            f"{r.step:5d} {r.kind.value:>5} {followed.behind:6d} {r.bytes_read / 1024:8.1f}KiB "
            f"{r.seconds * 1e3:7.1f}ms {swap * 1e3:6.2f}ms {error} {float(logprobs.mean()):10.6f}  {tokens}"
        )
        applied += 1
    print(f"applied {applied} steps; every tensor of each rebuilt bit-exactly (checksums and chain links verified)")


if __name__ == "__main__":
    main()
