"""When a chain's next step is due, from when its last ones arrived: a poller's schedule.

Every poll of a remote store is a request, and a request's headers cost about as much as a small
object (about 1.4 KB on S3 with SigV4).  A trainer commits at a steady rhythm, so a poller that
slept until shortly before the next step is due, and polled every `poll` from there, finds each
step about as soon as one polling all the time, with a few requests a step instead of one every
`poll`.  The schedule is the chain's usual gap (the median of the recent ones) from where the recent
arrivals put the next step: each recent arrival, a whole number of usual gaps on, is a place the
next step may come; a step found late (already there at the first poll) does not delay the ones
after it.  Waking at the earliest of those places finds each step as soon as it comes, but a trainer
whose steps jitter (a publish that takes 0.4 s one step and 1.2 s the next) is then polled through
the whole spread, every poll a request that finds nothing.  `late` wakes at a quantile of those
places instead: about that share of steps is found at the first poll (late, by up to the spread),
and the polls before the others shrink with it.  An older place earlier than half a gap before where
the newest exact arrival (a step found just after a poll that missed it) puts the next step comes
from before a pause (a trainer's warm-up) and is passed over; a step found at the first poll only
says it came before, so it never anchors that cut (one late find would otherwise delay every step
after it).  With two gaps only, the shorter one is the rhythm.  A step more than a whole gap overdue
is a trainer's pause: from there the polls thin out as without a rhythm (below), each a sixteenth
of the time beyond that gap apart, not one every `poll` until the trainer resumes.  A backlog found
at once (gaps of zero) turns the schedule off until the rhythm is steady again.  Without a rhythm
the polls thin out as the wait goes on, each a sixteenth of the time since the newest arrival apart
(before any, since the first wait): a trainer's first steps come after a warm-up of unknown length,
and a poll every `poll` through all of it is a request each (a listing, for a mirror that holds no
step yet), for a step then found at most a sixteenth of that wait late.

A step found at the first poll came before it, by an unknown amount: a gap that ends (or starts)
at one is the poller's own schedule, not the trainer's, and a rhythm learned from such gaps holds
itself (a trainer's 2 s steps, found at the first poll 2.8 s apart after one long gap, stay 2.8 s
apart, each found later than the one before).  So only gaps between exact arrivals (each found
within `exact`'s bound of a miss) make the rhythm, and two steps in a row found at the first
poll (the rhythm learned is off: a trainer's jitter, or a new pace) turn it off and forget the
arrivals before them; without it the polls thin out as above (to `idle_most` apart at most), which
finds steps exactly again.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque

__all__ = ["Cadence"]

_STEADY = 3
"""Gaps before their median is the rhythm; with two, the shorter one, from the newest arrival."""
_IDLE = 1 / 16
"""Without a rhythm, the share of the time since the newest arrival a poller waits between polls."""


class Cadence:
    """Arrival times of a chain's newest steps, and what they say about the next one."""

    def __init__(self, keep: int = 6, late: float = 0.0, idle_most: float = float("inf")) -> None:
        """`late` (0 to 1): the share of steps to find at the first poll (`wait`); `idle_most`: the
        longest wait without a rhythm (the thinned polls), so that a step after a long pause, and
        what a poller does at each poll besides (a mirror relays the trainer's heartbeat), is at
        most that late."""
        self._arrivals: deque[float] = deque(maxlen=keep + 1)  # `keep` gaps
        self._exact: deque[bool] = deque(maxlen=keep + 1)
        self._late, self._idle_most = late, idle_most
        self._began: float | None = None  # the first wait: a warm-up before any step thins from there

    def arrived(self, at: float, exact: bool = True) -> None:
        """A new step was found at `at` (seconds, monotonic); `exact`: just after a poll that did
        not find it (it came at about `at`), not at the first poll (it came at `at` or before).
        Two found at the first poll in a row say the rhythm learned is off (a trainer that sped
        up, or a backlog): the arrivals before are forgotten, so that the next exact find does not
        bring the old rhythm back."""
        if not exact and self._exact and not self._exact[-1]:
            newest = self._arrivals[-1]
            self._arrivals.clear()
            self._exact.clear()
            self._arrivals.append(newest)
            self._exact.append(False)
        self._arrivals.append(at)
        self._exact.append(exact)

    def exact(self, now: float, missed_at: float | None, poll: float) -> bool:
        """Whether a step found by a pass begun at `now` came at about `now`: its miss's answer
        (`missed_at`) was just before, within two polls or an eighth of the time since the newest
        arrival (twice a thinned poll's wait; with a rhythm, about an eighth of a gap), not across a
        poller held up after its miss."""
        if missed_at is None:
            return False
        return now - missed_at <= max(2 * poll, min(self._since(now) / 8, 2 * self._idle_most))

    def _since(self, now: float) -> float:
        """Seconds since the newest arrival; before any, since the first wait (none yet: 0)."""
        if self._arrivals:
            return now - self._arrivals[-1]
        return 0.0 if self._began is None else now - self._began

    def _gaps(self, exact: bool = False) -> list[float]:
        """The gaps between arrivals; `exact`: between exact ones only (the rhythm's), since one
        with a step found at the first poll at either end is the poller's own schedule, not the
        trainer's (and a listing's)."""
        timed = zip(self._arrivals, self._exact, strict=True)
        return [b - a for (a, exact_a), (b, exact_b) in itertools.pairwise(timed) if not exact or (exact_a and exact_b)]

    def wait(self, now: float, poll: float) -> float:
        """Seconds until the next poll: `poll`, or longer while the next step is not yet due, less
        one `poll` of margin (without a rhythm, a sixteenth of the time since the newest arrival, or
        before any since the first wait; beyond a whole gap overdue, a sixteenth of the time beyond it).
        Each recent arrival, a usual gap (the median of the exact ones) apart, puts the next step
        somewhere; it is due at the earliest of those places, or with `late` at that quantile.  A
        step found late (it was there at the first poll) neither moves the earliest place later nor
        anchors the cut of places from before a pause, so one late find is not carried over to
        every step."""
        if self._began is None:
            self._began = now
        gaps = self._gaps(exact=True)
        if not self.steady():
            return max(poll, min(self._since(now) * _IDLE, self._idle_most))
        newest = self._arrivals[-1]
        if len(gaps) < _STEADY:  # the median of two is their mean: a pause (a warm-up) would be half of it
            usual = min(gaps)
            due = newest + usual
        else:
            usual = statistics.median(gaps)
            n = len(self._arrivals)
            places = [at + (n - i) * usual for i, at in enumerate(self._arrivals)]  # where each puts the next step
            anchor = max((i for i, exact in enumerate(self._exact) if exact), default=None)
            if anchor is not None:  # older places half a gap before the newest exact one's: from before a pause
                places = [p for i, p in enumerate(places) if i >= anchor or p >= places[anchor] - usual / 2]
            places.sort()
            due = places[int(self._late * (len(places) - 1))]
        paused = now - max(due, newest) - usual  # a whole gap overdue, none since: a pause, polls thin out
        return max(poll, due - poll - now, min(paused * _IDLE, self._idle_most))

    def steady(self) -> bool:
        """Whether the recent steps keep a rhythm `wait` sleeps by: two exact gaps or more, no backlog
        found at once among them, and not the two newest steps found at the first poll.  Without
        one, polls thin out (a step found then is late by up to a sixteenth of the wait anyway)."""
        gaps = self._gaps(exact=True)
        return len(gaps) >= 2 and min(gaps) > 0 and any(list(self._exact)[-2:])

    def near(self, now: float) -> bool:
        """Whether the next step may come about now: a rhythm is kept, or, without one, half the
        usual gap has passed since the newest arrival (none known: a warm-up of unknown length, not
        near).  A thinned poll before that is most likely a miss."""
        usual = self.usual_gap()
        return self.steady() or (usual is not None and now - self._arrivals[-1] >= usual / 2)

    def overdue(self, now: float) -> bool:
        """Whether no step has come for twice the chain's usual gap (its median): the next step
        may be at a number the poller did not guess, and a listing would find it."""
        usual = self.usual_gap()
        return usual is not None and now - self._arrivals[-1] > 2 * usual

    def usual_gap(self) -> float | None:
        """The median recent gap between steps found apart (a backlog's steps, found in one pass,
        are no gap: with one, every later moment would be overdue); None before two such."""
        gaps = [g for g in self._gaps() if g > 0]
        return statistics.median(gaps) if gaps else None
