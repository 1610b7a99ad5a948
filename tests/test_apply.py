"""The apply backends (`apply`): which one a follower takes where, and a step of several payloads
through the CPU walk and the device walk (Triton's interpreter, on CPU tensors): the same writes,
or, where the step's check fails, every walk taken back to the last bit."""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
import weakref
from types import SimpleNamespace
from typing import Any
from unittest.mock import ANY

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge import MESSAGE, forge_value
from fused import Engine
from lightning_delta import (
    ChecksumError,
    DeltaError,
    DeviceError,
    FormatError,
    Store,
    apply,
    codec,
    device_walk,
    elias_fano,
    group,
    plan,
    scatter,
    sparse_walk,
    torch_walk,
    whole_write,
)
from lightning_delta.apply import ApplyBackend, Payload
from lightning_delta.codec import Mode
from lightning_delta.format import MAX_ELEMENTS
from test_engine import exact, follower, publish
from test_kernels import audited
from test_sparse_walk import UNCOMPRESSED, walks

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
MASK64 = (1 << 64) - 1


def test_each_device_takes_the_walk_that_runs_there_by_default(monkeypatch):
    assert ApplyBackend.default(CPU) == ApplyBackend.CPU_WALK
    assert ApplyBackend.default(CUDA) == ApplyBackend.DEVICE
    monkeypatch.setattr(sparse_walk, "AVAILABLE", False)
    monkeypatch.setattr(device_walk, "AVAILABLE", False)
    assert ApplyBackend.default(CPU) == ApplyBackend.TORCH == ApplyBackend.default(CUDA)
    assert isinstance(apply.walker(None, CPU), apply.TorchWalker)


def test_a_walker_reports_the_backend_it_is(store_url):
    """`backend_of` is what a follower reports as `walks_with` (vLLM's `apply` stat): each walker
    names its own backend, and a CPU follower that walks its payloads says it walks them on the CPU."""
    for backend in (ApplyBackend.CPU_WALK, ApplyBackend.TORCH):
        assert apply.backend_of(apply.walker(backend, CPU)) == backend
    assert apply.backend_of(apply.DeviceWalker(CPU)) == ApplyBackend.DEVICE
    publish(store_url)
    assert follower(store_url, Engine(), ApplyBackend.CPU_WALK).walks_with == ApplyBackend.CPU_WALK


def test_a_backend_that_cannot_run_where_it_is_asked_to_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"^the CPU walk writes CPU parameters with numba, not parameters on cuda$"):
        apply.walker(ApplyBackend.CPU_WALK, CUDA)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    interpreter = "the device walk runs on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1)"
    with pytest.raises(ValueError, match=f"^{re.escape(interpreter)}$"):
        apply.walker(ApplyBackend.DEVICE, CPU)
    monkeypatch.setattr(device_walk, "AVAILABLE", False)
    triton = "the device walk needs triton (pip install triton; it ships with CUDA builds of torch)"
    with pytest.raises(ValueError, match=f"^{re.escape(triton)}$"):
        apply.walker(ApplyBackend.DEVICE, CUDA)


def test_on_a_gpu_the_device_walk_leaves_a_payload_naming_a_kept_copy_to_torch():
    """A refused tensor's kept copy is host memory, which a kernel on the GPU cannot write."""
    assert apply.DeviceWalker(CUDA).takes(["qkv", "o"]) and not apply.DeviceWalker(CUDA).takes(["qkv", 0])
    assert apply.DeviceWalker(CPU).takes(["qkv", 0])


class Faulty:
    """A kernel as `device_walk` launches it (`kernel[grid](...)`), made to fail: `raises` (a
    compile or launch error), `wrong` (a write of twice the step), `wrong at 3` (the same, only in
    the variant compiled for `LOW_BYTES == 3`: a miscompile of one variant) or `no undo` (an undo
    that writes nothing)."""

    def __init__(self, kernel: Any, fault: str) -> None:
        self.kernel, self.fault = kernel, fault

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            if self.fault == "raises":
                raise RuntimeError("PTX compilation failed (a stand-in)")
            sign = args[-1]
            fault = "wrong" if self.fault == "wrong at 3" and kwargs["LOW_BYTES"] == 3 else self.fault
            if not kwargs["CHECK"] and fault in ("wrong", "no undo"):
                if sign == -1 and fault == "no undo":
                    return
                args = (*args[:-1], 2 * sign if fault == "wrong" else sign)
            self.kernel[grid](*args, **kwargs)

        return launch


