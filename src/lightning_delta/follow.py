"""Following a chain while it is written: poll, decode the next verified step ahead, re-sync on damage.

A background thread polls the store, fetches the newest complete step, decodes it into a patch of
the held state and verifies it, while the caller generates on the step it holds; the caller's
`FollowedStep.apply_to(module)` then only writes the patch.  The thread decodes the next step once
the previous one is settled (written, or passed over by the caller), so it always decodes against
the state the write will meet.  A follower that fell behind jumps to the newest step (the deltas in
between are composed into one patch); a step whose chain is broken (a lost delta, a corrupt object)
is logged and skipped, so the follower re-syncs at the next step that rebuilds, at the latest the
next base.  A store that fills out of order (a replicated bucket) may list a step before every
object it needs is there: such a step is not complete yet, not damage; the follower takes the
newest step that is, and tries the other again at its next poll, until `missing_after` says an
object is lost.  Every decision is taken in that thread and, with a replica, agreed by all its
workers.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from . import format as fmt
from .errors import DeltaError, MissingObjectError, SignatureError, StoreError
from .incomplete import MissingClock
from .patch import LoadReport, StepPatch

__all__ = ["FollowSettings", "FollowedStep", "follow"]

log = logging.getLogger(__name__)


@dataclass
class FollowSettings:
    """How a follower polls and which steps it hands out (Hydra's `follow` group is this dataclass)."""

    poll_seconds: float = 1.0
    """Seconds between polls of the store while no newer step is complete."""
    prefetch: bool = True
    """Decode the next step in the background while the caller works on the current one."""
    max_staleness: int | None = None
    """Warn when a step is more than this many published steps behind once it is verified."""
    catch_up: bool = False
    """With `max_staleness`: drop such a step and take the newest one instead."""
    jump: bool = True
    """Jump to the newest complete step; False hands out every complete step in order (replay)."""
    timeout: float | None = None
    """End the iteration after this many seconds without a new step; None follows forever."""
    missing_after: float = 120.0
    """Seconds an object a listed step needs may stay missing before the step counts as damage (is
    logged and skipped); until then the step is not complete yet and tried again at each poll.
    Replicated buckets (S3 replication, rclone, gsutil rsync) copy objects in no particular order,
    so a commit marker can arrive before its blob, or a step before the step it chains to."""

    def __post_init__(self) -> None:
        if self.poll_seconds <= 0:
            raise ValueError(f"poll_seconds must be > 0, got {self.poll_seconds}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 or None, got {self.timeout}")
        if self.missing_after < 0:
            raise ValueError(f"missing_after must be >= 0, got {self.missing_after}")


class Source(Protocol):
    """What following needs of a loader (`DeltaLoader` is one)."""

    @property
    def holds_module(self) -> bool: ...

    @property
    def held_step(self) -> int | None: ...

    @property
    def device(self) -> torch.device: ...

    def steps(self, after: int | None = None) -> list[int]: ...

    def decide(self, value: int | BaseException) -> list[int]: ...

    def prepare(self, step: int, *, resync_missing: bool = True) -> StepPatch: ...

    def write(
        self, prepared: StepPatch, module: nn.Module | None = None, *, rename: Callable[[str], str | None] | None = None
    ) -> float: ...

    def tensors_of(self, prepared: StepPatch) -> dict[str, Tensor]: ...


@dataclass(frozen=True)
class FollowedStep:
    """One verified step handed to the caller; `apply_to` writes it."""

    step: int
    behind: int  # complete steps published after this one, when it was verified
    report: LoadReport
    skipped: tuple[int, ...]  # newer steps that did not rebuild since the previous one (damage)
    _source: Source = field(repr=False)
    _prepared: StepPatch = field(repr=False)
    _settled: Callable[[], None] = field(repr=False)

    @property
    def probe(self) -> tuple[float, ...] | None:
        """The trainer's probe log-probs at this step, if it published them."""
        return self.report.probe

    @property
    def tensors(self) -> dict[str, Tensor]:
        """Copies of every tensor of this step (taken on first use, before the next step)."""
        return self._source.tensors_of(self._prepared)

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
        """Write this step into `module` in place (names, shapes and dtypes are checked first), then
        run `after`; returns the seconds of the write, the only pause a follower sees.  The module
        becomes the held state: the next step is decoded against it while the caller generates."""
        try:
            seconds = self._source.write(self._prepared, module, rename=rename)
        finally:
            self._settled()
        if after is not None:
            after(module)
        return seconds


class _End:
    """Sentinel: the producer stopped (timeout, or an error to re-raise)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


_NONE, _TIMED_OUT, _STOPPED = -1, -2, -3  # decisions besides a step number
# a step that failed: not complete yet, missing too long, damaged, not the trainer's (refused by signature)
_WAIT, _LOST, _BROKEN, _FORGED = 0, 1, 2, 3


class _Turn:
    """Whose turn it is: the producer decodes only once the caller settled the step handed out
    last (and, without prefetch, asked for the next one)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._settled, self._asked, self._stopped = True, False, False
        self._handed = 0  # steps handed out so far

    def settle(self, handed: int) -> None:
        """The caller is done with the `handed`-th step; an earlier step settled late (a caller
        leaves its loop body after the next step was handed out) changes nothing."""
        with self._changed:
            if handed == self._handed:
                self._settled = True
                self._changed.notify_all()

    def ask(self) -> None:
        with self._changed:
            self._asked = True
            self._changed.notify_all()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def wait(self, prefetch: bool) -> None:
        """Wait until the producer may decode, or it stops."""
        with self._changed:
            self._changed.wait_for(lambda: self._stopped or (self._settled and (prefetch or self._asked)))

    def pause(self, seconds: float) -> None:
        """Wait `seconds` between polls, or until the caller stops."""
        with self._changed:
            self._changed.wait_for(lambda: self._stopped, seconds)

    def handed_out(self) -> int:
        with self._changed:
            self._settled, self._asked = False, False
            self._handed += 1
            return self._handed


def follow(source: Source, settings: FollowSettings) -> Iterator[FollowedStep]:
    """Yield each newer complete, verified step; see `DeltaLoader.follow`."""
    ready: queue.Queue[FollowedStep | _End] = queue.Queue()  # `turn` keeps it to one step ahead
    turn = _Turn()

    def produce() -> None:
        last = source.held_step  # newer steps than the one held
        skipped: list[int] = []
        below: int | None = None  # since the last pause, only steps older than this one are tried
        missing = MissingClock(settings.missing_after)
        forged: set[int] = set()  # refused by signature: passed over, never a reason to skip past
        idle_since, said = time.monotonic(), False
        handed_out = False

        def attempt(step: int) -> StepPatch | DeltaError | int:
            """`step` prepared; if an object it needs is not there yet, the older of `step` and the
            step that object belongs to (the oldest any worker of a replica met); the error if the step does not rebuild
            (damage) or is not the trainer's (a `SignatureError`).  A store that fails for good raises."""
            try:
                return source.prepare(step, resync_missing=False)
            except StoreError:
                raise
            except DeltaError as err:
                error = err
            verdict = _FORGED if isinstance(error, SignatureError) else _BROKEN
            if isinstance(error, MissingObjectError):
                verdict = _LOST if missing.lost(error) else _WAIT
            verdict = source.decide(verdict)[0]  # every worker of a replica failed too: rank 0's verdict
            if verdict == _WAIT:
                log.debug("step %d is not complete yet, trying again at the next poll: %s", step, error)
                # This worker's own miss: a replica's exchange raises the first failing worker's error
                # on every worker, this worker's own as its cause (a MissingObjectError's own cause, if
                # any, names the same key); none where it met no miss (the key is then another
                # worker's message) or the object is no step's (the run manifest).
                own = error.__cause__ if isinstance(error.__cause__, MissingObjectError) else error
                hole = fmt.parse_step_key(own.key) if isinstance(own, MissingObjectError) else None
                return min(source.decide(step if hole is None else min(hole, step)))
            if verdict == _FORGED and not isinstance(error, SignatureError):
                return SignatureError(f"step {step} was refused by signature on worker 0 of the replica")
            if verdict in (_BROKEN, _FORGED):
                return error
            try:  # missing for too long: damage, which a base may still rebuild the step around
                return source.prepare(step)
            except StoreError:
                raise
            except DeltaError as err:
                return err

        try:
            while True:
                turn.wait(settings.prefetch)
                if handed_out:  # the caller's time with a step is not idle time of the chain
                    idle_since, handed_out = time.monotonic(), False
                decision: int | BaseException
                try:
                    listed = [s for s in source.steps(after=last) if s not in forged]
                    if not listed and last is None and not said:  # a follower started before its trainer
                        log.warning("following: no complete step yet, polling every %s s", settings.poll_seconds)
                        said = True
                    # Jump: the newest step older than any object found missing since the last
                    # pause (the newer ones chain through it: trying each would read their blobs
                    # again, k^2/2 for k steps); replay: the next step, unless it is incomplete.
                    newer = listed if settings.jump else listed[:1]
                    newer = [s for s in newer if below is None or s < below]
                    decision = (newer[-1] if settings.jump else newer[0]) if newer else _NONE
                except MissingObjectError as err:  # steps listed before the run manifest arrived
                    decision = _NONE if not missing.lost(err) else err
                except DeltaError as err:
                    decision = err
                if decision == _NONE and settings.timeout is not None:
                    decision = _TIMED_OUT if time.monotonic() - idle_since > settings.timeout else _NONE
                decision = _STOPPED if turn.stopped else decision
                decisions = source.decide(decision)  # a replica's workers all do what rank 0 does
                if _STOPPED in decisions or decisions[0] == _TIMED_OUT:  # any worker's caller stopped
                    ready.put(_End())
                    return
                newest = decisions[0]
                if newest == _NONE:
                    below = None  # what was incomplete is tried again after the pause
                    turn.pause(settings.poll_seconds)
                    continue
                prepared = attempt(newest)
                if isinstance(prepared, int):
                    below = prepared
                    continue
                if isinstance(prepared, SignatureError):  # not the trainer's: the steps before it may still come
                    log.warning("step %d refused, passing over it: %s", newest, prepared)
                    skipped.append(newest)
                    forged.add(newest)
                    continue
                if isinstance(prepared, DeltaError):  # damage: wait for a step that rebuilds (the next base)
                    log.warning("step %d does not rebuild, waiting for a newer one: %s", newest, prepared)
                    skipped.append(newest)
                    last = newest
                    continue
                newer_count: int | BaseException
                try:
                    newer_count = len(source.steps(after=newest))
                except DeltaError as err:
                    newer_count = err
                behind = source.decide(newer_count)[0]
                last, idle_since = newest, time.monotonic()
                below = None  # the steps newer than a hole are tried again once one older is taken
                missing.restart()
                if settings.max_staleness is not None and behind > settings.max_staleness:
                    log.warning("following: step %d is %d steps behind the store", newest, behind)
                    if settings.catch_up:  # take the newest instead, decoded against the same state
                        continue
                settled = functools.partial(turn.settle, turn.handed_out())
                ready.put(FollowedStep(newest, behind, prepared.report, tuple(skipped), source, prepared, settled))
                skipped, handed_out = [], True
        except Exception as err:  # a store that fails for good: re-raised in the caller's thread
            ready.put(_End(err))

    def on_device() -> None:  # a new thread's current CUDA device is 0, whatever the caller's
        if source.device.type == "cuda":
            with torch.cuda.device(source.device):
                produce()
        else:
            produce()

    worker = threading.Thread(target=on_device, name="delta-follow", daemon=True)
    worker.start()
    try:
        while True:
            turn.ask()
            item = ready.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            if not source.holds_module:  # the loader's own copies take the step as it is handed out
                source.write(item._prepared)
                item._settled()
            yield item
            item._settled()  # passed over without `apply_to`: the held state stays where it was
    finally:
        turn.stop()
        worker.join()
