"""When a chain's next step is due, from when its last ones arrived: a poller's schedule.

Every poll of a remote store is a request, and a request's headers cost about as much as a small
object (about 1.4 KB on S3 with SigV4).  A trainer commits at a steady rhythm, so a poller that
slept until shortly before the next step is due, and polled every `poll` from there, finds each
step about as soon as one polling all the time, with a few requests a step instead of one every
`poll`.  The schedule is the chain's usual gap (the median of the recent ones) from the earliest
place any recent arrival puts the next step: a step found late (already there at the first poll)
does not delay the ones after it; only a step that comes sooner than every recent arrival predicts
is found late (by as much as it came sooner); and a backlog found at once (gaps of zero) turns the
schedule off until the rhythm is steady again.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque

__all__ = ["Cadence"]


class Cadence:
    """Arrival times of a chain's newest steps, and what they say about the next one."""

    def __init__(self, keep: int = 3) -> None:
        self._arrivals: deque[float] = deque(maxlen=keep + 1)  # `keep` gaps

    def arrived(self, at: float) -> None:
        """A new step was found at `at` (seconds, monotonic)."""
        self._arrivals.append(at)

    def _gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self._arrivals)]

    def wait(self, now: float, poll: float) -> float:
        """Seconds until the next poll: `poll`, or longer while the next step is not yet due, less
        one `poll` of margin.  The next step is due at the earliest time any recent arrival puts
        it at, a usual gap (the median) apart: a step found late (it was there at the first poll)
        does not move the schedule later, so one late find is not carried over to every step."""
        gaps = self._gaps()
        if len(gaps) < self._arrivals.maxlen - 1 or min(gaps) <= 0:  # type: ignore[operator]  # maxlen is set
            return poll  # no rhythm yet, or a backlog found at once
        usual = statistics.median(gaps)
        n = len(self._arrivals)
        due = min(at + (n - i) * usual for i, at in enumerate(self._arrivals))
        return max(poll, due - poll - now)

    def overdue(self, now: float) -> bool:
        """Whether no step has come for twice the chain's usual gap (its median): the next step
        may be at a number the poller did not guess, and a listing would find it."""
        gaps = self._gaps()
        return bool(gaps) and now - self._arrivals[-1] > 2 * statistics.median(gaps)

    def usual_gap(self) -> float | None:
        """The median recent gap; None before two arrivals."""
        gaps = self._gaps()
        return statistics.median(gaps) if gaps else None
