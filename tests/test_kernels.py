"""The device walk's Triton kernels (`device_walk`, `kernels`), on the CPU under the interpreter:
the same writes, partial sums and refusals as the CPU walk and torch's decoder, an exact undo, no
write at all for a refused payload; and the sync audit, which fails where a device path waits
for the device before its decision."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before they are imported

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import needs
from lightning_delta import (
    DeltaLoader,
    DeltaPublisher,
    PublisherSettings,
    apply,
    bitpack,
    codec,
    device_walk,
    elias_fano,
    sparse_walk,
)
from lightning_delta.apply import ApplyBackend
from lightning_delta.checksum import checksum_at
from lightning_delta.codec import Mode
from lightning_delta.errors import FormatError
from test_engine import Engine, exact, follower, publish
from test_sparse_walk import UNCOMPRESSED, bits, hostile, place, walks

needs("triton")

MASK64 = (1 << 64) - 1
WHOLE = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]  # a run over the whole payload, owned (lo, hi set per case)


def whole(n: int) -> sparse_walk.Segments:
    return sparse_walk.Segments(np.array([[0, n, *WHOLE[2:]]], dtype=np.int64).reshape(-1, 12), n)


def walk_of(packed: codec.Packed, segments: sparse_walk.Segments, params: list[torch.Tensor]) -> Any:
    return device_walk.DeviceWalk(packed, device_walk.DeviceTable(segments, params, torch.device("cpu")), params)


def held_sums(
    table: np.ndarray, params: list[torch.Tensor], index: torch.Tensor, step: torch.Tensor
) -> tuple[int, int]:
    """checksum.py's share of the owned held changes' old and new values, found by the table's
    definition (`place`) and torch: what a worker's partial sums must be."""
    owned = [(j, place(table, p)) for j, p in enumerate(index.tolist())]
    owned = [(j, held) for j, held in owned if held is not None and held[2]]
    if not owned:
        return 0, 0
    at = torch.tensor([index[j] for j, _ in owned])
    old = torch.stack([params[param][element] for _, (param, element, _) in owned])
    new = old + torch.stack([step[j] for j, _ in owned])  # int16 wraps, as a step does
    return checksum_at(old, at), checksum_at(new, at)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks(), st.integers(0, 2**16))
def test_the_kernels_write_and_hash_what_the_cpu_walk_and_torch_do_and_undo_it_exactly(case, seed):
    old, new, table, sizes = case
    payload = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
    packed = codec.parse(payload, old.numel())
    if packed.mode != Mode.SPARSE:
        return  # coded whole: not walked
    g = torch.Generator().manual_seed(seed)
    params = [torch.randint(-32768, 32768, (size,), generator=g, dtype=torch.int16) for size in sizes]
    before = [p.clone() for p in params]
    steps = codec.decode_steps(
        payload, numel=old.numel(), dtype=torch.bfloat16, device=torch.device("cpu"), exponents=None
    )
    assert steps.index is not None and steps.step is not None
    expected_old, expected_new = held_sums(table, params, steps.index, steps.step)
    segments = sparse_walk.Segments(table, packed.n)
    walked = [p.clone() for p in params]
    cpu = sparse_walk.Walk(packed, segments, [p.numpy() for p in walked])
    moved = cpu.apply()

    walk = walk_of(packed, segments, params)
    status, old_sum, new_sum = walk.check().tolist()
    assert (status, old_sum & MASK64, new_sum & MASK64) == (0, expected_old, expected_new)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))  # a check writes nothing
    result = walk.apply()
    assert all(torch.equal(a, b) for a, b in zip(params, walked, strict=True))  # the CPU walk's writes
    assert device_walk.decide(result.tolist()) == moved == (expected_new - expected_old) & MASK64
    assert [walk.wrote(p) for p in range(len(params))] == [cpu.wrote(p) for p in range(len(params))]
    walk.undo()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile())
