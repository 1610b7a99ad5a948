"""Following a chain while it is written: poll, prefetch the next verified step, re-sync on damage.

A background thread polls the store, rebuilds the newest complete step and verifies it, while the
caller generates on the step it holds; at most `prefetch` rebuilt steps wait in between.  A follower
that fell behind jumps to the newest step: the loader decodes the deltas in between, but only the
newest one is handed out.  A step whose chain is broken (a lost delta, a corrupt object) is logged
and skipped, so the follower re-syncs at the next step that rebuilds, at the latest the next base.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn

from .errors import DeltaError

if TYPE_CHECKING:
    from .loader import DeltaLoader, LoadReport

__all__ = ["FollowedStep", "follow"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowedStep:
    """One verified step handed to the caller."""

    step: int
    tensors: dict[str, Tensor]
    behind: int  # complete steps published after this one, when it was handed out
    report: LoadReport
    skipped: tuple[int, ...]  # newer steps that did not rebuild since the previous one (damage)

    def apply_to(self, module: nn.Module) -> None:
        """Copy this step into `module` in place (names and shapes are checked first)."""
        from .loader import copy_into

        copy_into(module, self.tensors, self.step)


class _End:
    """Sentinel: the producer stopped (timeout, or an error to re-raise)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def follow(
    loader: DeltaLoader,
    *,
    poll_seconds: float = 1.0,
    prefetch: int = 1,
    max_staleness: int | None = None,
    timeout: float | None = None,
) -> Iterator[FollowedStep]:
    """Yield each newer complete, verified step; see `DeltaLoader.follow`."""
    if prefetch < 1 or poll_seconds <= 0:
        raise ValueError("prefetch must be >= 1 and poll_seconds > 0")
    ready: queue.Queue[FollowedStep | _End] = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def hand_over(item: FollowedStep | _End) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        last, skipped, idle_since = None, [], time.monotonic()
        try:
            while not stop.is_set():
                newer = [s for s in loader.steps() if last is None or s > last]
                if not newer:
                    if timeout is not None and time.monotonic() - idle_since > timeout:
                        hand_over(_End())
                        return
                    stop.wait(poll_seconds)
                    continue
                target = newer[-1]
                try:
                    step, tensors = loader.state_dict(target)
                except DeltaError as err:  # damage: wait for a step that rebuilds (the next base)
                    log.warning("step %d does not rebuild, waiting for a newer one: %s", target, err)
                    skipped.append(target)
                    last = target
                    continue
                assert loader.last_report is not None
                item = FollowedStep(step, tensors, 0, loader.last_report, tuple(skipped))
                if not hand_over(item):
                    return
                last, skipped, idle_since = step, [], time.monotonic()
        except Exception as err:  # a store that fails for good: re-raised in the caller's thread
            hand_over(_End(err))

    worker = threading.Thread(target=produce, name="delta-follow", daemon=True)
    worker.start()
    try:
        while True:
            item = ready.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            behind = sum(1 for s in loader.steps() if s > item.step)
            if max_staleness is not None and behind > max_staleness:
                log.warning("following %s: step %d is %d steps behind the store", loader.store.url, item.step, behind)
            yield FollowedStep(item.step, item.tensors, behind, item.report, item.skipped)
    finally:
        stop.set()
        worker.join()
