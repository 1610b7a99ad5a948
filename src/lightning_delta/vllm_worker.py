"""Swap verified steps into a vLLM engine through its own weight-loading path.

vLLM shards, fuses (q/k/v into qkv, gate/up into gate_up) and casts weights in each model's
`load_weights`, which takes an iterable of `(name, full tensor)` in Hugging Face naming: exactly
what `DeltaLoader.state_dict` returns.  So every worker process of the engine runs a loader of
its own (or, with `process_group`, one download shared by the engine's workers) and hands the
verified tensors to `load_weights`.  Nothing reaches vLLM before every checksum of the step passed.

    llm = LLM(model=path, worker_extension_cls="lightning_delta.vllm_worker.DeltaWorkerExtension")
    llm.collective_rpc("delta_open", args=("s3://bucket/run1",))
    step = llm.collective_rpc("delta_update")[0]          # newest complete step, on every worker
    llm.collective_rpc("delta_update", args=(step + 1,))  # or a given one

`load_weights` copies into the live parameters tensor by tensor.  A step is verified before the
first copy, so what can still fail is the engine's own mapping (a name the model does not know);
every update hands over *all* tensors of a step, so the next successful one leaves no mix behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from .loader import DeltaLoader

__all__ = ["DeltaWorkerExtension", "weights_for_load"]


def weights_for_load(
    tensors: Mapping[str, Tensor], rename: Callable[[str], str | None] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """`(name, tensor)` pairs in the shape of vLLM's `model.load_weights(weights=...)` argument."""
    for name, tensor in tensors.items():
        target = rename(name) if rename is not None else name
        if target is not None:
            yield target, tensor


class DeltaWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); methods run via `collective_rpc`.

    vLLM gives the worker `self.device` and `self.model_runner.model`; nothing else is assumed.
    """

    _delta_loader: DeltaLoader | None = None
    _delta_rename: Callable[[str], str | None] | None = None

    def delta_open(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        rename: Callable[[str], str | None] | None = None,
    ) -> None:
        """Start following the chain at `url`; tensors are staged on the worker's device.

        Arguments travel to the workers through `collective_rpc`, so `rename` must be picklable
        (a module-level function, not a lambda).
        """
        device = getattr(self, "device", torch.device("cpu"))
        self._delta_loader = DeltaLoader(url, storage_options=storage_options, device=device)
        self._delta_rename = rename

    def delta_update(self, step: int | None = None) -> int:
        """Load a verified step (the newest complete one by default) into the model; returns it."""
        if self._delta_loader is None:
            raise RuntimeError("call delta_open first")
        step, tensors = self._delta_loader.state_dict(step)
        model = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights(weights=weights_for_load(tensors, self._delta_rename))
        return step

    def delta_probe(self) -> tuple[float, ...] | None:
        """The trainer's probe log-probs of the step last loaded, if it published them."""
        report = self._delta_loader.last_report if self._delta_loader else None
        return report.probe if report else None