def test_a_hostile_payload_is_refused_where_the_walk_refuses_it_and_nothing_is_written(packed):
    if packed.mode != Mode.SPARSE:
        return
    payload = codec.serialize(packed, UNCOMPRESSED)
    try:
        steps = codec.decode_steps(
            payload, numel=packed.n, dtype=torch.bfloat16, device=torch.device("cpu"), exponents=None
        )
    except FormatError:
        steps = None
    parsed = codec.parse(payload, packed.n)
    cpu = torch.randint(-32768, 32768, (packed.n,), dtype=torch.int16)
    held, before = cpu.clone(), cpu.clone()
    try:
        sparse_walk.Walk(parsed, whole(packed.n), [cpu.numpy()]).apply()
        refused = False
    except FormatError:
        refused = True
    assert refused == (steps is None)  # the premise: the walk refuses where torch does
    walk = walk_of(parsed, whole(packed.n), [held])
    result = walk.apply()
    if refused:
        with pytest.raises(FormatError):
            device_walk.decide(result.tolist())
        assert torch.equal(held, before)  # not even the changes before the bad one
        walk.undo()
        assert torch.equal(held, before)
    else:
        assert steps is not None and steps.index is not None and steps.step is not None
        assert torch.equal(held, cpu)
        expected = before.clone()
        expected[steps.index] += steps.step
        assert torch.equal(held, expected)
        assert (
            device_walk.decide(result.tolist())
            == (checksum_at(expected[steps.index], steps.index) - checksum_at(before[steps.index], steps.index))
            & MASK64
        )


def one_change(n: int, bucket: int, low: int) -> codec.Packed:
    """A payload of `n` positions with one change, +1, at `bucket << low_bits | low`: past the
    end where the last bucket holds positions `n` and over, or the bucket is past the last."""
    low_bits = elias_fano.low_bits(n, 1)
    high = torch.zeros(elias_fano.high_len(n, 1, low_bits), dtype=torch.bool)
    high[bucket] = True  # after `bucket` zeros: each ends a bucket
    sections = (
        bitpack.pack_fixed(torch.tensor([low]), low_bits) if low_bits else torch.empty(0, dtype=torch.uint8),
        bitpack.pack_bits(high),
        bitpack.pack_bits(torch.tensor([True])),
        bitpack.pack_bits(torch.tensor([True])),
        torch.empty(0, dtype=torch.uint8),
    )
    packed = codec.Packed(Mode.SPARSE, codec.ValueCoding.SPLIT, low_bits, torch.bfloat16, n, 1, 0, sections)
    return codec.parse(codec.serialize(packed, UNCOMPRESSED), n)


@pytest.mark.parametrize("n", [70, 100, 1000])
def test_a_position_past_the_end_is_refused_where_the_walk_refuses_it_and_never_written(n):
    low_bits = elias_fano.low_bits(n, 1)
    last = (n - 1) >> low_bits  # the last bucket
    param = torch.zeros((last + 2) << low_bits, dtype=torch.int16)  # room past the payload: a stray store would land
    table = sparse_walk.Segments(np.array([[0, n, *WHOLE[2:]]], dtype=np.int64), n)
    for bucket, low in ((last, (n - 1) & ((1 << low_bits) - 1)), (last, (1 << low_bits) - 1), (last + 1, 0)):
        packed, position = one_change(n, bucket, low), bucket << low_bits | low
        try:
            sparse_walk.Walk(packed, table, [np.zeros(n, dtype=np.int16)]).apply()
            refused = False
        except FormatError:
            refused = True
        assert refused == (position >= n)
        walk = walk_of(packed, table, [param])
        result = walk.apply()
        if position < n:  # the largest position in the payload
            assert device_walk.decide(result.tolist()) != 0 and param[position] == 1 and param.sum() == 1
            walk.undo()
        else:
            with pytest.raises(FormatError, match="out of range"):
                device_walk.decide(result.tolist())
        assert not param.any()


def test_a_table_or_parameters_that_do_not_fit_are_refused():
    packed = codec.parse(
        codec.encode(bits([0] * 64).view(torch.bfloat16), bits([1] + [0] * 63).view(torch.bfloat16)), 64
    )
    cpu = torch.device("cpu")
    with pytest.raises(ValueError):  # a parameter one element short
        device_walk.DeviceTable(whole(64), [torch.zeros(63, dtype=torch.int16)], cpu)
    with pytest.raises(ValueError):  # not int16
        device_walk.DeviceTable(whole(64), [torch.zeros(64, dtype=torch.float32)], cpu)
    longer, held = [torch.zeros(65, dtype=torch.int16)], [torch.zeros(64, dtype=torch.int16)]
    with pytest.raises(ValueError):  # a table for payloads of another size
        device_walk.DeviceWalk(packed, device_walk.DeviceTable(whole(65), longer, cpu), longer)
    raw = codec.parse(codec.encode(None, bits(list(range(64))).view(torch.bfloat16)), 64)
    with pytest.raises(ValueError):
        device_walk.DeviceWalk(raw, device_walk.DeviceTable(whole(64), held, cpu), held)
    with pytest.raises(ValueError, match="do not lie where"):  # targets other than the table's
        device_walk.DeviceWalk(
            packed, device_walk.DeviceTable(whole(64), held, cpu), [torch.zeros(64, dtype=torch.int16)]
        )


