"""A real vLLM engine following a chain through the lightning_delta backend, beside vLLM's own
dense reload of the same weights, in one run (the vLLM venv scripts/setup.sh makes):

    .venv-vllm/bin/python scripts/bench_vllm.py                 # a ~100M-parameter bf16 Llama
    .venv-vllm/bin/python scripts/bench_vllm.py --layers 1 --vocab 4096 --hidden 256   # a quick check
    .venv-vllm/bin/python scripts/bench_vllm.py --keep runs/bench-vllm   # the chain built once, then reused

Two trainer ranks publish a chain: a base at step 1, then steps 2-11 changing 2% and 0.5% of the
elements in turn (by one ULP, small weights more often than large ones, as under Adam), once coded
without context (what a CPU trainer ships) and once with the exponent context (a GPU trainer's
default).  Each engine runs in a process of its own:

* tp1-inplace, tp2-inplace: oneDNN prepacking off (LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS=1), so the
  parameters keep the checkpoint layout, as a bf16 engine's on a GPU do: written in place;
* tp2-inplace-exponent: the same TP=2 engine following the exponent-context chain (each worker
  holds a slice of a tensor whose positions are coded given all of its exponents);
* tp1-layerwise: prepacking on: the linear weights go through vLLM's layerwise reload.

Each follows steps 1-11 without prefetching, so `update_weights` fetches, decodes, verifies and
writes.  Reported per engine: the time of `update_weights` for each step (and of its write), the
bytes each worker read, the 0.5% steps over the 2% steps, the follower's peak memory beyond the
engine in each worker during the base step and during the delta steps (VmHWM, reset before each,
less VmRSS then), and
vLLM's dense reload of the last step's checkpoint (`reload_weights`, from a warm page cache), with
the base step (what a replica joining costs) over it.  The
engine's weights are checked against the trainer's checksums after the chain and after the reload.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from lightning_delta import format as fmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = {1: 0.02} | {step: 0.02 if step % 2 == 0 else 0.005 for step in range(2, 12)}
"""A base at step 1, then 2% and 0.5% changed in turn, so that a host whose load drifts during the
run weighs on both sizes alike (with all of one size first, two runs of the same code gave TP=1's
0.5%/2% as 0.35 and 0.48, on 2026-12-06)."""
LAST = max(STEPS)
ENGINES = {  # name: (tensor-parallel size, prepacking off, chain)
    "tp1-inplace": (1, True, "plain"),
    "tp1-layerwise": (1, False, "plain"),
    "tp2-inplace": (2, True, "plain"),
    "tp2-inplace-exponent": (2, True, "exponent"),
}


def build(work: str, args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 192),
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(f"{work}/model")
    torch.multiprocessing.spawn(publish, args=(work,), nprocs=2)


def publish(rank: int, work: str) -> None:
    """One of the trainer's two ranks, publishing both chains of the same steps."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from lightning_delta import DeltaPublisher, PublisherSettings
    from lightning_delta.codec import CodecOptions, Context

    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=2)
    state = load_file(f"{work}/model/model.safetensors")
    settings = {
        chain: PublisherSettings(base_every=100, codec=CodecOptions(context=context))
        for chain, context in (("plain", Context.NONE), ("exponent", Context.EXPONENT))
    }
    publishers = {chain: DeltaPublisher(f"{work}/{chain}", lambda: state, s) for chain, s in settings.items()}
    for step, fraction in STEPS.items():
        if step > 1:
            g = torch.Generator().manual_seed(step)
            for name in sorted(state):
                bits = state[name].view(torch.int16).view(-1)
                magnitude = state[name].view(-1).float().abs()
                odds = 1 / (magnitude + 0.1 * magnitude.mean() + 1e-12)  # as under Adam: small weights move more often
                moved = torch.rand(bits.numel(), generator=g) < (fraction * odds / odds.mean()).clamp(max=1)
                sign = torch.where(torch.rand(bits.numel(), generator=g) < 0.5, 1, -1).to(torch.int16)
                bits[moved] += sign[moved]
        for publisher in publishers.values():
            publisher.publish(step)
    for publisher in publishers.values():
        publisher.close()
    if rank == 0:
        shutil.copytree(f"{work}/model", f"{work}/last")
        save_file({k: v.contiguous() for k, v in state.items()}, f"{work}/last/model.safetensors")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past Python's finalization, which gloo's worker threads can abort (tests/jobs.py)


# ---------------------------------------------------------------- inside an engine's workers


