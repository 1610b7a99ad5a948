"""Typed configuration: the components' own settings dataclasses, composed for Hydra.

`register_configs()` puts the schemas into Hydra's ConfigStore; it is called by the apps that
want them, never at import.  Each component's options are defined once, by its settings class
(`PublisherSettings`, `LoaderSettings`, `FollowSettings`); the schemas here only compose them, and
the YAML files in `lightning_delta/conf` (linked as `conf/` in the repository) fill them in, so a
misspelt override (`delta.base_evry=10`) is an error, not a silent no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING

from .follow import FollowSettings
from .loader import LoaderSettings
from .publisher import PublisherSettings

__all__ = ["Engine", "GenerateConfig", "ModelConfig", "StoreConfig", "TrainConfig", "register_configs"]


@dataclass
class StoreConfig:
    url: str = MISSING
    """fsspec URL or local path of the chain; required (conf/store/local.yaml sets the demo's),
    so a store chosen without a URL of its own is an error, never a placeholder bucket."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec: endpoint, credentials, retries (prefer the environment for secrets)."""


@dataclass
class ModelConfig:
    """The example model of scripts/: a tiny Llama built from a config."""

    vocab: int = 97
    dim: int = 64
    layers: int = 2
    heads: int = 2
    """Two heads of 32 dimensions: vLLM's CPU attention takes no smaller heads."""
    context: int = 32


@dataclass
class TrainConfig:
    store: StoreConfig = field(default_factory=StoreConfig)
    delta: PublisherSettings = field(default_factory=PublisherSettings)
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 40
    lr: float = 2e-6
    batch_size: int = 8
    seed: int = 0
    probe_seed: int = 0
    """Seed of the fixed probe batch whose log-probs are published with each step."""


class Engine(str, Enum):
    """What scripts/generate.py generates with."""

    hf = "hf"  # a Hugging Face model the loader writes each step into
    vllm = "vllm"  # a vLLM engine that follows through the lightning_delta backend (its own venv)


@dataclass
class GenerateConfig:
    engine: Engine = Engine.hf
    store: StoreConfig = field(default_factory=StoreConfig)
    loader: LoaderSettings = field(default_factory=LoaderSettings)
    follow: FollowSettings = field(default_factory=FollowSettings)
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
    cs.store(group="delta", name="delta_schema", node=PublisherSettings)
    cs.store(group="loader", name="loader_schema", node=LoaderSettings)
    cs.store(group="follow", name="follow_schema", node=FollowSettings)
