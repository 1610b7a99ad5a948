"""The live-engine follower on a stand-in engine (fused, sliced parameters; tests/fused.py): the
view map read off its loader, steps written in place at the cost of the change, and the checks.
The real vLLM engine is in tests/test_vllm.py."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, Revealing, replace_blob, torchrun
from forge import MESSAGE, forge_value
from fused import DIM, HIDDEN, Engine, checkpoint
from lightning_delta import (
    ChecksumError,
    DeltaError,
    DeltaPublisher,
    MissingObjectError,
    ModelMismatchError,
    NotCompleteYetError,
    PublisherSettings,
    SnapshotNotFoundError,
    Store,
    StoreError,
    codec,
    device_walk,
    snapshot,
    sparse_walk,
    torch_path,
    torch_walk,
    whole_walk,
    whole_write,
)
from lightning_delta import format as fmt
from lightning_delta.apply import ApplyBackend
from lightning_delta.codec import CodecOptions, Context, Mode
from lightning_delta.engine import EngineFollower, PrefetchTimeoutError
from lightning_delta.objects import FsspecObjects
from lightning_delta.patch import views
from lightning_delta.reader import ChainReader
from lightning_delta.scatter import ScatterSettings
from lightning_delta.viewmap import Box, ViewMap

STEPS = 8


def publish(url: str, context: Context = Context.NONE) -> dict[int, dict[str, torch.Tensor]]:
    """A chain of the checkpoint: bases at 1 and 5, 5% of the elements change per step by one ULP,
    only among the smallest quarter (by magnitude), as under Adam at its extreme: a delta is coded
    SPARSE, or CLASSED with `Context.EXPONENT`, never whole.  Under torchrun, each rank
    publishes its share."""
    state = checkpoint()

    def change(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        for tensor in state.values():
            bits = tensor.view(torch.int16).view(-1)
            size = tensor.float().abs().view(-1)
            small = size <= size.quantile(0.25)
            bits[(torch.rand(bits.numel(), generator=g) < 0.2) & small] += 1

    settings = PublisherSettings(base_every=4, codec=CodecOptions(context=context))
    return publish_changes(url, state, change, settings, steps=STEPS)


def publish_changes(
    url: str,
    state: dict[str, torch.Tensor],
    change: Callable[[int], None],
    settings: PublisherSettings | None = None,
    steps: int = 3,
) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 1 to `steps` of `state` published, `change(step)` made to it before each: the
    trainer's state at each step (a copy), to compare an engine with."""
    truth = {}
    with DeltaPublisher(url, lambda: state, settings or PublisherSettings(base_every=4)) as publisher:
        for step in range(1, steps + 1):
            change(step)
            truth[step] = {k: v.clone() for k, v in state.items()}
            publisher.publish(step)
    return truth


def walked_and_whole(state: dict[str, torch.Tensor]) -> Callable[[int], None]:
    """From step 2, a few of `layer.q`'s elements change (a delta walked) and every one of the
    rope's (its payload shipped whole)."""

    def change(step: int) -> None:
        if step > 1:
            state["layer.q"].view(torch.int16).view(-1)[:: 7 * step] += 1
            state["layer.rope"].view(torch.int16).add_(1)

    return change


def every_tensor_at_two_places(state: dict[str, torch.Tensor]) -> Callable[[int], None]:
    """Every tensor changes at every step, in the first two elements of each row."""

    def change(step: int) -> None:
        for tensor in state.values():
            tensor.view(torch.int16)[..., :2] += 1

    return change


