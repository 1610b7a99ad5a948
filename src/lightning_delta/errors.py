"""Every error the library raises on purpose; catch `DeltaError` to catch them all.

Errors about stored bytes subclass `ValueError`, lookups subclass `LookupError`, so code
that already handles the builtins keeps working.
"""

from __future__ import annotations

__all__ = [
    "ChainError",
    "ChecksumError",
    "ConflictError",
    "DeltaError",
    "DeviceError",
    "FormatError",
    "MissingObjectError",
    "ModelMismatchError",
    "NotCompleteYetError",
    "PublishError",
    "SignatureError",
    "SnapshotNotFoundError",
    "StaleChainError",
    "StoreError",
    "UnsupportedStrategyError",
]


class DeltaError(Exception):
    """Base class of all lightning_delta errors."""


class FormatError(DeltaError, ValueError):
    """A stored object is malformed, truncated, of another version, or not ours at all."""


class ChecksumError(DeltaError, ValueError):
    """Bytes or reconstructed values do not match the checksum recorded by the trainer."""


class ChainError(DeltaError):
    """A delta's link to its predecessor is missing or points at a different snapshot."""


class MissingObjectError(ChainError, FormatError):
    """An object a committed step needs is not in the store: lost, or not there *yet* on a store
    that fills out of order (a replicated bucket).  A follower retries it at its next poll and
    counts it as damage only once `FollowSettings.missing_after` has passed.  It is a `ChainError`
    (a link is missing) and a `FormatError` (a committed object is missing), as it was before it
    had a name of its own."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key or message
        """The missing object's key below the store's prefix (a worker of a group that learns of
        the error from another has only its message)."""


class NotCompleteYetError(MissingObjectError):
    """A step is listed, but an object it needs has been missing for less than `missing_after`:
    on a store that fills out of order it is not there yet.  Nothing was read from a base and
    nothing written; the step is worth asking for again at the next poll."""


class SignatureError(DeltaError, ValueError):
    """An object of a chain is unsigned, signed by a key the reader does not trust, or its
    signature does not bind what it claims (a part moved from another step, rank or run)."""


class StaleChainError(DeltaError):
    """The newest signed heartbeat is older than `max_heartbeat_age`: the store, or a mirror on the
    way, withholds the trainer's newer steps, or the trainer stopped."""


class StoreError(DeltaError, OSError):
    """The store could not be used: no credentials, endpoint unreachable, bucket missing, access
    denied.  The message names the URL and the endpoint, never a credential."""


class ConflictError(DeltaError, FileExistsError):
    """Another writer created an object of the chain first: two publishers on one prefix."""


class SnapshotNotFoundError(DeltaError, LookupError):
    """The requested step is not (or not completely) published."""


class ModelMismatchError(DeltaError, ValueError):
    """A snapshot cannot be applied: the module's tensor names or shapes differ."""


class UnsupportedStrategyError(DeltaError, TypeError):
    """The parameters are laid out in a way the publisher cannot read through public APIs."""


class PublishError(DeltaError, RuntimeError):
    """A background upload failed; raised on the trainer's next publish or at close."""


class DeviceError(DeltaError, RuntimeError):
    """The device cannot be written at all (its CUDA context failed): restart the process."""


def by_name(name: str) -> type[DeltaError]:
    """The error class `name` (one of `__all__`), or `DeltaError`: how an error raised by one
    worker of a group is raised, as the same type, by the others."""
    found = globals().get(name)
    return found if isinstance(found, type) and issubclass(found, DeltaError) and name in __all__ else DeltaError


def first_names(names: list[str], most: int = 4) -> str:
    """The first `most` names for a message, and how many were left out (a payload of small tensors
    may hold hundreds): "a, b, c, d and 3 more"."""
    left = len(names) - most
    return ", ".join(names[:most]) + (f" and {left} more" if left > 0 else "")