FAULTS = {
    "raises": "the kernels raised RuntimeError: PTX compilation failed",
    "wrong": "the kernels wrote other values than torch's decoder",
    "no undo": "the kernels' undo did not restore every bit",
    "wrong at 3": "the kernels wrote other values than torch's decoder, on a step of 8 changes",
}


def faulty(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    count, decode = device_walk._kernels()
    faults = (Faulty(count, fault), Faulty(decode, fault)) if fault == "raises" else (count, Faulty(decode, fault))
    monkeypatch.setattr(device_walk, "_kernels", lambda: faults)


def test_the_kernels_prove_themselves_against_torch_and_say_what_failed(monkeypatch):
    assert device_walk.prove(CPU) is None
    for fault, said in FAULTS.items():
        with monkeypatch.context() as patched:
            faulty(patched, fault)
            assert said in (device_walk.prove(CPU) or ""), fault


def test_the_proof_runs_every_variant_of_the_kernels_a_real_step_can_launch():
    """The kernels compile apart by `LOW_BYTES` (a sparser payload reads its low bits from more
    bytes): the proof's steps run each, so a variant that alone is wrong fails the proof
    (`wrong at 3` above)."""
    sizes = [(run + device_walk._PROOF_ROWS * device_walk._PROOF_COLUMNS, m) for run, m in device_walk.PROOF_CASES]
    assert [device_walk.low_bytes(elias_fano.low_bits(n, m)) for n, m in sizes] == list(device_walk.LOW_BYTES)
    widest = elias_fano.low_bits(MAX_ELEMENTS, 1)
    assert {device_walk.low_bytes(bits) for bits in range(widest + 1)} == set(device_walk.LOW_BYTES)
    assert all(8 * device_walk.low_bytes(bits) >= bits + 7 for bits in range(widest + 1))  # at any shift


@pytest.mark.parametrize("fault", ["raises", "wrong"])
def test_kernels_that_fail_their_proof_leave_the_follower_on_torch_and_exact(store_url, monkeypatch, caplog, fault):
    """Before the device walk writes anything of the engine's, its kernels run on a synthetic step
    on the device: a kernel that raises, or writes a wrong value, leaves the follower on torch for
    its life, with a warning that says what failed."""
    truth = publish(store_url)
    faulty(monkeypatch, fault)
    engine = Engine()
    with caplog.at_level(logging.WARNING, logger="lightning_delta.apply"):
        live = follower(store_url, engine, ApplyBackend.DEVICE)
    warned = [r.getMessage() for r in caplog.records if r.name == "lightning_delta.apply"]
    said = (  # whole: what failed (and on what step, `FAULTS` gives its start), what the follower does, what to report
        re.escape(f"lightning_delta: the device walk's Triton kernels failed their proof on cpu ({FAULTS[fault]}")
        + r"[^()]*(\(a stand-in\))?"
        + re.escape(
            "): this follower writes every step with torch instead (ApplyBackend.TORCH, exact, slower); please "
            "report it with your GPU, torch and triton versions"
        )
    )
    assert len(warned) == 1 and re.fullmatch(said, warned[0]), warned
    assert live.walks_with == ApplyBackend.TORCH
    walked = []
    monkeypatch.setattr(device_walk.DeviceWalk, "apply", lambda walk: walked.append(walk))
    for step in (1, 2, 3, 4):
        prepared, _, _ = live.update(step)
        assert prepared.step == step and exact(engine, truth[step])
    assert walked == []


def test_a_cuda_device_named_without_an_index_is_walked_on_the_current_one(monkeypatch):
    """A table's parameters are on one device, by index: `cuda` alone is the current device."""
    proved: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(device_walk, "prove", lambda device: proved.append(device))  # None: the kernels passed
    walker = apply.walker(ApplyBackend.DEVICE, CUDA)
    assert isinstance(walker, apply.DeviceWalker) and walker.device == torch.device("cuda", 1) == proved[0]
    assert len(proved) == 1


def test_a_failed_proof_that_broke_the_cuda_context_is_an_error_at_init_not_a_fallback(monkeypatch):
    """After a kernel's illegal address the context is gone: torch could not write either, so
    the follower refuses to start rather than promise torch."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(device_walk, "prove", lambda device: "the kernels raised RuntimeError: illegal address")
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: synced.append(device))
    assert isinstance(apply.walker(ApplyBackend.DEVICE, gpu), apply.TorchWalker)  # the context survived: torch
    assert synced == [gpu]

    error = "CUDA error: an illegal memory access was encountered" + " (the driver's report)" * 20

    def broken(device: torch.device) -> None:
        raise RuntimeError(error)

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    message = (
        "the device walk's Triton kernels failed their proof on cuda:0 (the kernels raised RuntimeError: illegal "
        f"address) and left its CUDA context broken (RuntimeError: {error[:300]}): nothing can write there, torch "
        "included; restart the process, with apply=ApplyBackend.TORCH (init_info apply: torch) to skip the "
        "kernels, and please report it with your GPU, torch and triton versions"
    )
    with pytest.raises(DeviceError, match=f"^{re.escape(message)}$"):
        apply.walker(ApplyBackend.DEVICE, gpu)


def test_a_worker_whose_peer_failed_the_proof_reports_torch_and_names_it(store_url, monkeypatch, caplog):
    """The group walks only what every worker walks: where another worker walks no payload (its
    walker takes none of them), this one decodes them with torch too (`torch_path`), and says so
    and which worker.  (A worker whose kernels failed their proof walks every payload with the torch
    walk, beside its peers' device walks.)"""
    truth = publish(store_url)
    monkeypatch.setattr(plan, "gather_json", lambda group, mine: [mine, []])  # worker 1: walks nothing
    engine = Engine()
    with caplog.at_level(logging.WARNING, logger="lightning_delta.plan"):
        live = follower(store_url, engine, ApplyBackend.DEVICE)
    assert "workers [1] of the group walk no payload" in caplog.text
    assert live.walks_with == ApplyBackend.TORCH
    walked = []
    monkeypatch.setattr(device_walk.DeviceWalk, "apply", lambda walk: walked.append(walk))
    for step in (1, 2, 3):
        live.update(step)
        assert exact(engine, truth[step])
    assert walked == []


def test_a_step_the_device_walk_wrote_and_its_check_refused_is_taken_back_with_its_kernels_trusted(
    store_url, monkeypatch
):
    """The undo itself, not the proof, restores the engine: with the proof taken as passed (so a
    broken undo is not caught there first), a step whose one value only the trainer's checksum
    catches is walked in, refused, and taken back to the last bit (`scripts/mutants.py`'s
    device-undo)."""
    truth = publish(store_url)
    forge_value(Store(store_url), 3)
    monkeypatch.setattr(device_walk, "prove", lambda device: None)
    engine = Engine()
    live = follower(store_url, engine, ApplyBackend.DEVICE)
    assert live.walks_with == ApplyBackend.DEVICE
    live.write(live.prepare(2))
    before = {k: v.clone() for k, v in engine.state().items()}
    with pytest.raises(ChecksumError, match=f"step 3: payload 0 .*{MESSAGE}"):
        live.update(3)
    assert all(torch.equal(before[k], v) for k, v in engine.state().items())
    live.write(live.prepare(5))
    assert exact(engine, truth[5])


def test_a_follower_told_to_use_torch_walks_with_torch_alone(store_url, monkeypatch):
    counted = []
    for cls in (sparse_walk.Walk, device_walk.DeviceWalk):
        monkeypatch.setattr(cls, "apply", lambda walk: counted.append(walk))
    torch_walks, walk_apply = [], torch_walk.TorchWalk.apply
    monkeypatch.setattr(torch_walk.TorchWalk, "apply", lambda walk: torch_walks.append(walk) or walk_apply(walk))
    truth = publish(store_url)
    engine = Engine()
    live = follower(store_url, engine, ApplyBackend.TORCH)
    assert live.walks_with == ApplyBackend.TORCH
    for step in (1, 2, 3):
        live.update(step)
        assert exact(engine, truth[step])
    assert counted == [] and len(torch_walks) == 2  # the steps in sync, 2 and 3, through the protocol


@st.composite
def steps(draw):
    """Payloads of one step, each with its table over parameters of its own, the payload whose
    expected checksum move is off by one (a value only its checksum catches; -1: none), a seed."""
    cases = draw(st.lists(walks(), min_size=1, max_size=2))
    return cases, draw(st.integers(-1, len(cases) - 1)), draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps())
def test_a_step_is_written_by_every_walk_alike_or_taken_back_by_each_to_the_last_bit(case):
    cases, forged, seed = case
    g = torch.Generator().manual_seed(seed)
    before, payloads = {}, []
    for key, (old, new, table, sizes) in enumerate(cases):
        data = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
        packed = codec.parse(data, old.numel())
        if packed.mode != Mode.SPARSE:
            continue
        names = tuple(f"{key}.{j}" for j in range(len(sizes)))
        for name, size in zip(names, sizes, strict=True):
            before[name] = torch.randint(-32768, 32768, (size,), generator=g, dtype=torch.int16)
        segments = sparse_walk.Segments(np.asarray(table, dtype=np.int64), old.numel())
        payloads.append(Payload((0, key), data, old.numel(), torch.bfloat16, packed.m, segments, names, 0, f"p {key}"))
    if not payloads:
        return
    # what each payload moves the owned checksum by, from the CPU walk on a copy
    held = {name: t.clone() for name, t in before.items()}
    moved = apply.check(apply.CpuWalker(), payloads, held.__getitem__)
    assert apply.check(apply.DeviceWalker(CPU), payloads, held.__getitem__) == moved
    assert apply.check(apply.TorchWalker(CPU), payloads, held.__getitem__) == moved
    assert all(torch.equal(held[name], t) for name, t in before.items())  # a check writes nothing
    payloads = [
        dataclasses.replace(p, moved=(m + (1 if i == forged else 0)) & MASK64)
        for i, (p, m) in enumerate(zip(payloads, moved, strict=True))
    ]
    written = []
    for walker in (apply.CpuWalker(), apply.DeviceWalker(CPU), apply.TorchWalker(CPU)):
        held = {name: t.clone() for name, t in before.items()}
        if 0 <= forged < len(payloads):
            tail = "; nothing was written, and the next step is written whole"
            whole = f"^{payloads[forged].where} does not reproduce .*{tail}$"
            with pytest.raises(ChecksumError, match=whole):
                apply.apply(walker, payloads, held.__getitem__, None)
            assert all(torch.equal(held[name], t) for name, t in before.items())  # every walk taken back
        else:
            assert apply.apply(walker, payloads, held.__getitem__, None) == set()  # no kept copies named
        written.append(held)
    assert all(torch.equal(written[0][name], w[name]) for w in written[1:] for name in before)


def test_a_payload_the_device_walk_refuses_names_itself_and_nothing_is_written():
    old = torch.zeros(64, dtype=torch.int16)
    new = old.clone()
    new[[3, 9]] = 1
    data = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
    packed = codec.parse(data, 64)
    table = sparse_walk.Segments(np.array([[0, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 64)
    good = Payload((0, 0), data, 64, torch.bfloat16, packed.m, table, ("w",), 0, "rank 0 payload 0")
    sections = list(packed.sections)
    sections[1] = torch.zeros_like(sections[1])  # no high bit set: fewer changes than the header says
    hostile = codec.serialize(dataclasses.replace(packed, sections=tuple(sections)), UNCOMPRESSED)
    bad = dataclasses.replace(good, key=(0, 1), data=hostile, names=("v",), where="rank 0 payload 1")
    held = {"w": torch.zeros(64, dtype=torch.int16), "v": torch.zeros(64, dtype=torch.int16)}
    with pytest.raises(FormatError, match=r"rank 0 payload 1: .*fewer changes"):
        apply.apply(apply.DeviceWalker(CPU), [good, bad], held.__getitem__, None)
    assert not held["w"].any() and not held["v"].any()
    with pytest.raises(FormatError):  # torch's decoder refuses it too, after the good payload was walked in
        apply.apply(apply.TorchWalker(CPU), [good, bad], held.__getitem__, None)
    assert not held["w"].any() and not held["v"].any()


@pytest.mark.parametrize("backend", list(ApplyBackend))
def test_a_payload_that_fails_after_a_chunk_is_walked_in_leaves_nothing_written(backend):
    """The bad payload's high bits lose one set bit: its first changes decode (and are written)
    before the count falls short of the header's, after a good payload was walked in.  Every walk
    is taken back, the bad one without decoding past what it wrote: `FormatError`, nothing written."""
    old = torch.zeros(64, dtype=torch.int16)
    new = old.clone()
    new[[3, 9, 40]] = 1
    data = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
    packed = codec.parse(data, 64)
    table = sparse_walk.Segments(np.array([[0, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 64)
    good = Payload((0, 0), data, 64, torch.bfloat16, packed.m, table, ("w",), 0, "rank 0 payload 0")
    [moved] = apply.check(apply.CpuWalker(), [good], {"w": old}.__getitem__)
    good = dataclasses.replace(good, moved=moved)
    sections = list(packed.sections)
    high = sections[1].clone()
    last = int(high.nonzero()[-1])
    high[last] = int(high[last]) & (int(high[last]) - 1)  # its lowest set bit cleared: the last change lost
    sections[1] = high
    hostile = codec.serialize(dataclasses.replace(packed, sections=tuple(sections)), UNCOMPRESSED)
    bad = dataclasses.replace(good, key=(0, 1), data=hostile, names=("v",), where="rank 0 payload 1")
    held = {"w": torch.zeros(64, dtype=torch.int16), "v": torch.zeros(64, dtype=torch.int16)}
    written = []
    undo = torch_walk.TorchWalk.undo

    def watched(walk: torch_walk.TorchWalk) -> None:
        written.append(held["v"].count_nonzero().item())
        undo(walk)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_walk.TorchWalk, "undo", watched)
        with pytest.raises(FormatError):
            apply.apply(apply.walker(backend, CPU), [good, bad], held.__getitem__, None)
    assert not held["w"].any() and not held["v"].any()
    if backend == ApplyBackend.TORCH:
        assert written[0] > 0  # the bad payload's first changes were written before it raised


def test_every_walk_is_taken_back_past_an_undo_that_raised_and_the_follower_holds_no_step(
    store_url, monkeypatch, caplog
):
    """An undo that raises (out of memory, say) leaves its own payload written in part: the walks
    before it are taken back all the same, `UndoError` says so, and the follower holds no step, so
    that its next write loads a base."""
    old = torch.zeros(64, dtype=torch.int16)
    new = old.clone()
    new[[3, 9]] = 1
    data = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
    table = sparse_walk.Segments(np.array([[0, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 64)
    first = Payload((0, 0), data, 64, torch.bfloat16, 2, table, ("w",), 0, "rank 0 payload 0")
    [moved] = apply.check(apply.TorchWalker(CPU), [first], {"w": old}.__getitem__)
    first = dataclasses.replace(first, moved=moved)
    second = dataclasses.replace(first, key=(0, 1), names=("v",), moved=moved + 1, where="rank 0 payload 1")
    held = {"w": torch.zeros(64, dtype=torch.int16), "v": torch.zeros(64, dtype=torch.int16)}
    undo = torch_walk.TorchWalk.undo

    def fails_on_v(walk: torch_walk.TorchWalk) -> None:
        if walk._targets[0] is held["v"]:
            raise torch.OutOfMemoryError("no memory for the undo")
        undo(walk)

    monkeypatch.setattr(torch_walk.TorchWalk, "undo", fails_on_v)
    with pytest.raises(apply.UndoError, match=r"ChecksumError: rank 0 payload 1 .* could not be taken back \(Out"):
        apply.apply(apply.TorchWalker(CPU), [first, second], held.__getitem__, None)
    assert not held["w"].any() and torch.equal(held["v"], new)

    truth = publish(store_url)
    forge_value(Store(store_url), 3)
    engine = Engine()
    live = follower(store_url, engine, ApplyBackend.TORCH)
    live.write(live.prepare(2))
    monkeypatch.setattr(torch_walk.TorchWalk, "undo", lambda walk: (_ for _ in ()).throw(RuntimeError("no undo")))
    with caplog.at_level(logging.WARNING, logger="lightning_delta.engine"), pytest.raises(ChecksumError):
        live.update(3)  # the re-sync from a base then meets the forged value
    assert "could not be taken back (RuntimeError: no undo)" in caplog.text and "re-syncing step 3" in caplog.text
    assert live.held_step is None
    monkeypatch.setattr(torch_walk.TorchWalk, "undo", undo)
    live.write(live.prepare(5))
    assert exact(engine, truth[5])


def _two_rows() -> tuple[Payload, dict[str, torch.Tensor]]:
    """A one-chunk SPARSE payload whose two changes lie in two rows (two parameters, "w" and "v"),
    and the zeroed parameters it walks into."""
    old = torch.zeros(64, dtype=torch.int16)
    new = old.clone()
    new[[3, 40]] = 1
    data = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
    rows = [[0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], [32, 64, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1]]
    table = sparse_walk.Segments(np.array(rows, dtype=np.int64), 64)
    payload = Payload((0, 0), data, 64, torch.bfloat16, 2, table, ("w", "v"), 0, "rank 0 payload 0")
    return payload, {"w": torch.zeros(32, dtype=torch.int16), "v": torch.zeros(32, dtype=torch.int16)}


def test_a_chunk_the_torch_walk_fails_partway_through_is_not_written_at_all(monkeypatch):
    """A chunk spanning two rows (two parameters) whose second row's hash runs out of memory: the
    first row is not written either, as `apply`'s undo counts whole chunks."""
    payload, held = _two_rows()
    calls, update = [], torch_walk.checksum_update

    def second_fails(*args: Any) -> int:
        calls.append(args)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("out of memory on the second row")
        return update(*args)

    monkeypatch.setattr(torch_walk, "checksum_update", second_fails)
    with pytest.raises(torch.OutOfMemoryError):
        apply.apply(apply.TorchWalker(CPU), [payload], held.__getitem__, None)
    assert len(calls) == 2 and not held["w"].any() and not held["v"].any()


def test_a_chunk_whose_write_fails_between_two_rows_is_taken_back_whole(monkeypatch):
    """The same chunk, whose second row's write runs out of memory after its first row was
    written: `apply`'s undo takes the first row back too, though the chunk was not counted."""
    payload, held = _two_rows()
    written, index_add = [], torch.Tensor.index_add_

    def second_fails(self: torch.Tensor, *args: Any) -> torch.Tensor:
        written.append(self.data_ptr())
        if self is held["v"]:
            raise torch.OutOfMemoryError("out of memory writing the second row")
        return index_add(self, *args)

    monkeypatch.setattr(torch.Tensor, "index_add_", second_fails)
    with pytest.raises(torch.OutOfMemoryError):
        apply.apply(apply.TorchWalker(CPU), [payload], held.__getitem__, None)
    assert written[:2] == [held["w"].data_ptr(), held["v"].data_ptr()]  # "w" was written, then taken back
    assert not held["w"].any() and not held["v"].any()


def test_a_walk_that_raises_outside_the_library_raises_a_delta_error_and_holds_no_step(store_url, monkeypatch):
    """Without a group, out of memory inside the torch walk reaches `write`'s caller (the vLLM
    backend catches `DeltaError`) as a `DeltaError` naming it; the step is taken back, the
    follower holds none, and the next step loads from a base."""
    truth = publish(store_url)
    engine = Engine()
    live = follower(store_url, engine, ApplyBackend.TORCH)
    live.write(live.prepare(2))
    before = {k: v.clone() for k, v in engine.state().items()}
    walk_apply = torch_walk.TorchWalk.apply

    def oom(walk: torch_walk.TorchWalk) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch_walk.TorchWalk, "apply", oom)
    with pytest.raises(DeltaError, match="OutOfMemoryError: CUDA out of memory"):
        live.write(live.prepare(3))
    assert live.held_step is None
    assert all(torch.equal(before[k], v) for k, v in engine.state().items())
    monkeypatch.setattr(torch_walk.TorchWalk, "apply", walk_apply)
    live.write(live.prepare(4))
    assert exact(engine, truth[4])


def test_the_torch_walk_finds_each_rows_changes_with_one_search_a_chunk():
    """A chunk's positions ascend, so each row's changes are one slice: the rows' bounds are
    searched at once, one wait for the device a chunk, never one a row, to find them (the checksum
    moves, in checksum.py, still wait a row)."""
    old = torch.zeros(64, dtype=torch.int16)
    new = old.clone()
    new[::3] = 1
    data = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
    rows = [[lo, lo + 4, lo // 4, 0, 0, 0, 0, 0, 0, 0, 0, 1] for lo in range(0, 64, 4)]  # 16 parameters
    table = sparse_walk.Segments(np.array(rows, dtype=np.int64), 64)
    names = tuple(str(p) for p in range(16))
    payload = Payload((0, 0), data, 64, torch.bfloat16, 22, table, names, 0, "rank 0 payload 0")
    held = {name: torch.zeros(4, dtype=torch.int16) for name in names}
    walk = apply.TorchWalker(CPU).walk(payload, [held[n] for n in names])
    with audited() as syncs:
        walk.apply()
    assert [w for w in syncs.seen if "torch_walk.py" in w[1]] == [("Tensor.tolist", ANY)]
    assert torch.equal(torch.cat([held[n] for n in names]), new)


def test_a_group_walking_with_torch_exchanges_no_tables_for_whole_walks(monkeypatch):
    """With apply=torch no base step is walked whole (`Plan.walks_whole`), so no worker sends its
    tables to the others for one; with a walk that does, every worker does."""
    exchanged = []
    monkeypatch.setattr(scatter, "peer_tables", lambda tables, group: exchanged.append(tables) or {})
    decisions = group.Decisions(None)
    decisions.group = object()  # type: ignore[assignment]  # a group's worker, as far as the writer asks
    tables = {(0, 0): "its table"}
    for walks_whole in (False, True):
        plan_ = SimpleNamespace(walks_whole=walks_whole, device=CPU, tables=tables)
        whole_write.WholeWriter(plan_, decisions)  # type: ignore[arg-type]
    assert exchanged == [tables]


def test_without_a_group_a_worker_decides_alone():
    assert group.sum_partials(None, [1, MASK64 + 2]) == [1, 1]
    assert group.decide(None, 7) == [7]
    with pytest.raises(KeyError):
        group.sum_partials(None, [1], KeyError("the failure"))


def two_changes() -> Payload:
    """A SPARSE payload of 64 zeros whose elements 3 and 9 become 1, its table one run of a parameter."""
    old = torch.zeros(64, dtype=torch.int16)
    new = old.clone()
    new[[3, 9]] = 1
    data = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
    table = sparse_walk.Segments(np.array([[0, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 64)
    return Payload((0, 0), data, 64, torch.bfloat16, 2, table, ("w",), 0, "rank 0 step 2: payload 0")


@pytest.mark.parametrize("backend", [ApplyBackend.CPU_WALK, ApplyBackend.TORCH])
def test_a_walk_undone_or_asked_what_it_wrote_before_it_applied_writes_nothing(backend):
    """`_undo` takes back every walk the step made; one that never applied has nothing to take back,
    checked (its changes hashed, none written) or not."""
    target = torch.zeros(64, dtype=torch.int16)
    walk = apply.walker(backend, CPU).walk(two_changes(), [target])
    walk.undo()
    assert not walk.wrote(0) and not target.any()
    walk.check()
    walk.undo()
    assert not walk.wrote(0) and not target.any()


@pytest.mark.parametrize("backend", [ApplyBackend.CPU_WALK, ApplyBackend.TORCH])
@pytest.mark.parametrize("disagrees", ["changed", "dtype"])
def test_a_payload_that_disagrees_with_its_header_is_refused_and_the_walks_before_it_taken_back(backend, disagrees):
    """A payload refused before its walk wrote anything (it changes another count of elements, or
    holds another type, than its part's header says) is the step's error, and the payloads walked
    before it are taken back: its own walk has nothing to undo (an undo that parsed it again would
    raise `UndoError`)."""
    old, good = torch.zeros(64, dtype=torch.int16), two_changes()
    bad = dataclasses.replace(good, key=(0, 1), names=("v",), where="rank 0 step 2: payload 1")
    bad, message = {
        "changed": (dataclasses.replace(bad, changed=3), "changes 2 elements, its header says 3"),
        "dtype": (dataclasses.replace(bad, dtype=torch.float16), "is torch.bfloat16, expected torch.float16"),
    }[disagrees]
    walker = apply.walker(backend, CPU)
    [moved, _] = apply.check(walker, [good, good], {"w": old, "v": old}.__getitem__)
    targets = {"w": torch.zeros(64, dtype=torch.int16), "v": torch.zeros(64, dtype=torch.int16)}
    with pytest.raises(FormatError, match=f"^{re.escape('rank 0 step 2: payload 1 ' + message)}$"):
        apply.apply(walker, [dataclasses.replace(good, moved=moved), bad], targets.__getitem__, None)
    assert not targets["w"].any() and not targets["v"].any()


def test_the_device_walks_table_is_copied_once_while_its_parameters_stay(monkeypatch):
    """A payload's table is copied to the device at its first walk, and again only when a parameter
    it names moved (the engine replaced it): every step in sync walks each payload once."""
    payload = two_changes()
    copied = []
    copy = device_walk.DeviceTable
    monkeypatch.setattr(device_walk, "DeviceTable", lambda *args: copied.append(args) or copy(*args))
    walker, param = apply.DeviceWalker(CPU), torch.zeros(64, dtype=torch.int16)
    for _ in range(3):
        walker.walk(payload, [param])
    assert len(copied) == 1
    walker.walk(payload, [torch.zeros(64, dtype=torch.int16)])  # replaced: another address
    walker.walk(payload, [param])  # and back
    assert len(copied) == 3


def test_the_device_walks_tables_hold_no_parameter_and_follow_one_replaced():
    """A table is cached per payload and holds addresses, not tensors: a parameter the engine
    replaced is freed, its replacement gets a table of its own, and a target that no longer fits
    where the table was built is refused, never written past."""
    old, payload = torch.zeros(64, dtype=torch.int16), two_changes()
    new = old.clone()
    new[[3, 9]] = 1
    walker = apply.DeviceWalker(CPU)
    [moved] = apply.check(walker, [payload], {"w": old}.__getitem__)
    payload = dataclasses.replace(payload, moved=moved)
    param = torch.zeros(64, dtype=torch.int16)
    replaced = weakref.ref(param)
    apply.apply(walker, [payload], {"w": param}.__getitem__, None)
    assert torch.equal(param, new)
    del param
    gc.collect()
    assert replaced() is None  # the cached table did not keep it
    again = torch.zeros(64, dtype=torch.int16)
    apply.apply(walker, [payload], {"w": again}.__getitem__, None)
    assert torch.equal(again, new)
    base = torch.zeros(128, dtype=torch.int16)
    apply.apply(walker, [payload], {"w": base[:64]}.__getitem__, None)
    with pytest.raises(ValueError, match="which hold"):  # same address, fewer elements: a table of its own
        walker.walk(payload, [base[:32]])
    # a walk, unlike its table, holds its targets: its undo writes them by address
    target = torch.zeros(64, dtype=torch.int16)
    held = weakref.ref(target)
    walk = walker.walk(payload, [target])
    walk.apply()
    del target
    gc.collect()
    assert held() is not None
    walk.undo()
    assert not held().any()  # type: ignore[union-attr]
    del walk
    gc.collect()
    assert held() is None
