"""Make a checkpoint sequence for the codec benchmark, without any download.

    python scripts/make_sequence.py runs/seq                       # realistic: GRPO-like training
    python scripts/make_sequence.py runs/llama --llama             # the same, of a Hugging Face Llama
    python scripts/make_sequence.py runs/syn --synthetic 268435456 --density 0.01

Realistic mode trains TinyLM (about 6M parameters by default) with a GRPO-like objective:
sample groups of completions from the policy, reward them, normalise the rewards within each group
and ascend advantage-weighted log-probabilities, with AdamW on fp32 masters at an RL learning rate.
The bf16 cast of every step is saved as `step-XXXXXX.safetensors`.  With `--llama` the policy is a
Hugging Face Llama of the same size (`tinylm.tiny_llama`, Hugging Face names, its `config.json`
saved beside the steps), which a vLLM engine can load (scripts/bench_fleet.py --vllm-region).

Synthetic mode writes two steps of one large tensor whose elements change at `density`, 87% of
them by one ULP and the rest by a few ULPs, like the realistic sequence (see `synthetic_pair`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from tinylm import TinyLM, tiny_llama


def synthetic_pair(numel: int, density: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) bf16 tensors: weights ~ N(0, 0.02); at `density`, 87% +-1 ULP, 13% +-2..64 ULPs."""
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)
    index = torch.randperm(numel, generator=g)[: round(numel * density)].sort().values
    sign = torch.where(torch.rand(index.numel(), generator=g) < 0.5, 1, -1)
    far = torch.rand(index.numel(), generator=g) < 0.13
    size = torch.where(far, 2 ** torch.randint(1, 7, (index.numel(),), generator=g), 1)  # 2..64, log-uniform
    new = old.clone().view(torch.int16)
    new[index] += (sign * size).to(torch.int16)
    return old, new.view(torch.bfloat16)


def grpo_sequence(out: Path, steps: int, lr: float, dim: int, layers: int, seed: int, llama: bool = False) -> None:
    torch.manual_seed(seed)
    vocab, context, group, groups, length = 512, 64, 8, 4, 24
    model: torch.nn.Module
    if llama:  # its context is only its config's (rotary positions): room for an engine's generations
        model = tiny_llama(vocab=vocab, dim=dim, layers=layers, heads=4, context=256)
        model.config.save_pretrained(out)
    else:
        model = TinyLM(vocab=vocab, dim=dim, layers=layers, heads=4, context=context)

    def policy(tokens: torch.Tensor) -> torch.Tensor:
        result = model(tokens)
        return result.logits if llama else result

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    target = torch.arange(0, vocab, 7)  # reward: the fraction of sampled tokens in this set
    save(out, 0, model)
    for step in range(1, steps + 1):
        prompts = torch.randint(0, vocab, (groups, 8)).repeat_interleave(group, dim=0)
        with torch.no_grad():
            tokens = prompts
            for _ in range(length):
                logits = policy(tokens[:, -context:])[:, -1]
                tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        completion = tokens[:, prompts.shape[1] :]
        reward = torch.isin(completion, target).float().mean(dim=1).view(groups, group)
        advantage = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).view(-1)
        logp = policy(tokens[:, :-1]).log_softmax(-1)[:, prompts.shape[1] - 1 :]
        chosen = logp.gather(-1, completion.unsqueeze(-1)).squeeze(-1).sum(1)
        (-(advantage * chosen).mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        save(out, step, model)
        print(f"step {step}: mean reward {reward.mean():.3f}")


def save(out: Path, step: int, model: torch.nn.Module) -> None:
    state = {
        k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if v.is_floating_point()
    }
    save_file(state, out / f"step-{step:06d}.safetensors")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic", type=int, metavar="NUMEL", help="write a synthetic pair of NUMEL elements")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--llama", action="store_true", help="train a Hugging Face Llama (vLLM loads it) instead of TinyLM")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.synthetic:
        old, new = synthetic_pair(args.synthetic, args.density, args.seed)
        save_file({"weight": old}, args.out / "step-000000.safetensors")
        save_file({"weight": new}, args.out / "step-000001.safetensors")
    else:
        grpo_sequence(args.out, args.steps, args.lr, args.dim, args.layers, args.seed, args.llama)


if __name__ == "__main__":
    main()
