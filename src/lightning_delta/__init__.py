"""Lossless bf16 weight deltas from a trainer to a rollout fleet, through any fsspec store.

Importing the package does no work; `DeltaCallback` (and with it `lightning`) is imported on
first use, so a rollout process that only needs `DeltaLoader` never loads Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ChainError,
    ChecksumError,
    DeltaError,
    FormatError,
    ModelMismatchError,
    PublishError,
    SnapshotNotFoundError,
    UnsupportedStrategyError,
)
from .follow import FollowedStep
from .loader import DeltaLoader, LoadReport
from .publisher import Backlog, DeltaPublisher
from .store import Store

if TYPE_CHECKING:
    from .callback import DeltaCallback

__version__ = "0.1.0"

__all__ = [
    "Backlog",
    "ChainError",
    "ChecksumError",
    "DeltaCallback",
    "DeltaError",
    "DeltaLoader",
    "DeltaPublisher",
    "FollowedStep",
    "FormatError",
    "LoadReport",
    "ModelMismatchError",
    "PublishError",
    "SnapshotNotFoundError",
    "Store",
    "UnsupportedStrategyError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "DeltaCallback":
        from .callback import DeltaCallback

        return DeltaCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
