"""Run under torchrun: a transformers Trainer on 2 CPU processes (DDP over gloo) publishing with
DeltaTrainerCallback; rank 0 saves the bf16 weights after every optimizer step as the truth."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import jobs
from lightning_delta import PublisherSettings
from lightning_delta.hf import DeltaTrainerCallback
from lightning_delta.shards import named_tensors
from tinylm import tiny_llama


class Truth(transformers.TrainerCallback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in named_tensors(model).items()}
            save_file(tensors, os.path.join(self.folder, f"step-{state.global_step}.safetensors"))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 97, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    store, truth = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(truth, "out"),
        max_steps=5,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    callback = DeltaTrainerCallback(store, PublisherSettings(base_every=3))
    trainer = transformers.Trainer(
        model=tiny_llama(), args=args, train_dataset=Tokens(64), callbacks=[callback, Truth(truth)]
    )
    trainer.train()
    world = dist.get_world_size() if dist.is_initialized() else 1
    with open(os.path.join(truth, f"rank-{trainer.args.process_index}.txt"), "w") as f:
        f.write(f"{world} {callback.run_id}\n")


if __name__ == "__main__":
    main()
    jobs.end()
