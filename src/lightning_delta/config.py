"""Typed configuration: dataclass schemas that Hydra validates overrides against.

`register_configs()` puts the schemas into Hydra's ConfigStore; it is called by the apps that
want them, never at import.  The YAML files in `lightning_delta/conf` (linked as `conf/` in the
repository) compose these schemas, so `delta.base_evry=10` is an error, not a silent no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import MISSING

from .codec import CodecOptions, Compressor, Context
from .format import DTYPE_NAMES
from .publisher import Backlog, check_schedule

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl

    from .callback import DeltaCallback

__all__ = ["DType", "DeltaConfig", "GenerateConfig", "LoaderConfig", "StoreConfig", "TrainConfig", "register_configs"]


class DType(str, Enum):
    """The 16-bit dtypes that can be shipped (the names of `format.DTYPE_NAMES`)."""

    bfloat16 = "bfloat16"
    float16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        return DTYPE_NAMES[self.value]


@dataclass
class StoreConfig:
    url: str = MISSING
    """fsspec URL or local path of the chain; required (conf/store/local.yaml sets the demo's),
    so a store chosen without a URL of its own is an error, never a placeholder bucket."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec: endpoint, credentials, retries (prefer the environment for secrets)."""


@dataclass
class DeltaConfig:
    base_every: int = 25
    """A full base every this many steps, deltas in between."""
    dtype: DType = DType.bfloat16
    compressor: Compressor = Compressor.ZSTD
    level: int = 1
    context: Context = Context.AUTO
    """Code delta positions per exponent class: AUTO does where the model lives on an accelerator."""
    backlog: Backlog = Backlog.BLOCK
    max_pending: int = 2
    """Snapshots that may wait for upload before `backlog` applies."""
    keep_bases: int | None = None
    """Retention: keep the steps from the `keep_bases`-th newest complete base on; None keeps all."""

    def __post_init__(self) -> None:
        check_schedule(self.base_every, self.max_pending, self.keep_bases)

    def callback(
        self,
        store: StoreConfig,
        submodule: str | None = None,
        probe: Callable[[pl.LightningModule], torch.Tensor] | None = None,
    ) -> DeltaCallback:
        """The Lightning callback this config describes (`probe`: see `DeltaCallback`)."""
        from .callback import DeltaCallback

        return DeltaCallback(
            store.url,
            base_every=self.base_every,
            dtype=self.dtype.torch,
            submodule=submodule,
            storage_options=store.storage_options,
            codec=CodecOptions(self.compressor, self.level, context=self.context),
            backlog=self.backlog,
            max_pending=self.max_pending,
            keep_bases=self.keep_bases,
            probe=probe,
        )


@dataclass
class LoaderConfig:
    device: str = "cpu"
    """Where reconstruction happens and where the model lives."""
    poll_seconds: float = 1.0
    prefetch: int = 1
    """Rebuilt steps that may wait while the caller works on the current one."""
    max_staleness: int | None = None
    """Warn when a handed-out step is more than this many published steps behind."""
    catch_up: bool = False
    """With max_staleness: drop such a step and wait for the newest one instead."""
    jump: bool = True
    """Jump to the newest complete step; False hands out every complete step in order (replay)."""
    timeout: float | None = None
    """Stop following after this many seconds without a new step; None follows forever."""
    progress: bool = False
    """Progress bars while a step is fetched from a base (for large models; a tiny one finishes first)."""


@dataclass
class ModelConfig:
    """The example model of scripts/: a tiny Llama built from a config."""

    vocab: int = 97
    dim: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 32


@dataclass
class TrainConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    delta: DeltaConfig = field(default_factory=DeltaConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 40
    lr: float = 2e-6
    batch_size: int = 8
    seed: int = 0
    probe_seed: int = 0
    """Seed of the fixed probe batch whose log-probs are published with each step."""


@dataclass
class GenerateConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    new_tokens: int = 12
    probe_seed: int = 0
    """Seed of the fixed probe batch, the same in train.py and generate.py."""


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="generate_schema", node=GenerateConfig)
    cs.store(group="store", name="store_schema", node=StoreConfig)
    cs.store(group="delta", name="delta_schema", node=DeltaConfig)
    cs.store(group="loader", name="loader_schema", node=LoaderConfig)
