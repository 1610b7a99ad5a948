"""DeltaTrainerCallback in a real `transformers.Trainer` run on CPU (a tiny Llama built from a config)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import assert_state, bf16_state  # noqa: E402
from lightning_delta import DeltaLoader, PublishError, UnsupportedStrategyError  # noqa: E402
from lightning_delta.hf import DeltaTrainerCallback  # noqa: E402
from tinylm import tiny_llama  # noqa: E402


class Truth(transformers.TrainerCallback):
    """Records the bf16 weights after each optimizer step: what a loader must rebuild."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.states[state.global_step] = bf16_state(model)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 97, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def fit(
    tmp_path, callback, steps: int = 6, accumulation: int = 2, **extra
) -> tuple[Truth, torch.nn.Module, transformers.Trainer]:
    torch.manual_seed(0)
    model, truth = tiny_llama(), Truth()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=[callback, truth])
    trainer.train()
    return truth, model, trainer


def test_every_optimizer_step_rebuilds_bit_exactly(tmp_path):
    url = str(tmp_path / "store")
    callback = DeltaTrainerCallback(url, base_every=4)
    truth, model, trainer = fit(tmp_path, callback)
    loader = DeltaLoader(url)
    assert loader.steps() == [1, 2, 3, 4, 5, 6]  # one per optimizer step, not per micro-batch
    for step in loader.steps():
        assert_state(loader.state_dict(step)[1], truth.states[step])
    replica = tiny_llama()
    loader.apply_to(replica)
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.equal(replica.to(torch.bfloat16)(tokens).logits, model.to(torch.bfloat16)(tokens).logits)
    logged = [h for h in trainer.state.log_history if "delta/changed_fraction" in h]
    assert logged and all(0 <= h["delta/changed_fraction"] <= 1 for h in logged)


def test_a_used_prefix_is_refused_before_training(tmp_path):
    url = str(tmp_path / "store")
    fit(tmp_path, DeltaTrainerCallback(url), steps=2, accumulation=1)
    with pytest.raises(PublishError, match="belongs to run"):
        fit(tmp_path, DeltaTrainerCallback(url), steps=2, accumulation=1)


def test_a_peft_model_is_refused_with_the_way_out(tmp_path):
    class FakePeft(torch.nn.Module):  # what the check looks at: peft models carry `peft_config`
        peft_config = None

    callback = DeltaTrainerCallback(str(tmp_path / "store"))
    state = transformers.TrainerState()
    with pytest.raises(UnsupportedStrategyError, match="merge_and_unload"):
        callback.on_train_begin(None, state, transformers.TrainerControl(), model=FakePeft())