def follower(
    url: str | Store,
    engine: Engine,
    apply: ApplyBackend | None = None,
    group: dist.ProcessGroup | None = None,
    scatter: ScatterSettings | None = None,
) -> EngineFollower:
    """A follower of `url` (or a store) writing into `engine` (one worker of `group`, if any), as a backend makes it."""
    store = url if isinstance(url, Store) else Store(url)
    specs = {t.name: (t.shape, fmt.DType(t.dtype).torch) for t in store.run().manifest.tensors}
    view_map = ViewMap.learn(specs, engine.load_weights, dict(engine.named_parameters()))

    def reload(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            engine.load_weights(name, tensor)

    device = engine.qkv.device
    params = lambda: dict(engine.named_parameters())  # noqa: E731
    return EngineFollower(store, view_map, params, reload, group=group, device=device, apply=apply, scatter=scatter)


BACKENDS = ["walk", "torch", "device"]
"""How a step in sync is written: the CPU walk (numba), torch's decoder, or the device walk's
Triton kernels (here under the interpreter, on CPU tensors)."""


def backend(name: str, monkeypatch: pytest.MonkeyPatch) -> ApplyBackend | None:
    """`follower`'s `apply` for a `BACKENDS` name (torch: as where numba is not installed)."""
    monkeypatch.setattr(sparse_walk, "AVAILABLE", name != "torch")
    return ApplyBackend.DEVICE if name == "device" else None


@pytest.fixture
def walks(monkeypatch) -> list[int]:
    """Counts the payloads walked in place (`sparse_walk`, `device_walk`, `torch_walk`), rather than
    decoded by torch before a write (not the synthetic step the device walk proves its kernels with)."""
    count, proving, prove = [0], [False], device_walk.prove

    def proved(device: torch.device) -> str | None:
        proving[0] = True
        try:
            return prove(device)
        finally:
            proving[0] = False

    monkeypatch.setattr(device_walk, "prove", proved)
    for cls in (sparse_walk.Walk, device_walk.DeviceWalk, torch_walk.TorchWalk):

        def counted(walk: object, apply=cls.apply) -> object:
            count[0] += not proving[0]
            return apply(walk)

        monkeypatch.setattr(cls, "apply", counted)
    return count


@pytest.fixture
def wholes(monkeypatch) -> list[int]:
    """Counts the payloads of base steps walked whole (`whole_walk`), rather than decoded by torch."""
    count, apply = [0], whole_walk.WholeWalk.apply

    def counted(walk: whole_walk.WholeWalk) -> int:
        count[0] += 1
        return apply(walk)

    monkeypatch.setattr(whole_walk.WholeWalk, "apply", counted)
    return count


def exact(engine: Engine, truth: dict[str, torch.Tensor]) -> bool:
    state, expected = engine.state(), engine.expected(truth)
    return all(torch.equal(state[k].cpu().view(torch.int16), v.view(torch.int16)) for k, v in expected.items())


def test_the_view_map_is_read_off_the_engines_own_loader(store_url):
    publish(store_url)
    engine = Engine(cast_norm=True)
    specs = {t.name: (t.shape, torch.bfloat16) for t in Store(store_url).run().manifest.tensors}
    before = {k: v.clone() for k, v in engine.state().items()}
    view_map = ViewMap.learn(specs, engine.load_weights, dict(engine.named_parameters()))
    assert all(torch.equal(before[k], v) for k, v in engine.state().items())  # learning writes nothing
    assert view_map.boxes["layer.k"] == (Box((0, 0), (HIDDEN, DIM), "qkv", HIDDEN * DIM, (DIM, 1)),)
    assert view_map.boxes["layer.o"] == (Box((0, 0), (DIM, HIDDEN), "o", 0, (HIDDEN, 1)),)
    assert "casts it" in view_map.refused["layer.norm"]  # into a float32 parameter
    assert "layer.rope" in view_map.refused  # its loader computes
    two = Engine(rank=1, size=2)
    sliced = ViewMap.learn(specs, two.load_weights, dict(two.named_parameters()))
    # worker 1 of 2 holds rows 4..7 of q, k and v, and columns 4..7 of o: a strided block
    assert sliced.boxes["layer.k"] == (Box((HIDDEN // 2, 0), (HIDDEN // 2, DIM), "qkv", HIDDEN // 2 * DIM, (DIM, 1)),)
    assert sliced.boxes["layer.o"] == (Box((0, HIDDEN // 2), (DIM, HIDDEN // 2), "o", 0, (HIDDEN // 2, 1)),)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("context", [Context.NONE, Context.EXPONENT], ids=lambda c: c.name)
@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("walk", BACKENDS)
def test_every_step_lands_in_the_engine_bit_exactly_at_the_cost_of_the_change(
    store_url, context, device, chunk, walk, walks, wholes, monkeypatch
):
    if chunk is not None:  # a step in sync in many chunks of changes, each decoded, checked and written
        monkeypatch.setattr(torch_path, "_CHUNK", chunk)
    apply = backend(walk, monkeypatch)
    truth = publish(store_url, context)
    engine = Engine().to(device)
    live = follower(store_url, engine, apply)
    assert live.paths()[1][0] == 1  # the rope, through the engine's reload
    storage = engine.qkv.data_ptr()
    for step in (1, 2, 3, 6, 7, 8):  # 4 and 5 on the way to 6: composed into one patch
        prepared = live.prepare(step)
        live.write(prepared)
        assert exact(engine, truth[step]), step
        assert torch.equal(engine.rope.cpu(), truth[step]["layer.rope"])  # the reloaded tensor
        if step in (2, 3, 7, 8):  # a delta: only its changes are written
            store = Store(store_url)
            part = store.read_part(step, 0, 1)
            assert prepared.report.changed == sum(e.changed for e in part.entries)
            mode = Mode.CLASSED if context == Context.EXPONENT else Mode.SPARSE
            payloads = zip(views(store.run(), 0), part.payloads, strict=True)
            assert [codec.parse(p, v.numel).mode for v, p in payloads] == [mode]
    assert engine.qkv.data_ptr() == storage  # in place
    live.verify()
    # the SPARSE steps from the state held (2, 3; 4, the bridge at 5 and 6, one after another;
    # 7, 8), walked by a walker (on a GPU, the payload names the rope's kept copy, host memory:
    # decoded by torch)
    walked = walk == "torch" or device == "cpu"  # torch's walk takes the kept copy on a GPU too
    assert walks[0] == (7 if walked and context == Context.NONE else 0)
    # the base at 1, decoded, written and checked at once (with numba, on the CPU)
    assert wholes[0] == (1 if walk != "torch" and device == "cpu" else 0)


@pytest.mark.parametrize("call", ["prepare", "update"])
@pytest.mark.parametrize("walk", BACKENDS)
def test_a_value_only_its_checksum_can_catch_writes_nothing_and_the_next_base_heals(
    store_url, walk, call, walks, monkeypatch, caplog
):
    """One value of step 3 changed under a re-signed marker (tests/forge.py): `prepare` checks it
    before anything is written (walked, or decoded by torch), `update` as it walks it in (then
    again from the base at 1, through the same step 3): `ChecksumError` and nothing written."""
    apply = backend(walk, monkeypatch)
    truth = publish(store_url)
    forge_value(Store(store_url), 3)
    engine = Engine()
    live = follower(store_url, engine, apply)
    live.write(live.prepare(2))
    before, walked = {k: v.clone() for k, v in engine.state().items()}, walks[0]
    caplog.set_level("WARNING", logger="lightning_delta.engine")
    with pytest.raises(ChecksumError, match=f"step 3: payload 0 .*{MESSAGE}"):
        if call == "prepare":
            live.prepare(3)
        else:
            live.update(3)
    assert all(torch.equal(before[k], v) for k, v in engine.state().items())
    if call == "update":  # the walk wrote the step, found it wrong and took it back; then from the base
        assert walks[0] - walked == 1
        assert any("nothing was written" in r.getMessage() for r in caplog.records)
    live.write(live.prepare(5))  # from the base at 5
    assert exact(engine, truth[5])


@pytest.mark.parametrize("walk", BACKENDS)
def test_a_step_that_fails_as_it_is_walked_leaves_nothing_written(store_url, walk, walks, monkeypatch):
    """`update` does not check a step in sync before it walks it into the engine: the walk checks
    each change as it writes it, and a failure on any payload takes every walk of the step back."""
    apply = backend(walk, monkeypatch)
    monkeypatch.setattr(snapshot, "SMALL", 0)  # every tensor a payload of its own
    publish(store_url)
    store = Store(store_url)
    part = store.read_part(3, 0, 1)
    blob = bytearray(store.objects.get(fmt.blob_path(3, 0, 1)))
    blob[len(blob) - part.entries[-1].length // 2] ^= 0x01  # the last payload, walked after the others
    replace_blob(store, 3, 0, 1, bytes(blob))
    engine = Engine()
    live = follower(store_url, engine, apply)
    live.update(2)
    before, walked = {k: v.clone() for k, v in engine.state().items()}, walks[0]
    with pytest.raises(DeltaError):
        live.update(3)
    assert walks[0] - walked == len(part.entries)  # every payload of step 3 was walked, then taken back
    assert all(torch.equal(before[k], v) for k, v in engine.state().items())


@pytest.mark.parametrize("walk", BACKENDS)
def test_a_follower_steps_behind_walks_each_step_and_a_forged_one_takes_every_walk_back(
    store_url, walk, walks, monkeypatch
):
    """A follower a step or two late walks each step in turn, at the cost of its change (composing
    them through torch cost 30-300x a step in the fleet bench); a forged value in the last step is
    caught as it is walked, and every walk of the update is taken back."""
    apply = backend(walk, monkeypatch)
    truth = publish(store_url)  # bases at 1, 5 and 9
    forge_value(Store(store_url), 8)
    engine = Engine()
    live = follower(store_url, engine, apply)
    live.update(2)
    walked = walks[0]
    prepared, _, _ = live.update(4)  # 3 and 4
    assert (
        exact(engine, truth[4])
        and walks[0] - walked == 2
        and prepared.report.changed == sum(Store(store_url).read_part(s, 0, 1).entries[0].changed for s in (3, 4))
    )
    live.update(6)  # 5's bridge and 6
    before, walked = {k: v.clone() for k, v in engine.state().items()}, walks[0]
    with pytest.raises(ChecksumError, match=f"step 8: payload 0 .*{MESSAGE}"):
        live.update(8)  # 7, then the forged 8: both taken back (then from the base at 5, refused before a write)
    assert walks[0] - walked == 2
    assert all(torch.equal(before[k], v) for k, v in engine.state().items())


def test_a_payload_shipped_whole_from_the_step_held_is_checked_before_a_write_and_written_after_the_walks(
    store_url, walks, monkeypatch
):
    """A delta whose change is dense ships its payload whole (RAW). From the step held it is decoded
    like a change (`_chunks`), checked by its own checksum before anything is written, and written
    beside the payloads of its rank walked before and after it (every tensor a payload of its own,
    in name order: the rope's, a kept copy the engine reloads, is the fifth of six). A forged value
    in it writes nothing."""
    monkeypatch.setattr(snapshot, "SMALL", 0)
    state = checkpoint()
    truth = publish_changes(store_url, state, walked_and_whole(state))
    store = Store(store_url)
    assert [codec.mode_of(p) for p in store.read_part(2, 0, 1).payloads] == [Mode.SPARSE] * 4 + [Mode.RAW, Mode.SPARSE]
    forge_value(store, 3, payload=4)  # the rope's
    engine = Engine()
    live = follower(store_url, engine)
    live.update(1)
    walked = walks[0]
    live.update(2)
    assert walks[0] - walked == 5  # all but the rope's, which torch decoded
    assert exact(engine, truth[2]) and torch.equal(engine.rope, truth[2]["layer.rope"])
    before = {k: v.clone() for k, v in engine.state().items()}
    with pytest.raises(ChecksumError, match=f"step 3: payload 4 .*{MESSAGE}"):
        live.update(3)  # refused from the step held, then from the base at 1: before any walk
    assert live.held_step == 2 and torch.equal(engine.rope, truth[2]["layer.rope"])
    assert all(torch.equal(before[k], v) for k, v in engine.state().items())


def test_a_prefetched_step_is_checked_again_before_its_write_and_loaded_from_its_base_if_a_weight_moved(
    store_url, caplog
):
    """CLASSED deltas (decoded by torch, not walked): `update` checks a step the prefetcher verified
    ahead once more against the weights it will be written over; a weight changed meanwhile sends
    the step back to its base, which writes every element."""
    truth = publish(store_url, Context.EXPONENT)
    engine = Engine()
    live = follower(store_url, engine)
    live.update(STEPS - 1)
    live.prefetch(0.01)
    assert live.prefetcher.join(60)  # step 8 verified ahead, against step 7's weights
    q7, q8 = (truth[s]["layer.q"].view(torch.int16).view(-1) for s in (STEPS - 1, STEPS))
    # its lowest mantissa bit: the exponent classes the CLASSED payload was made against stay
    engine.qkv.data.view(torch.int16).view(-1)[int((q8 != q7).nonzero()[0])] ^= 1
    caplog.set_level("WARNING", logger="lightning_delta.engine")
    prepared, prefetched, _ = live.update(None)
    assert (prepared.step, prepared.held, prefetched) == (STEPS, None, False)  # loaded again, not the prefetched
    assert live.held_step == STEPS and exact(engine, truth[STEPS])
    said = [r.getMessage() for r in caplog.records if "from its base" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        f"since step {STEPS} was verified; nothing was written, and the next step is written whole; "
        f"loading step {STEPS} from its base"
    )


def test_a_step_decoded_before_another_write_is_not_written(store_url):
    publish(store_url)
    live = follower(store_url, Engine())
    live.update(2)
    stale = live.prepare(3)
    live.update(3)
    with pytest.raises(SnapshotNotFoundError, match=r"^step 3 was decoded against a state no longer held$"):
        live.write(stale)


def test_an_engine_without_a_reload_refuses_a_step_that_changes_a_kept_tensor(store_url):
    """The rope is computed by the engine's loader (a kept copy): without a reload the follower
    cannot write it, says so, and holds no step."""
    publish(store_url)
    engine = Engine()
    live = follower(store_url, engine)
    live._reload = None
    with pytest.raises(
        SnapshotNotFoundError, match=r"^tensors the engine cannot take in place changed, and it has no reload$"
    ):
        live.update(1)
    assert live.held_step is None


def test_a_base_step_that_changes_no_kept_tensor_is_written_without_a_reload(store_url, wholes):
    """The twin of the test above: a run without the rope (no kept copy) is written whole and in
    place by an engine without a reload; a base step walked whole says a kept copy changed only
    where one did (#39: `WholeWriter.write` reporting one always)."""
    state = {k: v for k, v in checkpoint().items() if k != "layer.rope"}
    with DeltaPublisher(store_url, lambda: state, PublisherSettings(base_every=4)) as publisher:
        publisher.publish(1)
    engine = Engine()
    live = follower(store_url, engine)
    live._reload = None
    live.update(1)
    assert live.held_step == 1 and wholes[0] > 0 and exact(engine, state)


def test_a_parameter_left_on_the_meta_device_is_refused_by_a_whole_walk_naming_it(store_url, wholes):
    """An engine whose reload did not finish leaves a parameter on the meta device: a base step
    walked whole refuses it, naming it, and holds no step."""
    publish(store_url)
    engine = Engine()
    live = follower(store_url, engine)
    live._params = lambda: {**dict(engine.named_parameters()), "o": torch.empty_like(engine.o, device="meta")}
    with pytest.raises(ModelMismatchError, match=r"^o is on the meta device \(the engine's reload did not finish\)"):
        live.update(1)
    assert live.held_step is None


class _Stalling(FsspecObjects):
    """A store whose listings wait, once `stalled` is cleared, until it is set again (a store that
    does not answer), for 20 s at most."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.stalled, self.waiting = threading.Event(), threading.Event()
        self.stalled.set()

    def list(self, key: str) -> list[str]:
        if not self.stalled.is_set():
            self.waiting.set()
            if not self.stalled.wait(20):  # bounded, so that a test that would hang fails instead
                raise StoreError(f"{self.url}: no answer while listing {key}")
        return super().list(key)


def test_stopping_a_prefetcher_that_does_not_answer_times_out_and_waits_for_it_again(store_url):
    """The follower never uses the group while its prefetcher may still be in a collective: it
    raises instead of waiting forever, and the next call waits for the prefetcher again."""
    truth = publish(store_url)
    objects, engine = _Stalling(store_url), Engine()
    live = follower(store_url, engine)
    live.store, live._reader = Store(objects), ChainReader(Store(objects))
    live.stop_seconds = 0.05
    live.update(2)
    objects.stalled.clear()
    live.prefetch(0.01)
    assert objects.waiting.wait(60)
    for _ in range(2):
        with pytest.raises(PrefetchTimeoutError, match="did not stop"):
            live.update(None)
    assert live.held_step == 2 and exact(engine, truth[2])
    objects.stalled.set()
    live.stop_seconds = 60
    live.update(None)
    assert live.held_step == STEPS and exact(engine, truth[STEPS])
    live.close()


def test_a_forged_value_in_a_base_step_is_caught_as_it_is_walked_whole_and_no_step_is_held(store_url, wholes, caplog):
    """A base step is written as it is checked (`whole_walk`: the follower holds no step to keep):
    a value only its checksum can catch raises `ChecksumError` (`update` tries the base once
    more), the log says the step was written in part, the follower then holds no step, and the
    next clean base heals."""
    truth = publish(store_url)
    forge_value(Store(store_url), 1)
    engine = Engine()
    live = follower(store_url, engine)
    names = r"\(layer\.k, layer\.norm, layer\.o, layer\.q and 2 more\)"  # the payload's six tensors
    said = f"step 1: payload 0 {names} {MESSAGE}; the engine holds no step of the chain until it is loaded from a base$"
    caplog.set_level("WARNING", logger="lightning_delta.engine")
    with pytest.raises(ChecksumError, match=said):
        live.update(1)
    assert live.held_step is None and wholes[0] == 2
    wrote = [m.startswith(f"{live.store.url}: step 1 was written only in part (") for m in caplog.messages]
    assert wrote == [True, False, True]  # the update's write, its retry of the base, and that write
    with pytest.raises(DeltaError, match="holds no step"):
        live.verify()
    with pytest.raises(ChecksumError, match=MESSAGE):  # no step held: step 2 from the forged base (composed)
        live.update(2)
    live.update(5)
    assert live.held_step == 5 and exact(engine, truth[5]) and wholes[0] == 3
    live.verify()


def test_a_base_payload_of_another_dtype_is_refused_as_it_is_walked_whole_naming_where(store_url, wholes):
    """A RAW payload of a base step that decodes cleanly as float16 where the run says bfloat16
    (its dtype and value-coding bytes rewritten, the marker re-signed) is refused by the whole walk
    with where it is and both types, and no step is held."""
    publish(store_url)
    store = Store(store_url)
    blob = bytearray(store.objects.get(fmt.blob_path(1, 0, 1)))
    at = blob.find(bytes(store.read_part(1, 0, 1).payloads[0]))
    assert codec.mode_of(bytes(blob[at:])) == Mode.RAW
    blob[at + 5], blob[at + 7] = codec.ValueCoding.NONE, fmt.DType.of(torch.float16).code  # byte planes, float16
    replace_blob(store, 1, 0, 1, bytes(blob))
    live = follower(store_url, Engine())
    where = f"{store.url} rank 0 step 1: payload 0 is torch.float16, expected torch.bfloat16"
    with pytest.raises(fmt.FormatError, match=f"^{re.escape(where)}$"):
        live.update(1)
    assert live.held_step is None and wholes[0] == 0


def test_a_failure_while_a_base_step_is_planned_is_the_error_raised_and_walks_nothing(
    store_url, wholes, monkeypatch, caplog
):
    """A failure before any payload is walked whole (the kept copy's memory, say) is the error
    raised, nothing is walked, the log says this worker wrote nothing (not "written only in part"), and no
    step is held (#39: with it dropped in `WholeWriter.write`, the step was walked in part and refused
    by the checksum, or by a length mismatch).  Every tensor a payload of its own: the rope's, the
    kept copy, is planned after four others."""
    monkeypatch.setattr(snapshot, "SMALL", 0)
    truth = publish(store_url)
    engine = Engine()
    live = follower(store_url, engine)

    def no_memory(tensor: int) -> None:
        raise MemoryError("no memory for the kept copy (a stand-in)")

    with monkeypatch.context() as m:
        m.setattr(live.plan, "keep", no_memory)
        caplog.set_level("WARNING", logger="lightning_delta.engine")
        with pytest.raises(DeltaError, match=r"^MemoryError: no memory for the kept copy \(a stand-in\)$"):
            live.update(1)
    assert live.held_step is None and wholes[0] == 0
    assert caplog.messages == [
        f"{live.store.url}: step 1 was not written by this worker (no memory for the kept copy (a stand-in)); "
        "the engine holds no step of the chain until it is loaded from a base"
    ]
    live.update(1)
    assert exact(engine, truth[1])


def test_a_step_failing_before_a_write_after_a_base_step_written_whole_says_nothing_was_written(
    store_url, wholes, monkeypatch, caplog
):
    """The writer of base steps says whether its last write wrote (`WholeWriter.wrote`), also when
    that write had nothing to walk whole: base step 1 walked whole, then step 2 (CLASSED: decoded
    by torch, none of it whole) failing as torch decodes it to write it, before anything is
    written, logs "not written by this worker" (#39: without `wrote` reset at the start of
    `write`, step 1's write made it "written only in part")."""
    truth = publish(store_url, Context.EXPONENT)
    engine = Engine()
    live = follower(store_url, engine)
    live.update(1)
    assert live.held_step == 1 and wholes[0] == 1

    def no_memory(*args: object) -> None:
        raise MemoryError("no memory to decode (a stand-in)")

    prepared = live.prepare(2)  # decoded once by torch to be checked
    with monkeypatch.context() as m:
        m.setattr(live._torch, "patches", no_memory)
        caplog.set_level("WARNING", logger="lightning_delta.engine")
        with pytest.raises(DeltaError, match=r"^MemoryError: no memory to decode \(a stand-in\)$"):
            live.write(prepared)
    assert live.held_step is None and exact(engine, truth[1])
    assert caplog.messages == [
        f"{live.store.url}: step 2 was not written by this worker (no memory to decode (a stand-in)); "
        "the engine holds no step of the chain until it is loaded from a base"
    ]


@pytest.mark.parametrize("cores", [1, 3])
def test_a_base_step_is_walked_whole_exactly_on_any_number_of_cores(store_url, wholes, monkeypatch, cores):
    """Payloads are walked whole side by side, as many at once as the process has cores (one more
    pool thread receives peers' pieces): on one core (a container's share) as on several, every
    payload is walked, and the engine holds the step exactly; no more walks are pending at once
    than there are cores, which bounds the decompressed planes alive.  Every tensor a payload of its
    own: six walks.  It finds the walks by `whole_write.ThreadPoolExecutor` and `WholeWriter.walk`'s
    name: a rename there must be made here too (the test then fails loudly, `most` 0)."""
    monkeypatch.setattr(snapshot, "SMALL", 0)
    truth = publish(store_url)
    monkeypatch.setattr(whole_write, "_threads", lambda: cores)
    pending, most = [0], [0]

    class Counted(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            future = super().submit(fn, *args, **kwargs)
            if getattr(fn, "__name__", "") == "walk":
                pending[0] += 1
                most[0] = max(most[0], pending[0])
                result, taken = future.result, []

                def counted(timeout=None):
                    if not taken:
                        taken.append(True)
                        pending[0] -= 1
                    return result(timeout)

                future.result = counted
            return future

    monkeypatch.setattr(whole_write, "ThreadPoolExecutor", Counted)
    engine = Engine()
    live = follower(store_url, engine)
    live.update(1)
    assert live.held_step == 1 and wholes[0] == 6 and exact(engine, truth[1])
    assert most[0] == cores and pending[0] == 0


@pytest.mark.parametrize("context", [Context.NONE, Context.EXPONENT], ids=["sparse", "classed"])
def test_a_reload_that_raises_leaves_an_engine_that_resyncs(store_url, caplog, context):
    """The end of a write (the engine's reload of the tensors it cannot take in place) cannot be
    taken back: where it raises, the follower holds no step, says the step was written in part (by
    the walk, SPARSE, or by torch, CLASSED), and loads the step again from its base at once; where
    that fails too, it says so, and the next update re-syncs."""
    truth = publish(store_url, context)
    engine = Engine(cast_norm=True)  # the norm is cast: kept, and handed to the reload
    live = follower(store_url, engine)
    reload, calls = live._reload, []

    def failing(times: int):
        def call(tensors: dict[str, torch.Tensor]) -> None:
            calls.append(sorted(tensors))
            if len(calls) <= times:
                engine.norm.data.fill_(float("nan"))  # as a layer processed from half its weights would
                raise RuntimeError("the reload failed halfway")
            assert reload is not None
            reload(tensors)

        return call

    live.update(2)
    live._reload = failing(1)
    caplog.set_level("WARNING", logger="lightning_delta.engine")
    prepared, prefetched, _ = live.update(3)  # the reload raised once: step 3 again, from the base at 1
    assert calls == [["layer.norm", "layer.rope"]] * 2 and prepared.held is None and not prefetched
    assert "RuntimeError: the reload failed halfway; re-syncing step 3 from its base" in caplog.messages
    assert (
        f"{live.store.url}: step 3 was written only in part (the reload failed halfway); the engine holds no step "
        "of the chain until it is loaded from a base"
    ) in caplog.messages
    assert live.held_step == 3 and exact(engine, truth[3])
    live.verify()

    calls.clear()
    live._reload = failing(2)  # and again as it re-syncs: the follower holds no step
    with pytest.raises(DeltaError, match="the reload failed halfway"):
        live.update(4)
    assert live.held_step is None and len(calls) == 2
    prepared, _, _ = live.update(4)  # the next update loads from a base
    assert prepared.held is None and live.held_step == 4 and exact(engine, truth[4])
    live.verify()


class _Layered(torch.nn.Module):
    """Two modules, as an engine lays them out: `proj`'s weight is cast on load (so refused, and
    reloaded) beside its bias, a plain view; `norm` holds plain views only.  Its reload rebuilds
    each module it hands anything from what it received, as vLLM's layerwise reload does: a
    parameter of that module it received nothing for is uninitialised memory (NaN here)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, 8, dtype=torch.float32)
        self.proj.bias.data = torch.zeros(8, dtype=torch.bfloat16)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.bfloat16), requires_grad=False)
        self.requires_grad_(False)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        self.get_parameter(name).data.copy_(tensor)

    @torch.no_grad()
    def reload(self, tensors: dict[str, torch.Tensor]) -> None:
        for module in {name.rsplit(".", 1)[0] for name in tensors}:
            for param in self.get_submodule(module).parameters():
                param.data.fill_(float("nan"))
        for name, tensor in tensors.items():
            self.load(name, tensor)


@pytest.mark.parametrize("by_module", [True, False])
def test_a_module_goes_in_place_or_through_the_reload_as_a_whole(store_url, by_module):
    torch.manual_seed(0)
    state = {
        "proj.weight": torch.randn(8, DIM).to(torch.bfloat16),
        "proj.bias": torch.randn(8).to(torch.bfloat16),
        "norm.weight": torch.randn(DIM).to(torch.bfloat16),
    }
    truth = publish_changes(store_url, state, every_tensor_at_two_places(state))
    engine = _Layered()
    specs = {t.name: (t.shape, torch.bfloat16) for t in Store(store_url).run().manifest.tensors}
    params = dict(engine.named_parameters())
    view_map = ViewMap.learn(specs, engine.load, params, by_module=by_module)
    assert "proj.weight" in view_map.refused and "norm.weight" in view_map.boxes
    live = EngineFollower(Store(store_url), view_map, lambda: dict(engine.named_parameters()), engine.reload)
    for step in (1, 2, 3):
        live.update(step)
        bias = engine.proj.bias.view(torch.int16)
        assert torch.equal(engine.norm.weight.view(torch.int16), truth[step]["norm.weight"].view(torch.int16))
        if not by_module:  # the bias written in place, then wiped as its module is rebuilt without it
            assert engine.proj.bias.isnan().all()
            return
        assert "its module (proj) is reloaded" in view_map.refused["proj.bias"]
        assert torch.equal(bias, truth[step]["proj.bias"].view(torch.int16))
        assert torch.equal(engine.proj.weight.to(torch.bfloat16), truth[step]["proj.weight"])


class _Derived(torch.nn.Module):
    """MLA's layout in miniature: `attn` derives `W` (a parameter no checkpoint tensor is copied
    into) from `attn.kv.weight` after loading, and reads only `W`; `kv` is registered twice, as
    vLLM's MLA registers `kv_b_proj`.  Its reload loads, then processes `attn` again."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = torch.nn.Linear(DIM, 8, bias=False, dtype=torch.bfloat16)
        self.attn = torch.nn.Module()
        self.attn.kv = self.kv
        self.attn.W = torch.nn.Parameter(torch.zeros(DIM, 8, dtype=torch.bfloat16))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.bfloat16))
        self.requires_grad_(False)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        self.get_parameter(name).data.copy_(tensor)

    @torch.no_grad()
    def process(self) -> None:
        self.attn.W.data.copy_(self.kv.weight.t())

    def reload(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.load(name, tensor)
        self.process()


def test_a_parameter_that_feeds_a_copy_made_after_loading_is_never_written_only_in_place(store_url):
    torch.manual_seed(0)
    state = {"kv.weight": torch.randn(8, DIM).to(torch.bfloat16), "norm.weight": torch.randn(DIM).to(torch.bfloat16)}
    truth = publish_changes(store_url, state, every_tensor_at_two_places(state))
    engine = _Derived()
    specs = {t.name: (t.shape, torch.bfloat16) for t in Store(store_url).run().manifest.tensors}
    view_map = ViewMap.learn(specs, engine.load, dict(engine.named_parameters()), by_module=True)
    assert set(view_map.boxes) == {"kv.weight", "norm.weight"}  # plain views, as far as the loader shows
    view_map.refuse_derived(engine)
    assert set(view_map.boxes) == {"norm.weight"} and "feeds attn.W" in view_map.refused["kv.weight"]
    live = EngineFollower(Store(store_url), view_map, lambda: dict(engine.named_parameters()), engine.reload)
    for step in (1, 2, 3):
        live.update(step)
        assert torch.equal(engine.attn.W.t().contiguous().view(torch.int16), truth[step]["kv.weight"].view(torch.int16))
        assert torch.equal(engine.norm.weight.view(torch.int16), truth[step]["norm.weight"].view(torch.int16))


def test_the_view_map_finds_the_parameter_in_a_shared_storage_and_refuses_a_copy_past_its_end():
    """Parameters carved out of one storage (an engine's memory pool): each copy is placed in the
    parameter it starts in, and one that runs past that parameter's end is refused."""
    pool = torch.zeros(24, dtype=torch.bfloat16)
    params = {"p": pool[:8], "q": pool[8:16], "r": pool[16:24]}

    def load(name: str, tensor: torch.Tensor) -> None:
        at = {"a": 8, "b": 4, "c": 16}[name]
        pool[at : at + 8].copy_(tensor)

    specs = {n: ((8,), torch.bfloat16) for n in "abc"}
    view_map = ViewMap.learn(specs, load, params)
    assert view_map.boxes["a"] == (Box((0,), (8,), "q", 0, (1,)),)
    assert view_map.boxes["c"] == (Box((0,), (8,), "r", 0, (1,)),)
    assert "past the ends of p" in view_map.refused["b"]


@pytest.mark.parametrize("walk", ["walk", "device"])
def test_a_weight_changed_behind_the_followers_back_is_caught(store_url, walk, monkeypatch, caplog):
    apply = backend(walk, monkeypatch)
    truth = publish(store_url)
    engine = Engine()
    live = follower(store_url, engine, apply)
    live.write(live.prepare(2))
    numel = sum(t.numel() for t in truth[2].values())
    q2, q3 = (truth[s]["layer.q"].view(torch.int16).view(-1) for s in (2, 3))
    # At a position step 3 changes: its incremental check sees it, and the follower re-syncs from
    # the base, which writes every element (the changed one too).
    engine.qkv.data.view(-1)[int((q3 != q2).nonzero()[0])] += 1
    caplog.set_level("WARNING", logger="lightning_delta.engine")
    prepared = live.prepare(3)
    assert any("from the values the engine holds" in r.getMessage() for r in caplog.records)
    assert prepared.report.changed == numel
    live.write(prepared)
    assert exact(engine, truth[3])
    # Through `update`, which walks the step in sync unchecked: the walk sees it as it writes,
    # takes the step back, and the follower re-syncs from the base.
    q4 = truth[4]["layer.q"].view(torch.int16).view(-1)
    engine.qkv.data.view(-1)[int((q4 != q3).nonzero()[0])] += 1
    prepared, _, _ = live.update(4)
    assert prepared.report.changed == numel
    assert exact(engine, truth[4])
    live.write(live.prepare(3))  # back to 3, from its base
    # Anywhere else: the incremental check of step 4 cannot see it, the full check does.
    engine.qkv.data.view(-1)[int((q3 == truth[4]["layer.q"].view(torch.int16).view(-1)).nonzero()[0])] += 1
    live.write(live.prepare(4))
    with pytest.raises(ChecksumError, match="behind the follower's back"):
        live.verify()
    assert live.prepare(4).report.changed == numel  # the next load is whole, from its base


def test_a_weight_changed_after_a_step_was_verified_ahead_is_caught_before_the_write(store_url):
    """CLASSED deltas are decoded by torch, not walked (whose own check is above): a step verified
    ahead, as a prefetched one is, is checked once more against the weights it will be written
    over, and nothing is written if one changed since."""
    truth = publish(store_url, Context.EXPONENT)
    engine = Engine()
    live = follower(store_url, engine)
    live.write(live.prepare(2))
    prepared = live.prepare(3)
    assert not prepared.walked  # the torch path, which `write(check=True)` checks
    q2, q3 = (truth[s]["layer.q"].view(torch.int16).view(-1) for s in (2, 3))
    # its lowest mantissa bit: the exponent classes the CLASSED payload was made against stay
    engine.qkv.data.view(torch.int16).view(-1)[int((q3 != q2).nonzero()[0])] ^= 1
    before = {k: v.clone() for k, v in engine.state().items()}
    with pytest.raises(ChecksumError, match="changed behind the follower's back since step 3 was verified"):
        live.write(prepared, check=True)
    assert all(torch.equal(engine.state()[k], v) for k, v in before.items())  # nothing was written
    assert live.held_step is None
    live.write(live.prepare(3))  # the next load is whole, from its base
    assert exact(engine, truth[3])


@pytest.mark.parametrize("ahead", [1, 2], ids=["one_delta", "two_deltas"])
def test_a_step_verified_ahead_and_untouched_since_is_written_after_its_check(store_url, ahead, monkeypatch):
    """The twin of the test above: nothing changed since the step was verified, so the check of its
    changes against the weights they are written over (a partial sum over the changes, summed
    with the other workers') agrees, and the step is written exact, one delta ahead (decoded 64
    changes at a time: the partial sums of its chunks add up) or two composed; a weight no change
    touches may differ (the next full check's, not this one's)."""
    monkeypatch.setattr(torch_path, "_CHUNK", 64)
    monkeypatch.setattr(torch_path, "_CHUNK_PER_ELEMENT", 0)
    truth = publish(store_url, Context.EXPONENT)
    engine = Engine()
    live = follower(store_url, engine)
    live.write(live.prepare(2))
    prepared = live.prepare(2 + ahead)
    assert not prepared.walked and prepared.held is not None
    q2, qn = (truth[s]["layer.q"].view(torch.int16).view(-1) for s in (2, 2 + ahead))
    untouched = int((q2 == qn).nonzero()[0])
    engine.qkv.data.view(torch.int16).view(-1)[untouched] ^= 1
    live.write(prepared, check=True)
    assert live.held_step == 2 + ahead
    engine.qkv.data.view(torch.int16).view(-1)[untouched] ^= 1
    assert exact(engine, truth[2 + ahead])


def test_a_step_verified_ahead_with_a_payload_shipped_whole_is_written_after_its_check(store_url, monkeypatch):
    """The check of a step verified ahead skips the payloads shipped whole (their own checksum
    verified them, and they replace every element) and those walked (checked as they are written):
    a step of both, every tensor a payload of its own and the rope's whole, is written exact."""
    monkeypatch.setattr(snapshot, "SMALL", 0)
    state = checkpoint()
    truth = publish_changes(store_url, state, walked_and_whole(state))
    engine = Engine()
    live = follower(store_url, engine)
    live.write(live.prepare(2))
    prepared = live.prepare(3)
    assert prepared.walked and (0, 4) not in prepared.walked  # the rope's, shipped whole
    live.write(prepared, check=True)
    assert live.held_step == 3 and exact(engine, truth[3]) and torch.equal(engine.rope, truth[3]["layer.rope"])


def test_a_weight_changed_under_a_torch_decoded_payload_after_a_walked_one_is_caught_before_the_write(
    store_url, monkeypatch
):
    """A step verified ahead that mixes payloads walked in place (checked as they are written) and
    payloads decoded by torch: the check of its changes skips the walked ones and goes on to the
    others (#39: `continue` -> `break` passed over them).  Every tensor a payload of its own,
    `layer.k` (payload 0) changed at spread positions (SPARSE, walked), `layer.q` (payload 3) among
    its smallest elements (CLASSED, decoded by torch)."""
    monkeypatch.setattr(snapshot, "SMALL", 0)
    state = checkpoint()

    def change(step: int) -> None:
        if step > 1:
            state["layer.k"].view(torch.int16).view(-1)[step::7] += 1
            q = state["layer.q"].view(torch.int16).view(-1)
            size = state["layer.q"].float().abs().view(-1)
            q[(size <= size.quantile(0.25)).nonzero().view(-1)[step::3]] += 1

    settings = PublisherSettings(base_every=4, codec=CodecOptions(context=Context.EXPONENT))
    truth = publish_changes(store_url, state, change, settings)
    engine = Engine()
    live = follower(store_url, engine)
    live.write(live.prepare(2))
    prepared = live.prepare(3)
    assert (0, 0) in prepared.walked and (0, 3) not in prepared.walked and prepared.held is not None
    q2, q3 = (truth[s]["layer.q"].view(torch.int16).view(-1) for s in (2, 3))
    engine.qkv.data.view(torch.int16).view(-1)[int((q3 != q2).nonzero()[0])] ^= 1
    before = {k: v.clone() for k, v in engine.state().items()}
    with pytest.raises(ChecksumError, match=r"^rank 0 payload 3: the engine's weights changed behind"):
        live.write(prepared, check=True)
    assert all(torch.equal(engine.state()[k], v) for k, v in before.items())  # nothing was written
    live.write(live.prepare(3))  # the next load is whole, from its base
    assert exact(engine, truth[3])


def test_a_step_verified_ahead_whose_weights_cannot_be_listed_for_its_check_is_not_written(store_url):
    """The check of a step verified ahead raises the error met inside it (the engine's parameters
    not listed, say) on every worker, and writes nothing (#39: with that failure dropped in
    `checks.changes_differ`, the check passed over nothing and the step was written unchecked)."""
    truth = publish(store_url, Context.EXPONENT)
    engine = Engine()
    live = follower(store_url, engine)
    live.write(live.prepare(2))
    prepared = live.prepare(3)
    assert not prepared.walked and prepared.held is not None
    listed, calls = live._params, [0]

    def once_released() -> dict[str, torch.Tensor]:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("the weights were released")
        return listed()

    live._params = once_released
    before = {k: v.clone() for k, v in engine.state().items()}
    with pytest.raises(RuntimeError, match=r"^the weights were released$"):
        live.write(prepared, check=True)
    assert calls[0] == 1 and all(torch.equal(engine.state()[k], v) for k, v in before.items())
    live.write(prepared, check=True)  # listed again: checked and written
    assert live.held_step == 3 and exact(engine, truth[3])


@pytest.mark.parametrize("walk", BACKENDS)
def test_a_kept_copy_a_walk_changes_is_reloaded_into_the_engine_and_one_it_leaves_is_not(store_url, walk, monkeypatch):
    """The rope (its engine's loader computes it: the follower keeps a copy and reloads it) changes
    by one element in step 2 and not at all in step 3, walked each time: the engine's rope is the
    step's after each, and only the step that changed it reloads it (a walk reports the kept copies
    it wrote)."""
    apply = backend(walk, monkeypatch)
    state = checkpoint()

    def change(step: int) -> None:
        state["layer.q"].view(torch.int16).view(-1)[step::11] += 1
        if step == 2:
            state["layer.rope"].view(torch.int16)[1] += 1

    truth = publish_changes(store_url, state, change)
    engine = Engine()
    reloaded = []
    load = engine.load_weights
    live = follower(store_url, engine, apply)
    live.update(1)
    monkeypatch.setattr(engine, "load_weights", lambda name, t: (reloaded.append(name), load(name, t)))
    for step in (2, 3):
        prepared, _, _ = live.update(step)
        assert prepared.report.kind == fmt.Kind.DELTA and exact(engine, truth[step])
        assert torch.equal(engine.rope, truth[step]["layer.rope"]), step
    assert reloaded == ["layer.rope"]


def test_a_follower_told_to_forget_writes_the_next_step_whole(store_url):
    """`forget` (a probe found the engine computing what its weights do not say): the follower holds
    no step, a step it prefetched is dropped, and the next update writes every element, from a base,
    even a value the checks cannot see."""
    truth = publish(store_url)
    engine = Engine()
    live = follower(store_url, engine)
    live.write(live.prepare(2))
    q2, q3 = (truth[s]["layer.q"].view(torch.int16).view(-1) for s in (2, 3))
    engine.qkv.data.view(-1)[int((q2 == q3).nonzero()[0])] += 1  # where step 3 changes nothing
    live.forget()
    assert live.held_step is None
    prepared, _, _ = live.update(3)
    assert prepared.held is None and prepared.report.changed == sum(t.numel() for t in truth[3].values())
    assert exact(engine, truth[3])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("context", "apply"),
    [(Context.EXPONENT, None), (Context.NONE, None), (Context.NONE, ApplyBackend.DEVICE)],
    ids=["EXPONENT", "NONE", "NONE-device"],
)
def test_two_tensor_parallel_workers_share_one_download_and_each_writes_its_slices(tmp_path, context, apply):
    out = tmp_path / "out"
    out.mkdir()
    backend = [apply.name] if apply is not None else []
    torchrun(ROOT / "tests" / "engine_job.py", str(tmp_path / "store"), str(out), context.name, *backend)
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["exact"] == [True] * 4 and report["untouched"] == [True, True]
        assert [step for step, _ in report["errors"]] == [7, 8]  # 8's chain passes the damaged 7
        assert report["tampered"] == "ChecksumError" and report["refused"] == ["layer.rope"]
        # CLASSED payloads in a TP group: said once, with the way out; SPARSE ones are walked in
        # place, each worker its slices and blocks: the two trainer ranks' payloads of steps 2, 3,
        # of 4, the bridge at 5 and 6 one after another, of the damaged 7 (rank 1's refused as it
        # is walked: every walk taken back, "untouched"), and for 8 rank 0's 7 and 8 and rank 1's 7
        # (the CPU walk stops at the refused payload; the device walk launches every one, and the
        # one decision refuses them all)
        assert report["warned"] == (context == Context.EXPONENT)
        walked = {"1": 0, "2": 2, "3": 2, "6": 6, "7": 2, "8": 4 if apply == ApplyBackend.DEVICE else 3}
        assert report["walked_by_step"] == ({s: 0 for s in walked} if context == Context.EXPONENT else walked)
        assert report["on_device"] == (sum(walked.values()) if apply == ApplyBackend.DEVICE else 0)
        if apply == ApplyBackend.DEVICE:  # step 3 under the sync audit: nothing waited before the decision
            assert report["waits_before_decision"] == [] and report["host_exchange_reads"] > 0
            # a proof that broke worker 1's device alone: both workers raise its error at start
            kind, said = report["init"]
            assert kind == "DeviceError" and said.endswith("the kernels' proof broke this worker's device (a stand-in)")
    # two trainer ranks: each worker fetched one rank's parts (the base 1, a delta each for 2 and
    # 3, then 4, the bridge at 5 and 6), and the other worker's arrived through the group
    assert [r["parts"] for r in reports] == [[1, 1, 1, 3], [1, 1, 1, 3]]
    if context == Context.NONE and apply is None:  # held 3, worker 1's blob of step 4 not there yet
        # [step asked, outcome, step held, untouched or exact, warnings] on both workers alike (group
        # rank 0's verdict: worker 1's bound is 0): not complete yet twice, damage past the bound
        # (tried from its base: the one warning), then the blob arrives and both take it
        not_yet, damage = ["NotCompleteYetError", 3, True, 0], ["MissingObjectError", 3, True, 1]
        expected = [[None, *not_yet], [8, *not_yet], [4, *not_yet], [4, *damage], [4, "4", 4, True, 0]]
        assert [[row[:5] for row in r["not_yet"]] for r in reports] == [expected, expected]
        # update(None) reads what update(8) reads: after 8's miss (met by worker 1, the other worker
        # knows only its message) no step older than 8 through the hole at 4 is tried (7, 6, 5, 4:
        # 10,670 and 8,234 bytes against 3,500 and 3,003 before)
        assert [r["not_yet"][0][5] for r in reports] == [r["not_yet"][1][5] for r in reports]


def test_a_full_check_whose_weights_cannot_be_listed_raises_that_error(store_url):
    """`verify` rehashes every payload held; where the engine cannot list its parameters (weights
    released, say), it raises that error rather than passing over nothing (#39: with the failure
    dropped in `checks.check_held`, `verify` passed)."""
    truth = publish(store_url)
    engine = Engine()
    live = follower(store_url, engine)
    live.update(2)
    live.verify()

    def released() -> dict[str, torch.Tensor]:
        raise RuntimeError("the weights were released")

    live._params = released
    with pytest.raises(RuntimeError, match=r"^the weights were released$"):
        live.verify()
    assert live.held_step == 2 and exact(engine, truth[2])


# ----------------------------------------------------------------------------- stores that fill out of order


@pytest.fixture(scope="module")
def chain_objects(tmp_path_factory) -> tuple[dict[str, bytes], dict[int, dict[str, torch.Tensor]]]:
    """`publish`'s chain (bases at 1 and 5, 5's bridge) as objects, and the trainer's steps."""
    root = tmp_path_factory.mktemp("chain")
    truth = publish(str(root))
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}, truth


def all_but(objects: dict[str, bytes], lost: str) -> Revealing:
    """Every object shown but `lost` (`shown.add(lost)` shows it)."""
    store = Revealing(objects, sorted(objects), [len(objects)], hidden=frozenset({lost}))
    store.shown |= set(objects) - {lost}
    return store


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_engine_on_a_store_that_fills_out_of_order_holds_only_exact_steps(chain_objects, data, caplog):
    """Markers before their blobs, steps before the steps they chain to, revealed a batch at each
    poll: `update(None)` takes the newest complete step or raises `NotCompleteYetError` keeping the
    step held, never warns (no re-plan from a base: the warning says so), and ends at step 8."""
    objects, truth = chain_objects
    order = data.draw(st.permutations(sorted(set(objects) - {"run.json"})))
    batches = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=6).filter(any))
    revealing = Revealing(objects, order, batches)
    revealing.shown.add("run.json")  # an engine's follower starts from the run manifest
    engine = Engine()
    live = follower(Store(revealing), engine)
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="lightning_delta")
    held = []
    for _ in range(4 * len(objects)):
        try:
            live.update(None)
        except NotCompleteYetError:
            pass
        except SnapshotNotFoundError:  # nothing listed yet
            assert live.held_step is None
        if live.held_step is not None:
            held.append(live.held_step)
            assert exact(engine, truth[live.held_step])
        if live.held_step == STEPS:
            break
    assert held[-1] == STEPS and held == sorted(held), held
    assert warnings_of(caplog) == []


def test_an_engines_prefetcher_takes_the_newest_complete_step_and_the_newer_one_at_its_next_poll(chain_objects):
    objects, truth = chain_objects
    lost = fmt.blob_path(6, 0, 1)  # 6 and 7 chain through it, 8 too
    hidden = all_but(objects, lost)
    engine = Engine()
    live = follower(Store(hidden), engine)
    live.update(3)
    live.prefetch(0.001)
    assert live.prefetcher.join(60)  # 8, 7 and 6 not complete yet: 5 made ready
    prepared, prefetched, _ = live.update(None)
    assert (prepared.step, prefetched) == (5, True) and exact(engine, truth[5])
    polls, deadline = hidden.polls, time.monotonic() + 60
    live.prefetch(0.001)
    while hidden.polls < polls + 2:  # it tried 8 at least, not complete yet: it goes on, nothing made
        assert live.prefetcher.made() is None and live.prefetcher.running and time.monotonic() < deadline
        live.prefetcher.join(0.01)
    assert live.prefetcher.made() is None and live.prefetcher.running
    hidden.shown = hidden.shown | {lost}  # the blob arrives (one assignment: the thread lists the set)
    assert live.prefetcher.join(60)  # the next poll takes 8
    prepared, prefetched, _ = live.update(None)
    assert (prepared.step, prefetched) == (STEPS, True) and exact(engine, truth[STEPS])


def test_an_explicit_update_to_a_step_not_complete_yet_keeps_the_step_held_until_missing_after(chain_objects, caplog):
    """Not complete yet: `NotCompleteYetError`, nothing written, no base read, no warning; once
    the object has been missing for `missing_after` (a fake clock), damage as before: the step is
    tried from its base, with a warning, and `MissingObjectError`."""
    objects, truth = chain_objects
    lost = fmt.blob_path(4, 0, 1)
    hidden = all_but(objects, lost)
    engine = Engine()
    live = follower(Store(hidden), engine)
    live.update(3)
    now = [0.0]
    live.missing.clock = lambda: now[0]
    caplog.set_level(logging.WARNING, logger="lightning_delta")
    before = hidden.bytes_read
    for _ in range(2):
        with pytest.raises(NotCompleteYetError, match=lost):
            live.update(4)
        now[0] += live.missing.missing_after / 2 - 1e-3
    assert live.held_step == 3 and exact(engine, truth[3]) and warnings_of(caplog) == []
    assert hidden.bytes_read - before < len(objects[fmt.blob_path(1, 0, 1)])  # the markers, not the base
    now[0] += 1e-2
    with pytest.raises(MissingObjectError, match=lost) as raised:
        live.update(4)
    assert not isinstance(raised.value, NotCompleteYetError)
    assert len(warnings_of(caplog)) == 1 and "trying from its base" in warnings_of(caplog)[0]
    assert live.held_step == 3 and exact(engine, truth[3])
    hidden.shown.add(lost)
    live.update(4)
    assert exact(engine, truth[4])


def without_step_6s_blob(objects, held: int):
    """An engine holding step `held` of a chain whose step 6 lacks its blob, its missing clock a
    fake one (`now[0]`)."""
    engine = Engine()
    live = follower(Store(all_but(objects, fmt.blob_path(6, 0, 1))), engine)
    live.update(held)
    now = [0.0]
    live.missing.clock = lambda: now[0]
    return engine, live, now


def test_an_object_missing_counts_towards_missing_after_only_since_the_engine_last_took_a_step(chain_objects):
    """A follower that keeps taking steps is not stuck: the clock restarts at each write (without
    the restart, step 6 here would count as lost, as it would for `follow`)."""
    objects, truth = chain_objects
    engine, live, now = without_step_6s_blob(objects, 3)
    for step in (4, 5):
        with pytest.raises(NotCompleteYetError):
            live.update(6)
        now[0] += 0.75 * live.missing.missing_after
        live.update(step)
    with pytest.raises(NotCompleteYetError):
        live.update(6)
    assert live.held_step == 5 and exact(engine, truth[5])


def test_a_write_that_fails_in_part_then_a_base_not_there_yet_is_not_reported_as_not_complete_yet(
    chain_objects, monkeypatch
):
    """3 -> 4 -> 5 through 5's bridge, written in part, then the re-sync from 5's base, whose blob
    is not there yet: the engine holds no step, so the error must not be `NotCompleteYetError`
    (which promises nothing written and the step held kept: the vLLM backend would report step 3)."""
    objects, _ = chain_objects
    lost = fmt.blob_path(5, 0, 1)
    engine = Engine()
    live = follower(Store(all_but(objects, lost)), engine)
    live.update(3)

    def fails(*args: object) -> bool:
        raise RuntimeError("the write failed in part")

    monkeypatch.setattr(live._whole, "write", fails)
    with pytest.raises(MissingObjectError, match=lost) as raised:
        live.update(5)
    assert live.held_step is None and not isinstance(raised.value, NotCompleteYetError)


def test_a_hole_in_the_chain_costs_each_poll_the_newer_steps_blobs_once(chain_objects):
    """Held 5, step 6's blob not there yet, 7 and 8 listed: 8 is tried (its blob and 7's read,
    6's missing), then only steps older than 6, so 7's blob is not read again for step 7 (the
    review measured 3,165 bytes a poll: 8's and 7's blobs, then 7's again, and the markers)."""
    objects, _ = chain_objects
    hidden = all_but(objects, fmt.blob_path(6, 0, 1))
    live = follower(Store(hidden), Engine())
    live.update(5)
    markers = sum(len(objects[fmt.commit_path(s, 0, 1)]) for s in (6, 7, 8))
    blobs = sum(len(objects[fmt.blob_path(s, 0, 1)]) for s in (7, 8))
    for _ in range(2):
        before = hidden.bytes_read
        with pytest.raises(NotCompleteYetError, match=fmt.blob_path(6, 0, 1)):
            live.update(None)
        assert hidden.bytes_read - before == markers + blobs  # 1,936 bytes


def test_rewriting_the_step_held_does_not_restart_the_missing_clock(chain_objects):
    """A caller alternating `update(held)` and `update(6)` is stuck on step 5: past `missing_after`,
    step 6's missing blob is damage (tried from its base, `MissingObjectError`)."""
    objects, truth = chain_objects
    engine, live, now = without_step_6s_blob(objects, 5)
    for _ in range(2):
        with pytest.raises(NotCompleteYetError):
            live.update(6)
        now[0] += 0.75 * live.missing.missing_after
        live.update(5)
    with pytest.raises(MissingObjectError, match=fmt.blob_path(6, 0, 1)) as raised:
        live.update(6)
    assert not isinstance(raised.value, NotCompleteYetError)
    assert live.held_step == 5 and exact(engine, truth[5])
