"""Decoding a payload: what it does (`iter_steps`: every element, or the changed positions and
each one's 16-bit step), against the old tensor in hand (`decode_change`) or only what a caller
reads of it (`decode_patch`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from . import elias_fano
from .bitpack import popcount, positions_of, unpack_bits, unpack_fixed
from .classed import ClassLayout, class_order, exponent_bytes
from .errors import FormatError
from .packed import Change, Mode, Packed, ValueCoding, check_tensor
from .wire import parse

__all__ = ["Decoded", "Patch", "Steps", "decode_change", "decode_patch", "decode_steps", "iter_steps"]

_COMPILED_FROM = 1 << 16
"""Elements from which a RAW payload is assembled on the CPU in one compiled pass (numba): torch's
six passes over int16 temporaries cost several times more, and its threads stall beside other
work; below it a process never imports numba."""


@dataclass(frozen=True)
class Decoded:
    """A decoded tensor and, for SPARSE payloads, the change that produced it."""

    new: Tensor
    change: Change | None


@dataclass(frozen=True)
class Steps:
    """What a payload does: every element (`whole`, RAW), or the changed positions and each one's
    wrapped 16-bit step, `new = old + step mod 2**16` (SPARSE, CLASSED)."""

    index: Tensor | None
    step: Tensor | None
    whole: Tensor | None = None


@dataclass(frozen=True)
class Patch:
    """A payload decoded without the old tensor in hand: the change (SPARSE, CLASSED), or, for a
    RAW payload, every element."""

    change: Change | None
    whole: Tensor | None


def decode_change(
    old: Tensor | None,
    payload: bytes | memoryview,
    *,
    numel: int | None = None,
    dtype: torch.dtype | None = None,
    out: Tensor | None = None,
) -> Decoded:
    """Decode a payload against `old` (None for a RAW payload of `numel` elements of `dtype`).

    The caller always states what it expects, `old`'s size and dtype or `numel` and `dtype`: a
    payload that holds anything else is a `FormatError`, never a tensor of another dtype with
    the same bits (which its checksum could not tell apart).  `out`, if given, receives the
    result (a reused buffer saves the page faults of a fresh one); it must not be `old`, which
    stays untouched either way.
    """
    if old is None:
        if numel is None or dtype is None:
            raise ValueError("decoding without `old` needs the expected `numel` and `dtype`")
    else:
        check_tensor(old)
        if (numel, dtype) != (None, None) and (numel, dtype) != (old.numel(), old.dtype):
            raise ValueError(f"`old` is {old.dtype} of {old.numel()} elements, not {dtype} of {numel}")
        numel, dtype = old.numel(), old.dtype
    device = old.device if old is not None else (out.device if out is not None else torch.device("cpu"))
    if out is not None and (out.shape != (numel,) or out.device != device or out is old or out.dtype != dtype):
        raise ValueError(f"out must be a {dtype} tensor of {numel} elements on {device}, other than `old`")
    bits = old.view(torch.int16) if old is not None else None
    patch = decode_patch(
        payload,
        numel=numel,
        dtype=dtype,
        device=device,
        old_at=None if bits is None else lambda index: bits.index_select(0, index),
        exponents=None if old is None else lambda: exponent_bytes(old),
        out=out,
    )
    if patch.whole is not None:
        return Decoded(patch.whole, None)
    assert patch.change is not None and bits is not None  # decode_patch needs `old_at` for a change
    if out is None:
        out = _empty(numel, dtype, device)
    new = out.view(torch.int16)
    new.copy_(bits)
    new.index_copy_(0, patch.change.index, patch.change.new)
    return Decoded(out, patch.change)


def decode_patch(
    payload: bytes | memoryview,
    *,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    old_at: Callable[[Tensor], Tensor] | None,
    exponents: Callable[[], Tensor] | None,
    out: Tensor | None = None,
) -> Patch:
    """Decode a payload of `numel` elements of `dtype` without the old tensor in hand.

    `old_at(positions)` gives the old int16 bits at ascending positions: a SPARSE payload reads
    only the changed ones, so its work and memory follow the change, not the tensor.  A CLASSED
    payload also needs `exponents()`, the old tensor's exponent bytes (`exponent_bytes`), which
    costs a pass over it and a sort.  A RAW payload needs neither and is decoded into `out` if
    given.  Nothing here writes anywhere else: the caller verifies the patch, then applies it.
    """
    steps = decode_steps(payload, numel=numel, dtype=dtype, device=device, exponents=exponents, out=out)
    if steps.whole is not None:
        return Patch(None, steps.whole)
    if old_at is None:
        raise FormatError("a SPARSE tensor payload needs the previous tensor to decode against")
    assert steps.index is not None and steps.step is not None
    olds = old_at(steps.index)
    return Patch(Change(steps.index, olds, olds + steps.step, numel, dtype), None)


def decode_steps(
    payload: bytes | memoryview,
    *,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    exponents: Callable[[], Tensor] | None,
    out: Tensor | None = None,
) -> Steps:
    """What a payload does, with no old value in hand: every element (RAW), or the changed
    positions and each one's 16-bit step.  A worker that holds only a slice of the old tensor
    applies the steps at the positions it holds; only a CLASSED payload needs `exponents()` of
    the whole old tensor, to find its positions."""
    (steps,) = iter_steps(payload, numel=numel, dtype=dtype, device=device, exponents=exponents, out=out)
    return steps  # unpacked, not `next`: the piece's checks after its yield run too


def iter_steps(
    payload: bytes | memoryview,
    *,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    exponents: Callable[[], Tensor] | None,
    out: Tensor | None = None,
    chunk: int | None = None,
) -> Iterator[Steps]:
    """`decode_steps` in pieces: a SPARSE payload's changes in ascending runs of about `chunk` of
    them (never more than five times that: what it costs to decode is bounded by the chunk, not by
    the tensor); a RAW or CLASSED payload in one piece.  A malformed payload raises `FormatError`
    at the latest when the iterator is exhausted, so a caller that must not act on a bad payload
    consumes every piece first."""
    packed = parse(payload, numel)
    if packed.dtype != dtype:
        raise FormatError(f"tensor payload is {packed.dtype}, expected {dtype}")
    sections = [s.to(device) for s in packed.sections]
    if packed.mode == Mode.RAW:
        if out is not None and out.shape != (numel,):  # the compiled pass writes `out` unchecked
            raise ValueError(f"out must have shape ({numel},), got {tuple(out.shape)}")
        whole = _empty(numel, dtype, device) if out is None else out
        exponent = packed.values == ValueCoding.EXPONENT
        if device.type == "cpu" and numel >= _COMPILED_FROM:  # `parse` sized both planes to `numel`
            first, second = (section.numpy() for section in sections)
            _assemble()(first, second, exponent, whole.detach().view(torch.int16).numpy())
        elif exponent:
            exponent_bits, sign_mantissa = sections[0].to(torch.int16), sections[1].to(torch.int16)
            whole.view(torch.int16).copy_((sign_mantissa & 0x80) << 8 | exponent_bits << 7 | sign_mantissa & 0x7F)
        else:
            pairs = whole.view(torch.uint8).view(-1, 2)
            pairs[:, 0].copy_(sections[0])
            pairs[:, 1].copy_(sections[1])
        yield Steps(None, None, whole)
        return
    m = packed.m
    if m == 0:
        yield Steps(torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.int16, device=device))
        return
    if packed.mode == Mode.CLASSED:
        if exponents is None:
            raise ValueError("a CLASSED payload needs the old tensor's exponents")
        in_class_order = _classed_positions(exponents(), packed, sections[0], sections[1], device)
        index, by_position = torch.sort(in_class_order)
        step, _ = _steps(packed, sections, 0, m, 0, device)
        yield Steps(index, step[by_position])
        return
    yield from _sparse_steps(packed, sections, device, chunk)


def _assembled(first: np.ndarray, second: np.ndarray, exponent: bool, out: np.ndarray) -> None:
    """A RAW payload's elements from its two byte planes, into `out` (int16), in one pass."""
    for j in range(len(out)):
        a, b = np.int32(first[j]), np.int32(second[j])
        value = ((b & 0x80) << 8) | (a << 7) | (b & 0x7F) if exponent else a | (b << 8)
        out[j] = value  # the low 16 bits, as int16


