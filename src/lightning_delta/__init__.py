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
    ConflictError,
    DeltaError,
    DeviceError,
    FormatError,
    MissingObjectError,
    ModelMismatchError,
    NotCompleteYetError,
    PublishError,
    SignatureError,
    SnapshotNotFoundError,
    StaleChainError,
    StoreError,
    UnsupportedStrategyError,
)

if TYPE_CHECKING:
    from .callback import DeltaCallback
    from .follow import FollowedStep, FollowSettings
    from .format import DType
    from .loader import DeltaLoader, FullCheck, LoaderSettings
    from .mirror import Mirror, MirrorMetrics, MirrorSettings
    from .patch import LoadReport
    from .publisher import Backlog, DeltaPublisher, PublisherSettings
    from .store import Store

__version__ = "0.1.0"

__all__ = [
    "Backlog",
    "ChainError",
    "ChecksumError",
    "ConflictError",
    "DType",
    "DeltaCallback",
    "DeltaError",
    "DeviceError",
    "DeltaLoader",
    "DeltaPublisher",
    "FollowSettings",
    "FollowedStep",
    "FormatError",
    "FullCheck",
    "LoadReport",
    "LoaderSettings",
    "Mirror",
    "MirrorMetrics",
    "MirrorSettings",
    "MissingObjectError",
    "ModelMismatchError",
    "NotCompleteYetError",
    "PublishError",
    "PublisherSettings",
    "SignatureError",
    "SnapshotNotFoundError",
    "StaleChainError",
    "Store",
    "StoreError",
    "UnsupportedStrategyError",
    "__version__",
]


_LAZY = {
    "Backlog": "publisher",
    "DType": "format",
    "DeltaCallback": "callback",
    "DeltaLoader": "loader",
    "DeltaPublisher": "publisher",
    "FollowSettings": "follow",
    "FollowedStep": "follow",
    "FullCheck": "loader",
    "LoadReport": "patch",
    "LoaderSettings": "loader",
    "Mirror": "mirror",
    "MirrorMetrics": "mirror",
    "MirrorSettings": "mirror",
    "PublisherSettings": "publisher",
    "Store": "store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
