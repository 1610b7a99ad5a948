"""A mirror in a process of its own, for tests that kill it:

    python tests/mirror_job.py SRC DST KILL_AT LOG

It mirrors SRC to DST once, and SIGKILLs itself just before its KILL_AT-th write to DST (0: never),
while other copies may be in flight.  Each write DST refuses because the object is there already
(an object written twice) is appended to LOG.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from lightning_delta import Mirror, MirrorSettings, Store
from lightning_delta.objects import FsspecObjects


class Killing(FsspecObjects):
    """The destination, killing the process at its `kill_at`-th write and logging refused ones."""

    def __init__(self, url: str, kill_at: int, log: str) -> None:
        super().__init__(url)
        self.kill_at, self.log, self.writes, self.lock = kill_at, log, 0, threading.Lock()

    def create(self, key: str, data: bytes) -> bool:
        with self.lock:
            self.writes += 1
            if self.writes == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        created = super().create(key, data)
        if not created:
            with open(self.log, "a") as out:
                out.write(f"{key}\n")
        return created


def main() -> None:
    src, dst, kill_at, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with Mirror(src, Store(Killing(dst, kill_at, log)), MirrorSettings(threads=4)) as mirror:
        mirror.sync()
    print("done")


if __name__ == "__main__":
    main()
