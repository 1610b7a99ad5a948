"""A tiny GRPO run with TRL on the CPU that publishes every optimizer step to a delta chain.

    .venv/bin/pip install -c <(echo torch==2.13.0) -e '.[hf]'
    .venv/bin/python scripts/train_trl.py runs/trl/store --steps 10          # full fine-tuning
    .venv/bin/python scripts/train_trl.py runs/trl-lora/store --steps 10 --lora   # a LoRA policy, published merged
    .venv/bin/lightning-delta materialize runs/trl/store --step 10 runs/trl/step10 --config runs/trl/model

No download: the policy is a small Llama built from a config and the tokenizer a word-level one
built here; the reward counts how often a completion says "yes".  The rollout side follows the
chain with `DeltaLoader(...).follow()` (README, "Rollout side").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerFast, TrainerCallback

sys.path.insert(0, os.path.dirname(__file__))
from lightning_delta import PublisherSettings
from lightning_delta.hf import DeltaTrainerCallback
from tinylm import tiny_llama

WORDS = ["yes", "no", "maybe", "the", "a", "is", "it", "good", "bad", "answer", "question", "why", "how", "what"]


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS plus four special tokens, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", *WORDS])}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def says_yes(completions: Sequence[str], **_) -> list[float]:
    """The toy reward: the share of "yes" among a completion's words."""
    return [c.split().count("yes") / max(len(c.split()), 1) for c in completions]


def grpo(
    store: str,
    steps: int,
    output_dir: str,
    *,
    lora: bool = False,
    base_every: int = 5,
    callbacks: Sequence[TrainerCallback] = (),
    seed: int = 0,
    model_dir: str | None = None,
) -> torch.nn.Module:
    """Train a tiny policy with GRPO for `steps` optimizer steps, publishing each; returns it.

    With `model_dir`, the model's config and the tokenizer are saved there first: what the
    rollout side needs besides the weights (`lightning-delta materialize --config model_dir`)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(seed)
    tok = tokenizer()
    model = tiny_llama(vocab=len(tok), dim=32, layers=2, context=64)
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.config.bos_token_id = tok.bos_token_id
    if model_dir is not None:
        model.config.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        # transformers 5 names its own backend class there, which 4.x does not know; both load this one.
        path = os.path.join(model_dir, "tokenizer_config.json")
        with open(path) as f:
            settings = json.load(f)
        with open(path, "w") as f:
            json.dump({**settings, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    prompts = Dataset.from_dict({"prompt": ["what is the answer", "why is it good", "how is it", "is it bad"] * 8})
    args = GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-3 if lora else 1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=says_yes,
        args=args,
        train_dataset=prompts,
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[DeltaTrainerCallback(store, PublisherSettings(base_every=base_every)), *callbacks],
    )
    trainer.train()
    return trainer.model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store", help="fsspec URL or local path of the chain")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--base-every", type=int, default=5)
    p.add_argument("--lora", action="store_true", help="train LoRA adapters; the merged policy is published")
    args = p.parse_args()
    runs = os.path.dirname(os.path.abspath(args.store))
    model_dir = os.path.join(runs, "model")
    out = os.path.join(runs, "trl-out")
    grpo(args.store, args.steps, out, lora=args.lora, base_every=args.base_every, model_dir=model_dir)
    print(f"published {args.steps} GRPO steps to {args.store}; the model's config and tokenizer are in {model_dir}")


if __name__ == "__main__":
    main()
