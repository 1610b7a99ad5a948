"""Lossless bf16 weight deltas from a trainer to a rollout fleet, through any fsspec store.

Importing the package does no work: each class is imported on first use, so a rollout process
that only needs `DeltaLoader` never loads Lightning, and the `lightning-delta` command answers
`--help` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ChainError,
    ChecksumError,
    DeltaError,
    FormatError,
    ModelMismatchError,
    PublishError,
    SnapshotNotFoundError,
    StoreError,
    UnsupportedStrategyError,
)

if TYPE_CHECKING:
    from .callback import DeltaCallback
    from .follow import FollowedStep
    from .loader import DeltaLoader, LoadReport
    from .publisher import Backlog, DeltaPublisher
    from .store import Store

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
    "StoreError",
    "UnsupportedStrategyError",
    "__version__",
]


_LAZY = {
    "Backlog": "publisher",
    "DeltaCallback": "callback",
    "DeltaLoader": "loader",
    "DeltaPublisher": "publisher",
    "FollowedStep": "follow",
    "LoadReport": "loader",
    "Store": "store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