# ---------------------------------------------------------------------------------- the sync audit

_WAITS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), bool(), int(), float() of a tensor
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.repeat_interleave.Tensor,
    torch.ops.aten.equal.default,
}
_MASK_INDEXED = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default}
_HOST_READS = ("tolist", "numpy", "cpu")
"""Tensor methods that bring data to the host: on the CPU they dispatch nothing, so they are wrapped.
A blocking copy shows up as one of these (or as `.item()`); `.to(device)` is not wrapped, since
a copy to the device does not wait."""
_TORCH = str(Path(torch.__file__).parent)
_INTERPRETER = "triton" + os.sep


def _audit(code: Any) -> bool:
    return code.co_filename == __file__ and code.co_name in ("read", "note", "__torch_dispatch__")


class Syncs(TorchDispatchMode):
    """What waits for the device, called on this thread from anywhere but torch and the Triton
    interpreter (whose host copies are its way of running a kernel on the CPU, absent on a GPU):
    `seen` lists each as (what, file:line)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []
        self._thread = threading.get_ident()
        self.reading = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        indices = args[1] if func in _MASK_INDEXED and len(args) > 1 else ()
        if func in _WAITS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            self.note(str(func))
        return func(*args, **(kwargs or {}))

    def note(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            return
        frame = sys._getframe(1)  # the caller: past the audit's wrappers and torch's own frames
        while frame is not None and (_audit(frame.f_code) or frame.f_code.co_filename.startswith(_TORCH)):
            frame = frame.f_back
        if frame is not None and _INTERPRETER not in frame.f_code.co_filename:
            self.seen.append((what, f"{frame.f_code.co_filename}:{frame.f_lineno}"))


@contextmanager
def audited() -> Iterator[Syncs]:
    syncs = Syncs()
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def wrapped(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if syncs.reading:  # a subclass's __torch_function__ calls the method again: one read
                return method(self, *args, **kwargs)
            syncs.note(f"Tensor.{name}")
            syncs.reading = True
            try:
                return method(self, *args, **kwargs)
            finally:
                syncs.reading = False

        return read

    try:
        for name, method in originals.items():
            setattr(torch.Tensor, name, wrapped(name, method))
        with syncs:
            yield syncs
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def a_step() -> tuple[codec.Packed, sparse_walk.Segments, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    old = torch.randint(-32768, 32768, (3000,), generator=g, dtype=torch.int16)
    new = old.clone()
    new[torch.rand(3000, generator=g) < 0.05] += 7
    payload = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16))
    return codec.parse(payload, 3000), whole(3000), old


def test_the_audit_sees_every_kind_of_wait():
    """The audit can fail: each thing it looks for, called once from here."""
    x = torch.arange(8)
    waits: list[Callable[[], object]] = [
        lambda: x[0].item(),
        lambda: x.tolist(),
        lambda: x.numpy(),
        lambda: x.cpu(),
        lambda: bool(x[1]),
        lambda: x.nonzero(),
        lambda: x[x > 3],
        lambda: x.masked_select(x > 3),
        lambda: torch.equal(x, x),
    ]
    for wait in waits:
        with audited() as syncs:
            wait()
        assert len(syncs.seen) == 1, syncs.seen
    with audited() as syncs:  # and what does not wait: device-side work, indexing by position
        y = (x * 2).cumsum(0)[torch.tensor([1, 2])]
        torch.nonzero_static(x > 3, size=4)
        x.index_select(0, y)
    assert syncs.seen == []


def test_a_device_walk_waits_for_the_device_only_at_its_decision():
    packed, segments, old = a_step()
    held = old.clone()
    table = device_walk.DeviceTable(segments, [held], torch.device("cpu"))  # once per plan
    with audited() as syncs:  # the step: walk, apply, a group's sum of the results, the undo
        walk = device_walk.DeviceWalk(packed, table, [held])
        walk.check()
        walk.undo()  # nothing applied: nothing to take back
        checked = held.clone()
        torch.stack([walk.apply(), walk.check()]).sum(0)  # a group's sum of results, on the device
        walk.undo()
    assert syncs.seen == [], syncs.seen
    assert torch.equal(checked, old) and torch.equal(held, old)


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is not on the CPU: the publisher takes its accelerator path
    (mask, count with one transfer, `nonzero_static`) and the audit sees what that path calls."""

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False


