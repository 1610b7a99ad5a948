"""Stores that fill out of order: when a step an object of which is missing counts as damage.

A replicated bucket (S3 replication, rclone, gsutil rsync) copies objects in no particular order,
so a step can be listed before its blob, or before the step it chains to.  Such a step is not
complete yet: a follower takes what it holds or an older complete step, and tries it again at its
next poll, until one of its objects has been missing for `missing_after` seconds: then it is lost,
and the step is damage.  Both followers keep one of these clocks (`follow`, `engine`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .errors import MissingObjectError

__all__ = ["MissingClock"]


class MissingClock:
    """When each object found missing was first found missing, on this worker's clock (`clock`, a
    test's fake one).  `restart` once the follower took a step: what is missing after that counts
    from then, so that only a follower stuck on a step ever calls an object lost."""

    def __init__(self, missing_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        if missing_after < 0:
            raise ValueError(f"missing_after must be >= 0, got {missing_after}")
        self.missing_after, self.clock = missing_after, clock
        self._since: dict[str, float] = {}

    def lost(self, err: MissingObjectError) -> bool:
        """Whether `err`'s object has been missing for `missing_after` (else: not there yet)."""
        now = self.clock()
        return now - self._since.setdefault(err.key, now) >= self.missing_after

    def restart(self, before: float | None = None) -> None:
        """Forget what was found missing before `before` (on `clock`; None: all of it)."""
        self._since = {} if before is None else {k: t for k, t in self._since.items() if t >= before}
