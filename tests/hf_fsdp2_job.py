"""Two gloo processes drive `DeltaTrainerCallback` around an FSDP2-sharded tiny Llama, with a probe:

    python -m torch.distributed.run --nproc-per-node 2 tests/hf_fsdp2_job.py STORE TRUTH

transformers' Trainer runs FSDP only on GPUs (accelerate keeps MULTI_CPU runs unsharded), so this job
calls the callback's hooks itself, as the Trainer does after each optimizer step.  The probe's
no-grad forward leaves FSDP2's root module unsharded, which is what the callback must read
through.  Rank 0 saves the full bf16 weights and the probe after every step to TRUTH.
"""

from __future__ import annotations

import os
import sys
import types

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import jobs
from lightning_delta import PublisherSettings
from lightning_delta.hf import DeltaTrainerCallback
from lightning_delta.shards import named_tensors
from tinylm import tiny_llama

PROBE = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))


def probe(model: torch.nn.Module) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=PROBE).logits.float(), dim=-1)


def main() -> None:
    store, truth = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = tiny_llama()
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = types.SimpleNamespace(global_step=0, is_world_process_zero=rank == 0, log_history=[])
    callback = DeltaTrainerCallback(store, PublisherSettings(base_every=3), probe=probe)
    callback.on_train_begin(None, state, None, model=model)
    data = torch.Generator().manual_seed(2)
    for step in range(1, 5):
        tokens = torch.randint(0, 97, (2, 16), generator=data)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        state.global_step = step
        callback.on_step_end(None, state, None, model=model)  # runs the probe, then publishes
        full = {}
        for name, t in named_tensors(model).items():
            t = t.full_tensor() if isinstance(t, DTensor) else t  # a collective on every rank
            full[name] = t.detach().to(torch.bfloat16).contiguous()
        expected = probe(model)
        if rank == 0:
            os.makedirs(truth, exist_ok=True)
            save_file(full, os.path.join(truth, f"step-{step}.safetensors"))
            torch.save(expected, os.path.join(truth, f"probe-{step}.pt"))
    callback.on_train_end(None, state, None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    jobs.end()
