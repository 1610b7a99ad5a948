"""`DeltaCallback`: decides *when* a Lightning run publishes; `DeltaPublisher` does the rest."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from .errors import UnsupportedStrategyError
from .publisher import DeltaPublisher, PublisherSettings, step_metrics

__all__ = ["DeltaCallback"]


class DeltaCallback(Callback):
    """Publish the trained weights as a delta chain after every optimizer step.

    The snapshot's step is `trainer.global_step`, so gradient accumulation and manual
    optimization publish once per optimizer step (once per batch when a batch steps several
    optimizers).  Every rank publishes its own shard; nothing waits on the network.

    Args:
        store: fsspec URL of the chain (a local directory works).
        settings: schedule, dtype, codec, backlog and retention (`PublisherSettings`).
        submodule: publish `pl_module.<submodule>` (dotted path) instead of the whole
            LightningModule, so names match a bare model on the rollout side.
        storage_options: passed to fsspec (endpoint, credentials, retries).
        probe: called with the LightningModule after each optimizer step, on every rank (so it
            may run a sharded forward); its tensor, the log-probs of a fixed probe batch, is
            published with the step for rollout workers to compare against (see
            `DeltaPublisher.publish`).  It runs even on steps that `Backlog.COALESCE` then
            skips: ranks skip on their own, and a sharded forward needs all of them.
    """

    def __init__(
        self,
        store: str,
        settings: PublisherSettings | None = None,
        *,
        submodule: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        probe: Callable[[pl.LightningModule], torch.Tensor] | None = None,
    ) -> None:
        if not store:
            raise ValueError("store must be a URL or a local path")
        self.store, self.settings = store, settings or PublisherSettings()
        self.storage_options = dict(storage_options or {})
        self.submodule = submodule
        self.probe = probe
        self.publisher: DeltaPublisher | None = None
        self._run_id: str | None = None
        self._last_step = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(store=self.store, submodule=self.submodule)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if isinstance(trainer.strategy, FSDPStrategy):
            raise UnsupportedStrategyError(
                "DeltaCallback cannot read FSDPStrategy's flat parameters through public torch APIs; "
                "use ModelParallelStrategy with torch.distributed.fsdp.fully_shard (FSDP2) in "
                "configure_model instead"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        """The run id goes into Lightning's checkpoints, so a resumed fit continues the same run."""
        return {"run_id": self._run_id}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._run_id = state_dict.get("run_id")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a checkpoint is restored, so a resumed fit continues its run and a fresh one
        claims the prefix (a prefix another run owns is refused here, before the first step)."""
        if getattr(trainer, "fast_dev_run", False):  # publishes nothing
            return
        module = pl_module.get_submodule(self.submodule) if self.submodule else pl_module
        run_id = self._run_id if trainer.global_step > 0 else None
        self.publisher = DeltaPublisher(
            self.store, module, self.settings, storage_options=self.storage_options, run_id=run_id
        )
        self._run_id = self.publisher.run_id
        where, every = self.store, self.settings.base_every
        rank_zero_info(f"DeltaCallback: publishing run {self._run_id} to {where} (base every {every})")
        # Resuming: steps up to the store's last may come from after the checkpoint (a crash); the
        # new trajectory publishes only past them, starting with a base, so loaders see one chain.
        self._last_step = max(trainer.strategy.broadcast(self.publisher.last_step), trainer.global_step)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.sanity_checking or getattr(trainer, "fast_dev_run", False):
            return
        step = trainer.global_step
        if self.publisher is None or step <= self._last_step:  # accumulation, or already in the store
            return
        probe = None
        if self.probe is not None:
            with torch.no_grad():
                probe = self.probe(pl_module)
        stats = self.publisher.publish(step, probe)
        self._last_step = step
        if trainer.is_global_zero and trainer.loggers:
            metrics = step_metrics(self.publisher, stats)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            publisher.close()  # flushes pending uploads and raises their errors
