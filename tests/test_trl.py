"""A real TRL `GRPOTrainer` run on CPU publishing through `DeltaTrainerCallback`, full fine-tuning
and LoRA; a loader in another process rebuilds every step bit-exactly against a truth recorded here."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, bf16_state, needs

needs("trl", "peft", "transformers")

import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lightning_delta import DeltaLoader  # noqa: E402
from train_trl import grpo  # noqa: E402

CHECK = """
import sys, torch
from safetensors.torch import load_file
from lightning_delta import DeltaLoader
loader = DeltaLoader(sys.argv[1])
steps = loader.steps()
for step in steps:
    got, truth = loader.state_dict(step)[1], load_file(f"{sys.argv[2]}/step-{step}.safetensors")
    assert got.keys() == truth.keys(), step
    assert all(torch.equal(got[k].view(torch.int16), truth[k].view(torch.int16)) for k in truth), step
print(len(steps))
"""


class Truth(transformers.TrainerCallback):
    """The bf16 weights the policy uses after each optimizer step (merged, for a LoRA policy)."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        policy = copy.deepcopy(model).merge_and_unload() if hasattr(model, "peft_config") else model
        self.states[state.global_step] = bf16_state(policy)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_steps_rebuild_bit_exactly_in_another_process(tmp_path, lora):
    truth, store = Truth(), str(tmp_path / "store")
    policy = grpo(store, 10, str(tmp_path / "out"), lora=lora, base_every=4, callbacks=[truth])
    folder = tmp_path / "truth"
    folder.mkdir()
    for step, state in truth.states.items():
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / f"step-{step}.safetensors"))
    check = subprocess.run([sys.executable, "-c", CHECK, store, str(folder)], capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.split() == ["10"]
    # A fresh plain model, as a rollout engine holds it, computes what the trained policy computes
    # (compared through a plain copy of the policy: TRL may leave forward hooks on its model).
    from tinylm import tiny_llama

    served = copy.deepcopy(policy).merge_and_unload() if lora else policy
    replica, reference = (tiny_llama(vocab=served.config.vocab_size, dim=32, layers=2, context=64) for _ in range(2))
    DeltaLoader(store).apply_to(replica)
    reference.load_state_dict(served.state_dict())
    tokens = torch.randint(4, 18, (2, 8))
    with torch.no_grad():
        assert torch.equal(replica.to(torch.bfloat16)(tokens).logits, reference.to(torch.bfloat16)(tokens).logits)