@pytest.mark.parametrize(
    "probed",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                strict=True,
                reason="issue 36: publisher.py reads a probe to the host (`.cpu().tolist()`) before the one "
                "transfer of the counts: a publish with a probe waits twice",
            ),
        ),
    ],
)
def test_a_publish_waits_for_the_device_at_most_once(tmp_path, probed):
    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(64, 32, generator=g).to(torch.bfloat16) for i in range(3)}
    tensors = {name: w.as_subclass(OnDevice) for name, w in weights.items()}
    with DeltaPublisher(str(tmp_path), lambda: tensors, PublisherSettings(base_every=100)) as publisher:
        publisher.publish(1)
        for step in (2, 3):
            for w in weights.values():
                w.view(torch.int16)[torch.rand(w.shape, generator=g) < 0.05] += 1
            probe = torch.randn(4, generator=g).as_subclass(OnDevice) if probed else None
            with audited() as syncs:
                publisher.publish(step, probe)
            assert len(syncs.seen) <= 1, syncs.seen


def test_a_publish_on_the_accelerator_path_is_bit_exact(tmp_path):
    """The accelerator path reads each group's values once for its mask, then only the changed
    positions again (a lone slice, from the live fp32 masters) or the kept concatenation (small
    slices): every step, a base's bridge and a step stored RAW rebuild bit for bit."""
    g = torch.Generator().manual_seed(0)
    masters = {
        "big": torch.randn(300_000, generator=g) * 0.02,  # over the small-slice bound: a payload alone
        "w": torch.randn(64, 32, generator=g) * 0.02,
        "norm": torch.randn(100, generator=g),
    }
    truth = {}
    settings = PublisherSettings(base_every=3)  # bases at 1 and 4, the second with a bridge
    with DeltaPublisher(
        str(tmp_path), lambda: {n: t.as_subclass(OnDevice) for n, t in masters.items()}, settings
    ) as pub:
        for step in range(1, 7):
            for t in masters.values():
                if step == 5:  # every element anew: stored RAW, which takes the whole tensor
                    t.copy_(torch.randn(t.shape, generator=g))
                else:
                    t += torch.randn(t.shape, generator=g) * t.abs() * 2**-10
            truth[step] = {n: t.to(torch.bfloat16) for n, t in masters.items()}
            pub.publish(step)
    loader = DeltaLoader(str(tmp_path))
    for step, want in truth.items():
        got = loader.state_dict(step)[1]
        for name, tensor in want.items():
            assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), (step, name)


def test_a_seeded_slice_of_the_kernels_fuzz_target_agrees_with_torch():
    """`scripts/fuzz.py kernels` (the long runs: docs/RELIABILITY.md), a slice: damaged SPARSE
    payloads through the kernels, bit for bit as torch decodes them or refused where it refuses."""
    import fuzz

    counts = fuzz.fuzz_kernels(60, seed=1)
    assert not any(counts[f] for f in fuzz.FAILURES), counts
    assert counts["walked"] > 10 and counts["kernel refused"] > 3, counts


def test_an_engine_update_on_the_device_path_waits_for_the_device_once_at_its_decision(store_url, monkeypatch):
    """The engine follower's whole `update` of a SPARSE step in sync through the device walk
    (fetch, parse, every payload's walk, the group's sums, the decision): nothing waits for the
    device before the decision's one read; after it, only `wrote` (which kept copies changed)."""
    truth = publish(store_url)
    engine = Engine()
    live = follower(store_url, engine, ApplyBackend.DEVICE)
    live.update(2)
    audits: list[Syncs] = []
    settle, wrote = apply.DeviceWalker.settle, device_walk.DeviceWalk.wrote

    def decision(self: Any, payloads: Any, moved: Any) -> list[int]:
        audits[0].seen.append(("the decision", ""))
        return settle(self, payloads, moved)

    def after(self: Any, param: int) -> bool:
        audits[0].seen.append(("wrote", ""))
        return wrote(self, param)

    monkeypatch.setattr(apply.DeviceWalker, "settle", decision)
    monkeypatch.setattr(device_walk.DeviceWalk, "wrote", after)
    with audited() as syncs:
        audits.append(syncs)
        prepared, _, _ = live.update(3)
    assert prepared.walked and exact(engine, truth[3])
    assert [what for what, _ in syncs.seen[:2]] == ["the decision", "Tensor.tolist"], syncs.seen
    assert "apply.py:" in syncs.seen[1][1], syncs.seen  # the decision's own read
    assert {what for what, _ in syncs.seen[2:]} <= {"wrote", "Tensor.tolist"}, syncs.seen
