"""The trainer's encode: which elements changed (`diff`) and their packing into a payload's byte
sections (`pack_delta`, `pack_full`), all torch code on the tensors' device.

Only the packed sections, a few bytes per change, go to the host for `wire.serialize`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import IntEnum

import torch
from torch import Tensor

from . import elias_fano
from .bitpack import pack_bits, pack_fixed, positions_of
from .classed import EXPONENT_SHIFT, ClassLayout, class_bits, class_order, exponent_bytes
from .compressors import Compressor
from .packed import Change, Mode, Packed, ValueCoding, check_pair, check_tensor
from .records import enum_member

__all__ = ["CodecOptions", "Context", "diff", "diff_at", "diff_counted", "may_pack_raw", "pack_delta", "pack_full"]


class Context(IntEnum):
    """What a delta's positions are coded given."""

    NONE = 0  # nothing: one Elias-Fano sequence per payload (SPARSE)
    EXPONENT = 1  # the old value's exponent: one sequence per exponent class (CLASSED)
    AUTO = 2  # EXPONENT where the tensors live on an accelerator, NONE on the CPU


@dataclass
class CodecOptions:
    """Encoder choices; decoding never needs them."""

    compressor: Compressor = Compressor.ZSTD
    level: int = 1
    """zstd level (1-22); ignored by lz4 and none.  Level 1 measured both faster and smaller than
    3 on these streams (docs/BENCHMARKS.md)."""
    threads: int = 4
    """Payloads a publisher compresses at once (zstd and lz4 release the GIL): a base of many
    payloads is spread over this many host cores instead of one."""
    context: Context = Context.AUTO
    """CLASSED deltas are ~30% smaller but sort the tensor's exponent bytes: free on a GPU, 7-10x the
    codec's time on a CPU (docs/BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        self.compressor = enum_member(Compressor, self.compressor)
        self.context = enum_member(Context, self.context)
        if not 1 <= self.level <= 22:
            raise ValueError(f"compression level must be in 1..22, got {self.level}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def conditions(self, device: torch.device) -> bool:
        """Whether deltas of tensors on `device` are coded per exponent class."""
        return self.context == Context.EXPONENT or (self.context == Context.AUTO and device.type != "cpu")


def diff(old: Tensor, new: Tensor, *, exponents: bool = False) -> Change:
    """The elements whose bit patterns differ (NaN payloads and -0.0 included).

    `exponents=True` also keeps `old`'s exponent bytes, so the change can be packed CLASSED after
    `old` itself has moved on (a float dtype's; an int16 change is always SPARSE).
    """
    check_pair(old, new)
    a, b = old.view(torch.int16), new.view(torch.int16)
    classes = exponent_bytes(old) if exponents and old.dtype in EXPONENT_SHIFT else None
    head = a.numel() // 4 * 4
    if not (head and a.storage_offset() % 4 == 0 and b.storage_offset() % 4 == 0):
        index = positions_of(a != b)
        return Change(index, a.index_select(0, index), b.index_select(0, index), new.numel(), new.dtype, classes)
    # Compare four elements per int64 word: `nonzero` scans a quarter as many entries, and only
    # the few changed words are gathered and looked at lane by lane.
    a64, b64 = a[:head].view(torch.int64), b[:head].view(torch.int64)
    words = positions_of(a64 != b64)
    old_lanes = a64.index_select(0, words).view(torch.int16).view(-1, 4)
    new_lanes = b64.index_select(0, words).view(torch.int16).view(-1, 4)
    lane = positions_of((old_lanes != new_lanes).view(-1))
    index = words.index_select(0, lane >> 2) * 4 + (lane & 3)
    olds, news = old_lanes.view(-1).index_select(0, lane), new_lanes.view(-1).index_select(0, lane)
    if head < a.numel():  # the last one to three elements
        tail = positions_of(a[head:] != b[head:]) + head
        index = torch.cat([index, tail])
        olds, news = torch.cat([olds, a.index_select(0, tail)]), torch.cat([news, b.index_select(0, tail)])
    return Change(index, olds, news, new.numel(), new.dtype, classes)


def diff_counted(old: Tensor, new: Tensor, changed: Tensor, count: int, *, exponents: bool = False) -> Change:
    """`diff`, given the mask of changed elements and how many there are: on an accelerator the
    caller finds every tensor's count with one host sync (`changed.sum()` of each, then one
    transfer of them all), and this does the rest without another (`nonzero_static`)."""
    check_pair(old, new)
    bits = new.view(torch.int16)
    return diff_at(old, changed, count, lambda index: bits.index_select(0, index), exponents=exponents)


def diff_at(
    old: Tensor, changed: Tensor, count: int, new_at: Callable[[Tensor], Tensor], *, exponents: bool = False
) -> Change:
    """`diff_counted` that reads the new values only where they changed: `new_at(index)` gives
    their int16 bits at those positions.  A trainer's new tensor is a cast of its masters, read
    whole once for the mask; reading it again only at the changed positions makes the diff one
    read of the masters and the cache, not two."""
    check_tensor(old)
    index = torch.nonzero_static(changed, size=count).squeeze(1)
    classes = exponent_bytes(old) if exponents and old.dtype in EXPONENT_SHIFT else None
    new = new_at(index)
    if new.dtype != torch.int16 or new.shape != index.shape or new.device != old.device:  # metadata: no sync
        raise ValueError(
            f"new_at gave {new.dtype} {tuple(new.shape)} on {new.device}, not int16 ({count},) on {old.device}"
        )
    return Change(index, old.view(torch.int16).index_select(0, index), new, old.numel(), old.dtype, classes)


def pack_full(new: Tensor) -> Packed:
    """A RAW payload: the whole tensor.

    bfloat16 as its exponent bytes and its sign-and-mantissa bytes: weights' exponents take a
    few values (~2.7 bits of entropy), which zstd's entropy stage gets close to, while the sign
    and mantissa are near-random and stored as they are (66-67% of dense, as DFloat11 and ZipNN
    do).  Other dtypes as two byte planes (the high plane compresses well).
    """
    check_tensor(new)
    n = new.numel()
    if new.dtype == torch.bfloat16:
        bits = new.view(torch.int16)
        sign_mantissa = ((bits >> 8) & 0x80 | bits & 0x7F).to(torch.uint8)
        return Packed(Mode.RAW, ValueCoding.EXPONENT, 0, new.dtype, n, n, 0, (exponent_bytes(new), sign_mantissa))
    pairs = new.view(torch.uint8).view(-1, 2)  # column copies: 4x faster than a transpose on CPU
    planes = (pairs[:, 0].contiguous(), pairs[:, 1].contiguous())
    return Packed(Mode.RAW, ValueCoding.NONE, 0, new.dtype, n, n, 0, planes)


def may_pack_raw(change: Change) -> bool:
    """Whether `pack_delta` may store `change` as RAW and so needs the whole new tensor.

    Below a quarter changed, SPARSE costs at most about 6 bits an element even if every change
    is large, and RAW about 12: the estimate never picks RAW there.
    """
    return change.numel <= _BOTH_BELOW or 4 * change.index.numel() > change.numel


def pack_delta(change: Change, new: Tensor | None = None) -> Packed:
    """A SPARSE payload of `change` (CLASSED where it carries the old exponents), or RAW when
    that is smaller.

    Small tensors carry every packing and `serialize` keeps the smallest; for large ones an
    estimate decides, since compressing both would double the host's work.  `new`, the whole
    new tensor, is needed only where `may_pack_raw(change)`.
    """
    n, m = change.numel, change.index.numel()
    if may_pack_raw(change):
        if new is None:
            raise ValueError("this change may be stored whole: pack_delta needs the new tensor")
        check_tensor(new)
        if (new.numel(), new.dtype) != (n, change.dtype):
            raise ValueError(f"new tensor is {new.dtype} of {new.numel()}, the change is {change.dtype} of {n}")
    step = change.new - change.old  # wraps mod 2**16
    unit = (step == 1) | (step == -1)
    far = step[~unit].to(torch.int32)
    k, low_bits = far.numel(), elias_fano.low_bits(n, m)
    # Rough compressed sizes: a large change costs about the bit length of its magnitude, and
    # RAW about 12 bits an element (its exponent plane compresses to half).
    magnitude_bits = k * (1 + float(far.abs().float().log2().mean())) if k else 0.0
    if m * low_bits + elias_fano.high_len(n, m, low_bits) + 2 * m + magnitude_bits > 12 * n:
        assert new is not None  # may_pack_raw holds wherever this estimate can win
        return pack_full(new)
    raw = pack_full(new) if new is not None and n <= _BOTH_BELOW and m else None
    classed = _pack_classed(change, change.exponents, step, unit, far) if change.exponents is not None and m else None
    if classed is None:
        return _pack_sparse(change, step, unit, far, raw)
    return replace(classed, alternative=_pack_sparse(change, step, unit, far, raw) if n <= _BOTH_BELOW else None)


def _pack_sparse(change: Change, step: Tensor, unit: Tensor, far: Tensor, alternative: Packed | None) -> Packed:
    n, m, k, index = change.numel, change.index.numel(), far.numel(), change.index
    low_bits = elias_fano.low_bits(n, m)
    low = pack_fixed(index & ((1 << low_bits) - 1), low_bits)
    high = torch.zeros(elias_fano.high_len(n, m, low_bits), dtype=torch.bool, device=index.device)
    high[(index >> low_bits) + torch.arange(m, device=index.device)] = True
    sections = (low, pack_bits(high), *_value_sections(step, unit, far))
    return Packed(Mode.SPARSE, ValueCoding.SPLIT, low_bits, change.dtype, n, m, k, sections, alternative=alternative)


def _pack_classed(change: Change, exponents: Tensor, step: Tensor, unit: Tensor, far: Tensor) -> Packed | None:
    """Each change's position as its rank among the old tensor's elements of the same exponent,
    one Elias-Fano sequence per class; the changes, and so their values, in class order.  None
    where the classes' sequences would not be shorter than one over the tensor."""
    n, m, device = change.numel, change.index.numel(), change.index.device
    order, first, members = class_order(exponents)
    classes = exponents.index_select(0, change.index).long()
    by_class = torch.argsort(classes, stable=True)  # positions stay ascending within a class
    keys, changed = torch.unique_consecutive(classes[by_class], return_counts=True)
    starts, sizes = first.index_select(0, keys).tolist(), members.index_select(0, keys).tolist()
    counts = changed.tolist()
    table = tuple(zip(keys.tolist(), sizes, counts, strict=True))
    # A change's rank in its class: where its position falls among the class's ascending members.
    positions = change.index[by_class].split(counts)
    ranks = torch.cat(
        [torch.searchsorted(order[a : a + b], p) for a, b, p in zip(starts, sizes, positions, strict=True)]
    )
    low_total, high_total = class_bits(table)
    plain = elias_fano.low_bits(n, m)
    if low_total + high_total + 32 * len(table) >= m * plain + elias_fano.high_len(n, m, plain):
        return None  # no exponent structure to use
    layout = ClassLayout(table, device)
    low_bits = layout.per_change(layout.low_bits)
    high = torch.zeros(layout.high_total, dtype=torch.bool, device=device)
    high[layout.per_change(layout.high_start) + (ranks >> low_bits) + layout.within] = True
    step, unit = step[by_class], unit[by_class]
    low = torch.zeros(layout.low_total, dtype=torch.bool, device=device)
    for bit, has in layout.low_planes(low_bits):
        low[layout.low_offset[has] + bit] = ((ranks[has] >> bit) & 1).bool()
    sections = (
        pack_bits(low),
        pack_bits(high),
        *_value_sections(step, unit, step[~unit].to(torch.int32)),
    )
    return Packed(Mode.CLASSED, ValueCoding.SPLIT, 0, change.dtype, n, m, far.numel(), sections, table)


def _value_sections(step: Tensor, unit: Tensor, far: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The unit flags, the signs and the magnitude planes of the changes, in the given order."""
    magnitude = (far.abs() - 2).to(torch.int16).view(torch.uint8).view(-1, 2).t().reshape(-1)
    return pack_bits(unit), pack_bits(step > 0), magnitude


_BOTH_BELOW = 4096
"""Tensors of at most this many elements are packed both ways (norms, biases: cheap and close)."""
