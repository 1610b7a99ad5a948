"""Two gloo processes, first as the trainer's ranks, then as the workers of one rollout replica:

    python -m torch.distributed.run --nproc-per-node 2 tests/replica_job.py STORE OUT

Both ranks train identical TinyLM replicas (same seed, same data) and publish their halves of the
chain.  Then both load steps through one `DeltaLoader(process_group=...)`, each fetching about
half of the objects, and follow the chain together.  Each writes OUT/rank-R.json: what it
fetched, and whether every tensor it rebuilt equals its own trainer state bit for bit.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import jobs
from lightning_delta import DeltaLoader, DeltaPublisher, FollowSettings, PublisherSettings
from lightning_delta.shards import named_tensors
from tinylm import TinyLM


def exact(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> bool:
    return got.keys() == truth.keys() and all(
        torch.equal(got[k].view(torch.int16), truth[k].view(torch.int16)) for k in truth
    )


def main() -> None:
    store, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(1)
    truth = {}
    with DeltaPublisher(store, model, PublisherSettings(base_every=4)) as publisher:
        for step in range(1, 8):
            model(torch.randint(0, 97, (2, 9), generator=data)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            truth[step] = {k: v.detach().to(torch.bfloat16).clone() for k, v in named_tensors(model).items()}
            publisher.publish(step)
    dist.barrier()  # both halves of every step are committed

    replica = DeltaLoader(store, process_group=dist.group.WORLD)
    replica.steps()  # reads the run manifest: what follows counts parts and markers only
    report = {"exact": [], "bytes": [], "parts": []}
    for step in (3, 7):  # 3: from the base at 1; 7: from 3, through the bridge at 5
        got_step, tensors = replica.state_dict(step)
        report["exact"].append(got_step == step and exact(tensors, truth[step]))
        report["bytes"].append(replica.last_report.bytes_read)
        report["parts"].append(replica.last_report.parts_read)
    alone = DeltaLoader(store)  # one worker fetching everything, for comparison
    alone.steps()
    alone.state_dict(3)
    report["alone_bytes"] = alone.last_report.bytes_read
    following = DeltaLoader(store, process_group=dist.group.WORLD)
    report["followed"], report["followed_exact"] = [], []
    for followed in following.follow(FollowSettings(poll_seconds=0.01)):  # the newest, 7, then the end
        report["followed"].append(followed.step)
        report["followed_exact"].append(exact(followed.tensors, truth[followed.step]))
        break
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    jobs.end()
