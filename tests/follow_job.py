"""A rollout worker in a process of its own, started by tests:

    python tests/follow_job.py URL ENDPOINT OUT.safetensors LAST

It follows the chain at URL (on the S3 endpoint ENDPOINT) until it has handed out step LAST,
appending each step it hands out to OUT.progress as it goes (a test waits on that file, not on
a clock), then writes the last step it holds to OUT, with the steps it saw in the metadata.
"""

from __future__ import annotations

import json
import sys

from safetensors.torch import save_file

import jobs
from lightning_delta import DeltaLoader, FollowSettings


def main() -> None:
    url, endpoint, out, last = sys.argv[1:5]
    loader = DeltaLoader(url, storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    seen, tensors = [], {}
    with open(f"{out}.progress", "a") as progress:
        for followed in loader.follow(FollowSettings(poll_seconds=0.05, timeout=300.0)):  # ends only a lost test
            seen.append(followed.step)
            tensors = followed.tensors
            progress.write(f"{followed.step}\n")
            progress.flush()
            if followed.step >= int(last):
                break
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata={"seen": json.dumps(seen)})


if __name__ == "__main__":
    main()
    jobs.end()
