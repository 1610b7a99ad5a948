"""An engine follower's prefetcher: one background thread at a time that prepares the next step
(fetched, decoded, verified) while the engine serves, so that an update only writes it.

The thread may be in one of the group's collectives at any moment, so the follower stops it (and
waits for it) before every other use of the group; one that does not stop in time raises
`PrefetchTimeoutError`, and the next stop waits for it again.  On a GPU it runs on a side stream,
after the writes queued so far on the caller's: its waits are not for the engine's work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from .errors import DeltaError

__all__ = ["PrefetchTimeoutError", "Prefetcher"]

T = TypeVar("T")


class PrefetchTimeoutError(DeltaError, TimeoutError):
    """The background prefetcher did not stop in time: the follower waits for it before it uses
    the group again."""


class Prefetcher(Generic[T]):
    """Runs `work(stop)` on a thread (`start`) and keeps what it made (a `T`, or the error it
    raised) for `stop`, which hands it on through `take`.

    Args:
        device: where the work reads the engine's weights (a CUDA device: on a side stream).
        url: the chain's, for messages.
    """

    def __init__(self, device: torch.device, url: str) -> None:
        self.device, self.url = device, url
        self._running: tuple[threading.Thread, threading.Event, list[T | Exception]] | None = None
        self._ready: T | None = None  # what a stopped prefetcher made

    def start(self, work: Callable[[threading.Event], T | None], stop_seconds: float) -> None:
        """Stop any prefetcher (`stop`), then run `work` in the background until it returns (what
        it made, or None) or raises; `work` returns soon once its event is set."""
        self.stop(stop_seconds)
        stop, result = threading.Event(), list[T | Exception]()

        def run() -> None:
            try:
                made = work(stop)
                if made is not None:
                    result.append(made)
            except Exception as err:  # kept, for the caller to prepare again and raise it there
                result.append(err)

        written = None  # the writes queued so far on the caller's stream: the prefetcher reads after them
        if self.device.type == "cuda":
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))

        def on_device() -> None:  # a new thread's current CUDA device is 0, whatever the engine's
            if written is not None:  # on a side stream: its waits are not for the engine's work
                side = torch.cuda.Stream(self.device)
                side.wait_event(written)
                with torch.cuda.device(self.device), torch.cuda.stream(side):
                    run()
            else:
                run()

        thread = threading.Thread(target=on_device, name="delta-engine-prefetch", daemon=True)
        thread.start()
        self._running = (thread, stop, result)

    @property
    def running(self) -> bool:
        """Whether a prefetcher runs (it may read the engine's weights at any moment)."""
        return self._running is not None and self._running[0].is_alive()

    def made(self) -> T | Exception | None:
        """What the running prefetcher made so far, without stopping it: None if nothing yet."""
        if self._running is None or not self._running[2]:
            return None
        return self._running[2][0]

    def join(self, seconds: float) -> bool:
        """Wait up to `seconds` for the running prefetcher to finish on its own; whether it did."""
        if self._running is None:
            return True
        self._running[0].join(seconds)
        return not self._running[0].is_alive()

    def stop(self, seconds: float) -> None:
        """Stop the prefetcher, keeping what it made for `take`: every use of the group outside the
        prefetcher comes after this, never while it may still be in a collective.  Waits `seconds`
        for it (it may be fetching a step, or waiting in a collective for a worker that is gone),
        then raises `PrefetchTimeoutError` (the next call waits for it again)."""
        if self._running is None:
            return
        thread, stop, result = self._running
        stop.set()
        thread.join(seconds)
        if thread.is_alive():
            raise PrefetchTimeoutError(
                f"{self.url}: the prefetcher did not stop within {seconds:g} s (a store that does not "
                "answer, or a worker of the group that is gone); nothing was written, and the next call waits for "
                "it again"
            )
        self._running = None
        if result and not isinstance(result[0], Exception):
            self._ready = result[0]

    def take(self) -> T | None:
        """What the last stopped prefetcher made (once), or None."""
        ready, self._ready = self._ready, None
        return ready