@functools.cache
def _assemble() -> Callable[[np.ndarray, np.ndarray, bool, np.ndarray], None]:
    import numba

    return numba.njit(cache=True, nogil=True, boundscheck=False)(_assembled)


def _sparse_steps(packed: Packed, sections: list[Tensor], device: torch.device, chunk: int | None) -> Iterator[Steps]:
    """A SPARSE payload's changes, a run of the unary high bits at a time: each set bit there is one
    change, and a run spans `chunk` changes' worth of bits on average (`high_len / m`, under 5: the
    low bits are chosen so that there are fewer than four buckets a change), so no run holds more
    than five times `chunk`."""
    n, m, low_bits = packed.n, packed.m, packed.low_bits
    high_len = elias_fano.high_len(n, m, low_bits)
    high = sections[1]
    span = high.numel() if chunk is None else max(1, -(-chunk * high_len // (8 * m)))
    seen, big, last = 0, 0, -1
    for at in range(0, high.numel(), span):
        bits = unpack_bits(high[at : at + span], min(8 * span, high_len - 8 * at))
        ones = positions_of(bits)
        count = ones.numel()
        if not count:
            continue
        if seen + count > m:
            raise FormatError(f"Elias-Fano high bits hold more than the {m} entries the header says")
        first = seen - seen % 8  # eight values of `low_bits` bits fill whole bytes
        low_bytes = sections[0][first // 8 * low_bits : -(-(seen + count) // 8) * low_bits]
        low = unpack_fixed(low_bytes, seen + count - first, low_bits)[seen - first :]
        buckets = ones.sub_(torch.arange(seen - 8 * at, seen - 8 * at + count, device=device))
        index = buckets.bitwise_left_shift_(low_bits).bitwise_or_(low)
        if int(index[-1]) >= n or int(index[0]) <= last or bool((index[1:] <= index[:-1]).any()):
            raise FormatError("changed positions are out of range or not strictly increasing")
        step, larger = _steps(packed, sections, seen, count, big, device)
        seen, last, big = seen + count, int(index[-1]), big + larger
        yield Steps(index, step)
    if seen != m:
        raise FormatError(f"Elias-Fano high bits hold {seen} entries, header says {m}")


def _steps(
    packed: Packed, sections: list[Tensor], start: int, count: int, big: int, device: torch.device
) -> tuple[Tensor, int]:
    """The 16-bit steps of changes `start` ... `start + count - 1` (in coded order), `big` of the
    changes before them larger than one; and how many of them are."""
    first, end = start - start % 8, start + count
    unit = unpack_bits(sections[2][first // 8 : -(-end // 8)], end - first)[start - first :]
    positive = unpack_bits(sections[3][first // 8 : -(-end // 8)], end - first)[start - first :]
    larger = count - popcount(unit)
    if big + larger > packed.k or (start + count == packed.m and big + larger != packed.k):
        raise FormatError(f"tensor payload flags more changes larger than one than its header's {packed.k}")
    if not larger:
        return positive.to(torch.int16).mul_(2).sub_(1), 0
    planes = sections[4].view(2, packed.k)[:, big : big + larger]
    magnitude = torch.stack((planes[0], planes[1]), dim=1).view(torch.int16).view(-1).to(torch.int32) & 0xFFFF
    step = torch.ones(count, dtype=torch.int32, device=device)
    step[~unit] = magnitude + 2
    step = torch.where(positive, step, -step)
    if bool(((step > 32767) | (step < -32768)).any()):
        raise FormatError("a tensor payload holds a change larger than 16 bits")
    return step.to(torch.int16), larger


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except (RuntimeError, MemoryError):  # a size the header allows but this machine cannot hold
        raise FormatError(f"cannot allocate {numel} elements of {dtype} on {device}") from None


def _classed_positions(
    exponents: Tensor, packed: Packed, low_section: Tensor, high_section: Tensor, device: torch.device
) -> Tensor:
    """The changed positions of a CLASSED payload, in class order (class, then position)."""
    m = packed.m
    if exponents.shape != (packed.n,) or exponents.dtype != torch.uint8:
        raise ValueError(f"exponents must be {packed.n} uint8 values, got {exponents.dtype} {tuple(exponents.shape)}")
    order, first, members = class_order(exponents.to(device))
    layout = ClassLayout(packed.classes, device)
    keys = torch.tensor([key for key, _, _ in packed.classes], dtype=torch.int64, device=device)
    if not torch.equal(members.index_select(0, keys), layout.members):
        raise FormatError("CLASSED tensor payload was made against another tensor: its exponent classes differ")
    low_bits = layout.per_change(layout.low_bits)
    stream, low = unpack_bits(low_section, layout.low_total), torch.zeros(m, dtype=torch.int64, device=device)
    for bit, has in layout.low_planes(low_bits):
        low[has] |= stream[layout.low_offset[has] + bit].long() << bit
    ones = positions_of(unpack_bits(high_section, layout.high_total))
    if ones.numel() != m:
        raise FormatError(f"Elias-Fano high bits hold {ones.numel()} entries, header says {m}")
    start = layout.per_change(layout.high_start)
    if bool(((ones < start) | (ones >= start + layout.per_change(layout.high_lens))).any()):
        raise FormatError("Elias-Fano high bits set outside their exponent class")
    ranks = ((ones - start - layout.within) << low_bits) | low
    if bool((ranks >= layout.per_change(layout.members)).any()) or bool(
        ((ranks[1:] <= ranks[:-1]) & (layout.within[1:] > 0)).any()
    ):
        raise FormatError("changed positions are out of their class or not strictly increasing in it")
    return order.index_select(0, layout.per_change(first.index_select(0, keys)) + ranks)
