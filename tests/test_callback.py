"""DeltaCallback inside an in-process, single-device Lightning Trainer."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from conftest import bf16_state, bitwise_equal
from lightning_delta import DeltaCallback, DeltaLoader, PublishError, PublisherSettings, Store, UnsupportedStrategyError
from lightning_delta.retention import is_base_step
from tinylm import TinyLM


class ManualLM(pl.LightningModule):
    """Manual optimization with two optimizer steps per batch (think actor and value head)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = TinyLM()
        self.truth: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        opt_a, opt_b = self.optimizers()
        for opt in (opt_a, opt_b):
            logits = self.model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.truth[self.trainer.global_step] = bf16_state(self.model)

    def configure_optimizers(self):
        params = list(self.model.parameters())
        return torch.optim.AdamW(params[::2], lr=1e-4), torch.optim.AdamW(params[1::2], lr=1e-4)


def trainer(callback: DeltaCallback, *more: pl.Callback, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=bool(more),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(callbacks=[callback, *more], **{**defaults, **kwargs})


def data(batches: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(0, 97, (batches * 2, 17))), batch_size=2)


def test_manual_optimization_publishes_global_step_after_each_batch(tmp_path):
    store = str(tmp_path / "store")
    torch.manual_seed(0)
    module = ManualLM()
    trainer(DeltaCallback(store, PublisherSettings(base_every=3), submodule="model"), max_epochs=1).fit(module, data(5))
    loader = DeltaLoader(store)
    assert loader.steps() == [2, 4, 6, 8, 10]  # two optimizer steps per batch
    for step in loader.steps():
        state = loader.state_dict(step)[1]
        assert all(bitwise_equal(state[n], t) for n, t in module.truth[step].items())


def test_fast_dev_run_publishes_nothing(tmp_path):
    store = str(tmp_path / "store")
    trainer(DeltaCallback(store, submodule="model"), fast_dev_run=2).fit(ManualLM(), data(2))
    assert DeltaLoader(store).steps() == []


def test_fsdp1_is_refused_with_a_pointer_to_model_parallel():
    fake = SimpleNamespace(strategy=FSDPStrategy.__new__(FSDPStrategy))
    with pytest.raises(UnsupportedStrategyError, match="ModelParallelStrategy"):
        DeltaCallback("unused").setup(fake, None, "fit")


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="base_every"):
        DeltaCallback("x", PublisherSettings(base_every=0))
    with pytest.raises(ValueError, match="dtype"):
        DeltaCallback("x", PublisherSettings(dtype=torch.float32))
    with pytest.raises(ValueError, match="store"):
        DeltaCallback("")


def test_state_key_names_the_store():
    assert "s3://b/run" in DeltaCallback("s3://b/run").state_key


def test_the_rollout_side_never_imports_lightning():
    code = "import sys, lightning_delta.loader; assert 'lightning' not in sys.modules, 'lightning imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_metrics_reach_the_trainer_loggers(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    store = str(tmp_path / "store")
    logger = CSVLogger(str(tmp_path), name="logs", version=0)
    trainer(DeltaCallback(store, PublisherSettings(base_every=3), submodule="model"), max_epochs=1, logger=logger).fit(
        ManualLM(), data(4)
    )
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    # what each step's row says is what the store holds: the changed fraction of its part (bases
    # at 2 and 6), the last step uploaded by then, and the compression of what was uploaded
    parts = Store(store)
    numel = parts.run().numel(0)
    changed = {s: sum(e.changed for e in parts.read_part(s, 0, 1).entries) / numel for s in (2, 4, 6, 8)}
    logged = {int(r["step"]): float(r["delta/changed_fraction"]) for r in rows if r.get("delta/changed_fraction")}
    assert logged == changed and changed[2] == changed[6] == 1.0 and 0 < changed[4] < 1 and 0 < changed[8] < 1
    uploads = [r for r in rows if r.get("delta/last_published_step")]
    assert uploads and all(float(r["delta/last_published_step"]) in changed for r in uploads)
    for r in uploads:
        assert float(r["delta/last_published_step"]) <= int(r["step"])
        stored = float(r["delta/stored_bytes"])
        assert float(r["delta/compression_ratio"]) == pytest.approx(2 * numel / stored) and stored > 0


class AutoLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()
        self.truth: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.truth[self.trainer.global_step] = bf16_state(self.model)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _train_and_resume(tmp_path, first_steps: int) -> tuple[str, dict, dict]:
    """Train to `first_steps` with a checkpoint at 15, then resume from it to 30."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    store, ckpts = str(tmp_path / "store"), tmp_path / "ckpt"
    torch.manual_seed(0)
    first = AutoLM()
    save = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=15, save_top_k=-1)
    trainer(DeltaCallback(store, PublisherSettings(base_every=10), submodule="model"), save, max_steps=first_steps).fit(
        first, data(40)
    )
    second = AutoLM()
    resume = ModelCheckpoint(dirpath=tmp_path / "ckpt2")
    ckpt = next(ckpts.glob("*step=15*.ckpt"))
    trainer(DeltaCallback(store, PublisherSettings(base_every=10), submodule="model"), resume, max_steps=30).fit(
        second, data(40), ckpt_path=str(ckpt)
    )
    return store, first.truth, second.truth


@pytest.mark.parametrize("stopped_at", [15, 20], ids=["clean-stop", "crash-past-checkpoint"])
def test_a_resumed_run_continues_one_consistent_chain(tmp_path, stopped_at):
    """Resumed from the step-15 checkpoint; with a crash, the first run had published to 20."""
    store, before, after = _train_and_resume(tmp_path, first_steps=stopped_at)
    loader = DeltaLoader(store)
    assert loader.steps() == list(range(1, 31))
    truth = {s: (before if s <= stopped_at else after)[s] for s in range(1, 31)}
    for step in loader.steps():
        state = loader.state_dict(step)[1]
        assert all(bitwise_equal(state[n], t) for n, t in truth[step].items()), step
    assert is_base_step(Store(store), stopped_at + 1, 1)  # the cache is not in the checkpoint: a new base


def test_a_fresh_run_on_a_used_store_is_refused_before_training(tmp_path):
    store = str(tmp_path / "store")
    trainer(DeltaCallback(store, submodule="model"), max_steps=2).fit(AutoLM(), data(4))
    module = AutoLM()
    with pytest.raises(PublishError, match="belongs to run"):
        trainer(DeltaCallback(store, submodule="model"), max_steps=2).fit(module, data(4))
    assert module.truth == {}  # not a single step trained


def test_a_rollout_host_installs_no_trainer_side_packages():
    from importlib.metadata import requires

    core = {r.split(">")[0].split("=")[0].strip() for r in requires("lightning_delta") if "extra ==" not in r}
    assert core.isdisjoint({"lightning", "hydra-core", "s3fs", "typing_extensions"}), core
    assert {"tqdm", "safetensors", "numpy"} <= core  # imported by the loader and the CLI: declared
