"""A rollout worker in a process of its own, started by tests:

    python tests/follow_job.py URL ENDPOINT OUT.safetensors

It follows the chain at URL (on the S3 endpoint ENDPOINT) until no new step comes for a few
seconds, then writes the last step it holds to OUT, with the steps it saw in the metadata.
"""

from __future__ import annotations

import json
import sys

from safetensors.torch import save_file

from lightning_delta import DeltaLoader


def main() -> None:
    url, endpoint, out = sys.argv[1:4]
    loader = DeltaLoader(url, storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    seen, tensors = [], {}
    for followed in loader.follow(poll_seconds=0.05, timeout=6.0):
        seen.append(followed.step)
        tensors = followed.tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata={"seen": json.dumps(seen)})


if __name__ == "__main__":
    main()
