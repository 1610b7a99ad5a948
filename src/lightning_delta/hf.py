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

from .codec import CodecOptions
from .publisher import Backlog, DeltaPublisher, PublishStats, check_schedule, shipped_dtype

__all__ = ["DeltaTrainerCallback"]


class DeltaTrainerCallback(TrainerCallback):
    """Publish a `transformers.Trainer`'s weights as a delta chain after every optimizer step.

    Args:
        store: fsspec URL of the chain (a local directory works).
        base_every, dtype, storage_options, codec, backlog, max_pending, keep_bases: as for
            `DeltaPublisher`.
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
        base_every: int = 25,
        dtype: torch.dtype | str = torch.bfloat16,
        *,
        storage_options: Mapping[str, Any] | None = None,
        codec: CodecOptions | None = None,
        backlog: Backlog = Backlog.BLOCK,
        max_pending: int = 2,
        keep_bases: int | None = None,
        run_id: str | None = None,
        probe: Callable[[nn.Module], torch.Tensor] | None = None,
    ) -> None:
        if not store:
            raise ValueError("store must be a URL or a local path")
        check_schedule(base_every, max_pending, keep_bases)
        self.store, self.base_every, self.dtype = store, base_every, shipped_dtype(dtype)
        self.storage_options, self.codec = dict(storage_options or {}), codec
        self.backlog, self.max_pending, self.keep_bases = Backlog(backlog), max_pending, keep_bases
        self.run_id, self.probe = run_id, probe
        self.publisher: DeltaPublisher | None = None
        self.last: PublishStats | None = None
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
            self.store,
            model,
            base_every=self.base_every,
            dtype=self.dtype,
            storage_options=self.storage_options,
            codec_options=self.codec,
            max_pending=self.max_pending,
            backlog=self.backlog,
            run_id=run_id,
            keep_bases=self.keep_bases,
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
        self.last = self.publisher.publish(state.global_step, probe)
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
        if self.publisher is None or self.last is None or not state.is_world_process_zero:
            return
        metrics = {
            "delta/changed_fraction": self.last.changed / self.last.numel if self.last.numel else 0.0,
            "delta/diff_ms": self.last.diff_ms,
            "delta/queue_depth": float(self.publisher.pending),
            "delta/skipped_steps": float(self.publisher.skipped),
        }
        upload = self.publisher.last_upload
        if upload is not None:
            metrics["delta/last_published_step"] = float(upload.step)
            metrics["delta/stored_bytes"] = float(upload.stored_bytes)
        if logs is not None:
            logs.update(metrics)
        if state.log_history:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_) -> None:
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            publisher.close()  # flushes pending uploads and raises their errors
