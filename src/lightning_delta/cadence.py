"""When a chain's next step is due, from when its last ones arrived: a poller's schedule.

Every poll of a remote store is a request, and a request's headers cost about as much as a small
object (about 1.4 KB on S3 with SigV4).  A trainer commits at a steady rhythm, so a poller that
slept until shortly before the next step is due, and polled every `poll` from there, finds each
step about as soon as one polling all the time, with a few requests a step instead of one every
`poll`.  The schedule is the chain's usual gap (the median of the recent ones) from where the
recent arrivals put the next step: each recent arrival, a whole number of usual gaps on, is a
place the next step may come; a step found late (already there at the first poll) does not delay
the ones after it.  Waking at the earliest of those places finds each step as soon as it comes,
but a trainer whose steps jitter (a publish that takes 0.4 s one step and 1.2 s the next) is then
polled through the whole spread, every poll a request that finds nothing.  `late` wakes at a
quantile of those places instead: about that share of steps is found at the first poll (late, by
up to the spread), and the polls before the others shrink with it.  An older place earlier than
half a gap before where the newest exact arrival (a step found just after a poll that missed it)
puts the next step comes from before a pause (a trainer's warm-up) and is passed over; a step found
at the first poll only says it came before, so it never anchors that cut (one late find would
otherwise delay every step after it).  With two gaps only, the shorter one is the rhythm.  A
backlog found at once (gaps of zero) turns the schedule off until the rhythm is steady again.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque

__all__ = ["Cadence"]

_STEADY = 3
"""Gaps before their median is the rhythm; with two, the shorter one, from the newest arrival."""


class Cadence:
    """Arrival times of a chain's newest steps, and what they say about the next one."""

    def __init__(self, keep: int = 6) -> None:
        self._arrivals: deque[float] = deque(maxlen=keep + 1)  # `keep` gaps
        self._exact: deque[bool] = deque(maxlen=keep + 1)

    def arrived(self, at: float, exact: bool = True) -> None:
        """A new step was found at `at` (seconds, monotonic); `exact`: just after a poll that did
        not find it (it came at about `at`), not at the first poll (it came at `at` or before)."""
        self._arrivals.append(at)
        self._exact.append(exact)

    def _gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self._arrivals)]

    def wait(self, now: float, poll: float, late: float = 0.0) -> float:
        """Seconds until the next poll: `poll`, or longer while the next step is not yet due, less
        one `poll` of margin.  Each recent arrival, a usual gap (the median) apart, puts the next
        step somewhere; it is due at the earliest of those places, or with `late` (0 to 1) at that
        quantile of them, so about that share of steps is found at the first poll.  A step found
        late (it was there at the first poll) neither moves the earliest place later nor anchors
        the cut of places from before a pause, so one late find is not carried over to every step."""
        gaps = self._gaps()
        if len(gaps) < 2 or min(gaps) <= 0:
            return poll  # no rhythm yet, or a backlog found at once
        newest = self._arrivals[-1]
        if len(gaps) < _STEADY:  # the median of two is their mean: a pause (a warm-up) would be half of it
            return max(poll, newest + min(gaps) - poll - now)
        usual = statistics.median(gaps)
        n = len(self._arrivals)
        places = [at + (n - i) * usual for i, at in enumerate(self._arrivals)]  # where each puts the next step
        anchor = max((i for i, exact in enumerate(self._exact) if exact), default=None)
        if anchor is not None:  # older places half a gap before the newest exact one's: from before a pause
            places = [p for i, p in enumerate(places) if i >= anchor or p >= places[anchor] - usual / 2]
        places.sort()
        due = places[int(late * (len(places) - 1))]
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
