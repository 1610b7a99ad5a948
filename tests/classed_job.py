"""Two tensor-parallel workers of the stand-in engine (tests/fused.py) following a chain of CLASSED
deltas (the exponent context), whose decode asks the group for the exponents of the held state,
while worker 1 fails alone:

    python -m torch.distributed.run --nproc-per-node 2 tests/classed_job.py STORE OUT

* decode: worker 1's decodes of step 2 run out of memory from its second payload on, before it asks
  the group for that payload's exponents, while worker 0 asks (and again from the base);
* fill: worker 1 fails filling in the exponents it holds (from its first payload of step 2 on);
* write: step 2 verified on both, then worker 1 runs out of memory writing its first payload while
  worker 0 writes on and asks the group for the next payload's exponents; both then re-sync step 3;
* then: both follow step 4.

Each worker writes OUT/rank-R.json: per case, the error it raised, whether its weights were left
untouched (decode, fill) or equal its slices of the trainer's step (after the re-sync), and the step
it holds.  A worker that waits in a collective no other worker reaches hangs the run, which the
test's timeout fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import jobs
from fused import Engine
from lightning_delta import Store, codec, decoder
from lightning_delta.codec import Context, Mode
from lightning_delta.engine import EngineFollower
from lightning_delta.torch_path import TorchPath
from lightning_delta.viewmap import ViewMap
from test_engine import publish


def failing_on(rank: int, call: int, original: Callable, error: Exception, calls: list[int]) -> Callable:
    """`original`, raising `error` from its `call`-th call on worker `rank` (counted in `calls`):
    the step fails again when it is tried from its base."""
    me = dist.get_rank()

    def wrapped(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if me == rank and calls[0] >= call:
            raise error
        return original(*args, **kwargs)

    return wrapped


def main() -> None:
    store_url, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    truth = publish(store_url, Context.EXPONENT)  # as the trainer's two ranks, each its half
    dist.barrier()
    store = Store(store_url)
    engine = Engine(rank, 2)
    specs = {t.name: (t.shape, torch.bfloat16) for t in store.run().manifest.tensors}
    view_map = ViewMap.learn(specs, engine.load_weights, dict(engine.named_parameters()))

    def reload(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            engine.load_weights(name, tensor)

    follower = EngineFollower(store, view_map, lambda: dict(engine.named_parameters()), reload, group=dist.group.WORLD)
    follower.update(1)
    parts = [store.read_part(2, r, 2) for r in range(2)]
    report: dict = {"modes": sorted({codec.mode_of(p).name for part in parts for p in part.payloads})}
    report["payloads"] = sum(len(part.payloads) for part in parts)

    def exact(step: int) -> bool:
        state = engine.state()
        return all(
            torch.equal(state[k].view(torch.int16), v.view(torch.int16))
            for k, v in engine.expected(truth[step]).items()
        )

    def case(name: str, call: Callable[[], object]) -> None:
        before = {k: v.clone() for k, v in engine.state().items()}
        try:
            call()
            outcome = ["ok", ""]
        except Exception as err:
            outcome = [type(err).__name__, str(err)[:300]]
        untouched = all(torch.equal(before[k], v) for k, v in engine.state().items())
        report[name] = [*outcome, untouched, follower.held_step]

    exponents, asked = TorchPath.exponents, [0]

    def counted(self: TorchPath, *args: object) -> object:
        asked[0] += 1
        return exponents(self, *args)

    TorchPath.exponents = counted  # type: ignore[method-assign]
    iter_steps, calls = codec.iter_steps, [0]
    failing = failing_on(1, 2, iter_steps, torch.OutOfMemoryError("out of memory decoding"), calls)
    codec.iter_steps = decoder.iter_steps = failing  # type: ignore[assignment]  # (`decode_steps` calls the decoder's)
    case("decode", lambda: follower.prepare(2))
    codec.iter_steps = decoder.iter_steps = iter_steps  # type: ignore[assignment]
    report["decode_asked"] = asked[0]  # the exponent exchanges this worker entered

    exponent_bytes, calls = codec.exponent_bytes, [0]
    codec.exponent_bytes = failing_on(1, 1, exponent_bytes, RuntimeError("a bug filling in exponents"), calls)  # type: ignore[assignment]
    case("fill", lambda: follower.prepare(2))
    codec.exponent_bytes = exponent_bytes  # type: ignore[assignment]

    prepared = follower.prepare(2)
    write_slice, calls = TorchPath.write_slice, [0]
    TorchPath.write_slice = failing_on(  # type: ignore[method-assign]
        1, 1, write_slice, torch.OutOfMemoryError("out of memory writing"), calls
    )
    case("write", lambda: follower.write(prepared))
    TorchPath.write_slice = write_slice  # type: ignore[method-assign]
    report["write_calls"] = calls[0]
    case("resync", lambda: follower.update(3))
    report["resync_exact"] = exact(3)
    case("then", lambda: follower.update(4))
    report["then_exact"] = exact(4)
    report["classed"] = Mode.CLASSED.name in report["modes"]
    jobs.report(out, rank, report)


if __name__ == "__main__":
    main()
    jobs.end()
