"""Follow a delta chain, swap each verified step into a tiny Llama, generate from it.

    python scripts/generate.py                               # replay the chain scripts/train.py wrote
    python scripts/generate.py follow.jump=true follow.timeout=null   # follow a live run, newest step first
    python scripts/generate.py store.url=/tmp/chain loader.device=cuda
    .venv-vllm/bin/python scripts/generate.py --engine vllm  # a vLLM engine, through its weight-transfer API

With the Hugging Face model (the default), each step is fetched and verified in the background while
the model generates on the previous one, and only its changes are written into the model.  With
`--engine vllm` (or `engine=vllm`), a vLLM engine started from the model's config follows the same
chain through the `lightning_delta` weight-transfer backend.  Either way the model never sees a step
that did not rebuild bit-exactly.  Per step it prints how far behind the store it is, what it
fetched, how long rebuilding and the swap took, how far its log-probs of the trainer's probe batch
are from the trainer's (0: same numbers; vLLM's kernels are not the trainer's, so not 0 there), and
their mean, which moves with the weights every step (at RL learning rates the greedy tokens rarely do).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, os.path.dirname(__file__))
from lightning_delta import DeltaLoader
from lightning_delta.config import Engine, GenerateConfig, register_configs
from tinylm import probe_batch, probe_logprobs, tiny_llama

register_configs()
COLUMNS = f"{'step':>5} {'kind':>5} {'behind':>6} {'fetched':>10} {'rebuild':>9} {'swap':>8}"
COLUMNS += f" {'probe err':>9} {'probe logp':>10}"


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, context: int) -> list[int]:
    tokens = prompt
    for _ in range(new_tokens):
        logits = model(tokens[:, -context:]).logits
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, prompt.shape[1] :].tolist()


@hydra.main(version_base="1.3", config_path="pkg://lightning_delta.conf", config_name="generate")
def main(raw: DictConfig) -> None:
    cfg: GenerateConfig = OmegaConf.to_object(raw)
    loader = DeltaLoader(cfg.store.url, cfg.loader, storage_options=cfg.store.storage_options)
    if not loader.steps():
        raise SystemExit(f"no complete step in {cfg.store.url}: run scripts/train.py first")
    print(f"{COLUMNS}  generated")
    applied = with_vllm(cfg, loader) if cfg.engine == Engine.vllm else with_hf(cfg, loader)
    print(f"applied {applied} steps; every tensor of each rebuilt bit-exactly (checksums and chain links verified)")


def with_hf(cfg: GenerateConfig, loader: DeltaLoader) -> int:
    device = cfg.loader.device
    model = tiny_llama(**vars(cfg.model)).to(device=device, dtype=torch.bfloat16).eval()
    prompt = torch.arange(4, device=device).unsqueeze(0)
    probe = probe_batch(cfg.model, cfg.probe_seed).to(device)
    applied = 0
    for followed in loader.follow(cfg.follow):
        swap = followed.apply_to(model)  # the first step writes every weight; later ones their changes
        r = followed.report
        logprobs = probe_logprobs(model, probe)
        error = f"{followed.probe_error(logprobs):9.2g}" if followed.probe else f"{'-':>9}"
        tokens = greedy(model, prompt, cfg.new_tokens, cfg.model.context)
        # The probe's mean log-prob moves every step: the weights change although greedy tokens rarely do.
        print(
            f"{r.step:5d} {r.kind.value:>5} {followed.behind:6d} {r.bytes_read / 1024:8.1f}KiB "
            f"{r.seconds * 1e3:7.1f}ms {swap * 1e3:6.2f}ms {error} {float(logprobs.mean()):10.6f}  {tokens}"
        )
        applied += 1
    return applied


def with_vllm(cfg: GenerateConfig, loader: DeltaLoader) -> int:
    """The same chain into a vLLM engine: every complete step in order (or the newest, with
    follow.jump), ending `follow.timeout` seconds after the last one, as the HF path does."""
    from vllm import LLM, SamplingParams

    folder = tempfile.mkdtemp(prefix="generate-model-")
    # The config (the chain brings the weights), with room for a probe row and the token generated after
    # it: RoPE positions, so no tensor changes shape.
    tiny_llama(**{**vars(cfg.model), "context": cfg.model.context + 1}).to(torch.bfloat16).save_pretrained(folder)
    llm = LLM(
        model=folder,
        weight_transfer_config={"backend": "lightning_delta"},
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=cfg.model.context + 1,  # a probe row fills the context, and one token is generated
        enforce_eager=True,
    )
    init = {"url": cfg.store.url, "storage_options": cfg.store.storage_options, "prefetch": cfg.follow.prefetch}
    llm.init_weight_transfer_engine({"init_info": {**init, "poll_seconds": cfg.follow.poll_seconds}})
    probe = probe_batch(cfg.model, cfg.probe_seed)
    probing = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    generating = SamplingParams(max_tokens=cfg.new_tokens, temperature=0.0)
    last, applied, idle_since = None, 0, time.monotonic()
    while True:
        newer = loader.steps(after=last)
        if not newer:
            if cfg.follow.timeout is not None and time.monotonic() - idle_since > cfg.follow.timeout:
                return applied
            time.sleep(cfg.follow.poll_seconds)
            continue
        for step in newer[-1:] if cfg.follow.jump else newer:
            started = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"step": step}})
            llm.finish_weight_update(weight_version=str(step))
            swap = time.perf_counter() - started
            llm.reset_prefix_cache()  # the cached prefixes were computed with the previous weights
            rows = llm.generate([{"prompt_token_ids": row.tolist()} for row in probe], probing, use_tqdm=False)
            logprobs = torch.tensor(
                [
                    [d[int(t)].logprob for d, t in zip(r.prompt_logprobs[1:], row[1:], strict=True)]
                    for r, row in zip(rows, probe, strict=True)
                ]
            )
            published = loader.store.read_part(step, 0, loader.store.run().world_size).probe
            error = (
                f"{float((logprobs.flatten() - torch.tensor(published)).abs().max()):9.2g}"
                if published
                else f"{'-':>9}"
            )
            tokens = (
                llm.generate([{"prompt_token_ids": [0, 1, 2, 3]}], generating, use_tqdm=False)[0].outputs[0].token_ids
            )
            behind = len(loader.steps(after=step))
            row = f"{step:5d} {'-':>5} {behind:6d} {'-':>10} {'-':>9} {swap * 1e3:6.2f}ms {error}"
            print(f"{row} {float(logprobs.mean()):10.6f}  {list(tokens)}")
            last, applied, idle_since = step, applied + 1, time.monotonic()


if __name__ == "__main__":
    if "--engine" in sys.argv:  # `--engine vllm` reads as the Hydra override `engine=vllm`
        at = sys.argv.index("--engine")
        sys.argv[at : at + 2] = [f"engine={sys.argv[at + 1]}"]
    main()