def _mark(worker: Any) -> int:
    """Hand the heap's free memory back to the system (what earlier steps freed would otherwise
    hide the next ones' peaks), reset this process's peak resident memory, and return its
    resident memory now, in bytes."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _peak(worker: Any) -> int:
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _report(worker: Any) -> dict[str, Any]:
    engine = worker.weight_transfer_engine
    return {
        "bytes": engine.last_report.bytes_read,
        "changed": engine.last_report.changed,
        "write": engine.last_write_seconds,
    }


def _paths(worker: Any) -> Any:
    return worker.weight_transfer_engine.follower.paths()


def _verify(worker: Any) -> bool:
    from lightning_delta import DeltaError

    try:
        worker.weight_transfer_engine.follower.verify()
    except DeltaError:
        return False
    return True


def engine(work: str, name: str) -> dict[str, Any]:
    """Follow the chain in one engine and time vLLM's dense reload beside it."""
    from vllm import LLM

    tp, _, chain = ENGINES[name]
    extra = {"tensor_parallel_size": tp} if tp > 1 else {"distributed_executor_backend": "uni"}
    llm = LLM(
        model=f"{work}/model",
        weight_transfer_config={"backend": "lightning_delta"},
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=128,
        enforce_eager=True,
        **extra,
    )
    llm.init_weight_transfer_engine({"init_info": {"url": f"{work}/{chain}", "prefetch": False}})
    result: dict[str, Any] = {"paths": llm.collective_rpc(_paths)[0], "steps": {}}
    for step in STEPS:
        if step == 1:  # the base step: what the follower holds beyond the engine while it joins
            rss = llm.collective_rpc(_mark)
        if step == 2:  # the delta steps: what the follower holds beyond the engine from here on
            result["beyond_base"] = [peak - before for peak, before in zip(llm.collective_rpc(_peak), rss, strict=True)]
            rss = llm.collective_rpc(_mark)
        llm.start_weight_update()
        started = time.perf_counter()
        llm.update_weights({"update_info": {"step": step}})
        seconds = time.perf_counter() - started
        llm.finish_weight_update()
        result["steps"][step] = {"seconds": seconds, "workers": llm.collective_rpc(_report)}
    result["beyond"] = [peak - before for peak, before in zip(llm.collective_rpc(_peak), rss, strict=True)]
    result["exact"] = all(llm.collective_rpc(_verify))
    dense = []
    for _ in range(3):
        started = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": f"{work}/last"})
        dense.append(time.perf_counter() - started)
    result["dense"] = statistics.median(dense)
    result["dense_exact"] = all(llm.collective_rpc(_verify))
    return result


# ---------------------------------------------------------------- the driver


def run_engine(work: str, name: str) -> dict[str, Any]:
    tp, plain, _ = ENGINES[name]
    env = {
        **os.environ,
        # this machine's AMX quirk (docs/ROLLOUT), before the caller's path (`PYTHONPATH=<old src>` benches old code)
        "PYTHONPATH": os.pathsep.join(
            filter(None, [os.path.join(ROOT, "tests", "vllm_env"), os.environ.get("PYTHONPATH")])
        ),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the workers' figures come back through callables
        "LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS": "1" if plain else "0",
    }
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    out = os.path.join(work, f"{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--engine", name, "--work", work]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


def summary(name: str, result: dict[str, Any], model_bytes: int) -> list[str]:
    steps = {int(s): row for s, row in result["steps"].items()}
    at = {f: statistics.median(steps[s]["seconds"] for s in STEPS if STEPS[s] == f and s > 1) for f in (0.02, 0.005)}
    (inplace, inplace_bytes), (reloaded, reloaded_bytes) = result["paths"]
    lines = [
        f"{name}: {inplace} tensors ({inplace_bytes / 1e6:.0f} MB) in place, "
        f"{reloaded} ({reloaded_bytes / 1e6:.0f} MB) through the layerwise reload; "
        f"exact after the chain: {result['exact']}, after the dense reload: {result['dense_exact']}"
    ]
    for step, row in sorted(steps.items()):
        workers = row["workers"]
        lines.append(
            f"  step {step} ({'base' if step == 1 else f'{STEPS[step]:.1%}'}): update_weights "
            f"{row['seconds'] * 1e3:7.1f} ms, writing {max(w['write'] for w in workers) * 1e3:6.1f} ms, "
            f"read {' + '.join(format(w['bytes'] / 1e6, '.2f') for w in workers)} MB, "
            f"{workers[0]['changed']} elements written"
        )
    base = steps[min(STEPS)]
    lines.append(
        f"  base step (a replica joining): update_weights {base['seconds'] * 1e3:.1f} ms beside vLLM's dense reload "
        f"{result['dense'] * 1e3:.1f} ms: {base['seconds'] / result['dense']:.2f}x (target: at most 2x)"
    )
    beyond = max(result["beyond"])
    lines.append(
        f"  median 2%: {at[0.02] * 1e3:.1f} ms, 0.5%: {at[0.005] * 1e3:.1f} ms (0.5%/2% = {at[0.005] / at[0.02]:.2f}); "
        f"vLLM dense reload: {result['dense'] * 1e3:.1f} ms (2%/dense = {at[0.02] / result['dense']:.3f})"
    )
    lines.append(
        f"  follower memory beyond the engine during delta steps, per worker: "
        f"{', '.join(f'{b / 1e6:.1f} MB' for b in result['beyond'])} ({beyond / model_bytes:.3f}x the model)"
    )
    base_beyond = max(result["beyond_base"])
    lines.append(
        f"  follower memory beyond the engine during the base step, per worker: "
        f"{', '.join(f'{b / 1e6:.1f} MB' for b in result['beyond_base'])} ({base_beyond / model_bytes:.3f}x the model)"
    )
    return lines


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--only", nargs="*", choices=sorted(ENGINES), default=list(ENGINES))
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="build the model and chains in DIR if it holds none, and reuse them (before/after runs on one chain)",
    )
    parser.add_argument("--engine", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:  # one engine, in the process the driver started
        result = engine(args.work, args.engine)
        with open(os.path.join(args.work, f"{args.engine}.json"), "w") as f:
            json.dump(result, f)
        return
    with contextlib.ExitStack() as stack:
        work = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        if not os.path.exists(f"{work}/last/model.safetensors"):  # the build's last output
            os.makedirs(work, exist_ok=True)
            build(work, args)
        model_bytes = os.path.getsize(f"{work}/model/model.safetensors")
        print(
            f"model: {model_bytes / 1e6:.0f} MB of bf16; torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        for chain in ("plain", "exponent"):
            sizes = {step: folder_bytes(f"{work}/{chain}/{fmt.step_dir(step)}") for step in STEPS}
            print(f"chain {chain}: " + ", ".join(f"step {s} {b / 1e6:.2f} MB" for s, b in sizes.items()))
        for name in args.only:
            for line in summary(name, run_engine(work, name), model_bytes):
                print(line, flush=True)


if __name__ == "__main__":
    main()
