"""`DeltaTrainerCallback`: decides *when* a Hugging Face `Trainer` (TRL's trainers too) publishes;
`DeltaPublisher` does the rest.

    trainer = GRPOTrainer(..., callbacks=[DeltaTrainerCallback("s3://bucket/run1", base_every=25)])

`on_step_end` runs once per optimizer step (after the last micro-batch of a gradient
accumulation), so every optimizer step is published as `state.global_step`.  Each process of an
accelerate launch publishes its own share (`torch.distributed` ranks, as `DeltaPublisher` does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .publisher import DeltaPublisher, PublisherSettings, step_metrics

__all__ = ["DeltaTrainerCallback"]


class DeltaTrainerCallback(TrainerCallback):
    """Publish a `transformers.Trainer`'s weights as a delta chain after every optimizer step.

    Args:
        store: fsspec URL of the chain (a local directory works).
        settings: schedule, dtype, codec, backlog and retention (`PublisherSettings`).
        storage_options: passed to fsspec (endpoint, credentials, retries).
        run_id: the run to continue.  Without it, a fresh fit claims the prefix, and a fit resumed
            from a checkpoint (`global_step > 0` at the start) continues the run that owns it.
        probe: called with the model after each optimizer step, on every process; its tensor (the
            log-probs of a fixed probe batch) is published with the step.

    A PEFT (LoRA) model is published merged: the weights `merge_and_unload()` would give, under the
    base model's names, so a rollout engine that holds the plain base model gets the policy the
    trainer samples from (see `lightning_delta.merged`).
    """

    def __init__(
        self,
        store: str,
        settings: PublisherSettings | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        probe: Callable[[nn.Module], torch.Tensor] | None = None,
    ) -> None:
        if not store:
            raise ValueError("store must be a URL or a local path")
        self.store, self.settings = store, settings or PublisherSettings()
        self.storage_options = dict(storage_options or {})
        self.run_id, self.probe = run_id, probe
        self.publisher: DeltaPublisher | None = None
        self.metrics: dict[str, float] = {}  # the last publish's, for the next `on_log`
        self._last_step = 0

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: nn.Module | None = None, **_
    ) -> None:
        if model is None:
            raise ValueError("the Trainer passed no model to its callbacks")
        run_id = self.run_id
        if run_id is None and state.global_step > 0:  # resumed from a checkpoint: continue the prefix's run
            from .store import Store

            manifest = Store(self.store, self.storage_options).manifest()
            run_id = manifest.run_id if manifest else None
        self.publisher = DeltaPublisher(
            self.store, model, self.settings, storage_options=self.storage_options, run_id=run_id
        )
        self.run_id = self.publisher.run_id
        # A resumed fit publishes only past what the store holds (a crash may have published more).
        self._last_step = max(self.publisher.last_step, state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: nn.Module | None = None, **_
    ) -> None:
        if self.publisher is None or state.global_step <= self._last_step:
            return
        probe = None
        if self.probe is not None and model is not None:
            with torch.no_grad():
                probe = self.probe(model)
        self.metrics = step_metrics(self.publisher, self.publisher.publish(state.global_step, probe))
        self._last_step = state.global_step

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **_,
    ) -> None:
        """The main process's own numbers (no collective), into the logs and `state.log_history`."""
        if not self.metrics or not state.is_world_process_zero:
            return
        if logs is not None:
            logs.update(self.metrics)
        if state.log_history:
            state.log_history[-1].update(self.metrics)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_) -> None:
        self.metrics = {}  # an `evaluate()` after training logs no stale publishing figures
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            publisher.close()  # flushes pending uploads and raises their errors
