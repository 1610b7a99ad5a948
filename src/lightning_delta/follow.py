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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .errors import DeltaError
from .replica import agree

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

    @property
    def probe(self) -> tuple[float, ...] | None:
        """The trainer's probe log-probs at this step, if it published them."""
        return self.report.probe

    def probe_error(self, recomputed: Tensor) -> float:
        """Largest absolute difference between `recomputed` log-probs and the trainer's probe."""
        if self.probe is None:
            raise ValueError(f"step {self.step} was published without a probe")
        published = torch.tensor(self.probe, dtype=torch.float32)
        got = recomputed.detach().float().flatten().cpu()
        if got.shape != published.shape:
            raise ValueError(f"recomputed probe has {got.numel()} values, the trainer's {published.numel()}")
        return float((got - published).abs().max()) if got.numel() else 0.0

    def apply_to(
        self,
        module: nn.Module,
        *,
        rename: Callable[[str], str | None] | None = None,
        after: Callable[[nn.Module], None] | None = None,
    ) -> float:
        """Copy this step into `module` in place (names and shapes are checked first), then run
        `after`; returns the seconds of the copy, the only pause a follower sees."""
        from .loader import copy_into

        seconds = copy_into(module, self.tensors, self.step, rename=rename)
        if after is not None:
            after(module)
        return seconds


class _End:
    """Sentinel: the producer stopped (timeout, or an error to re-raise)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


_NONE, _TIMED_OUT, _STOPPED = -1, -2, -3  # producer decisions besides a step number


def follow(
    loader: DeltaLoader,
    *,
    poll_seconds: float = 1.0,
    prefetch: int = 1,
    max_staleness: int | None = None,
    catch_up: bool = False,
    jump: bool = True,
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
        last, skipped, idle_since, said = None, [], time.monotonic(), False
        try:
            while True:
                newer = loader.steps(after=last)
                if not newer and last is None and not said:  # a follower started before its trainer
                    log.warning(
                        "following %s: no complete step yet, polling every %s s", loader.store.url, poll_seconds
                    )
                    said = True
                newest = (newer[-1] if jump else newer[0]) if newer else _NONE
                if newest == _NONE and timeout is not None and time.monotonic() - idle_since > timeout:
                    newest = _TIMED_OUT
                if stop.is_set():
                    newest = _STOPPED
                if loader.group is not None:  # a replica's workers all do what group rank 0 does
                    newest = agree(newest, loader.group)
                if newest in (_STOPPED, _TIMED_OUT):
                    hand_over(_End())
                    return
                if newest == _NONE:
                    stop.wait(poll_seconds)
                    continue
                try:
                    step, tensors = loader.state_dict(newest)
                except DeltaError as err:  # damage: wait for a step that rebuilds (the next base)
                    log.warning("step %d does not rebuild, waiting for a newer one: %s", newest, err)
                    skipped.append(newest)
                    last = newest
                    continue
                assert loader.last_report is not None
                # A stopped caller takes nothing more; the loop then ends at the next decision.
                hand_over(FollowedStep(step, tensors, 0, loader.last_report, tuple(skipped)))
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
            behind = len(loader.steps(after=item.step))
            if max_staleness is not None and behind > max_staleness:
                log.warning("following %s: step %d is %d steps behind the store", loader.store.url, item.step, behind)
                if catch_up:  # the producer is already rebuilding the newest step: wait for that one
                    continue
            yield FollowedStep(item.step, item.tensors, behind, item.report, item.skipped)
    finally:
        stop.set()
        worker.join()
