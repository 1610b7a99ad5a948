"""The tensor codec: what changed between two 16-bit tensors, in close to its entropy.

Between adjacent RL steps ~1-3% of bf16 elements change, most by one ULP.  So a delta stores

* positions as an Elias-Fano sequence (fixed-width low bits + unary high bits), which costs
  within a few percent of the binary entropy of the changed mask and decodes with plain torch ops;
* values as the wrapped integer difference of the bit patterns, `d = new - old mod 2**16`, which
  makes a one-ULP step +-1.  Most changes are +-1, so `d` is split into a "is +-1" flag and a sign
  bit per change (bit-packed: zstd's byte-level entropy stage then gets close to their binary
  entropy, which a byte per change never could) and `|d| - 2` for the rest;
* each byte section through a pluggable compressor (zstd by default) where that pays.

Under Adam a weight moves by about the same amount whatever its size, so small weights (small
ULP) change far more often, and by more ULPs, than large ones.  A CLASSED delta therefore codes
the positions per exponent class of the old value, which the decoder holds: each class gets an
Elias-Fano sequence over its own members, so its own density (on a realistic RL sequence 0.8x
the order-0 bound of the change and 0.7x a SPARSE delta's bytes, docs/BENCHMARKS.md).  Finding
each change's rank among its class costs a stable sort of the tensor's exponent bytes: nothing on
a GPU, several times the rest of the codec on a CPU, which is why `Context.AUTO` uses it on
accelerators only.

`diff`, `pack_full` and `pack_delta` are torch code that runs on the tensors' device; only the
packed sections, a few bytes per change, go to the host for `serialize`.  `parse` validates every
length against the caller's element count before it allocates, so a hostile payload can neither
write outside the tensor nor make the decoder allocate more than the tensor's own size.
The byte layout is specified in docs/FORMAT.md ("Tensor payload").
"""

from __future__ import annotations

import struct
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import IntEnum
from itertools import accumulate

import lz4.block
import numpy as np
import torch
import torch.nn.functional as F
import zstandard
from torch import Tensor

from .errors import FormatError
from .format import MAX_ELEMENTS, DType
from .records import enum_member

__all__ = [
    "Change",
    "CodecOptions",
    "Compressor",
    "Context",
    "Decoded",
    "Mode",
    "Packed",
    "Patch",
    "Steps",
    "ValueCoding",
    "decode",
    "decode_change",
    "decode_patch",
    "decode_steps",
    "diff",
    "diff_counted",
    "encode",
    "exponent_bytes",
    "may_pack_raw",
    "mode_of",
    "pack_delta",
    "pack_full",
    "parse",
    "positions_of",
    "serialize",
]

if sys.byteorder != "little":  # byte planes below are views of little-endian memory
    raise ImportError("lightning_delta.codec requires a little-endian host")

MAGIC = b"LDC\x01"
_HEADER = struct.Struct("<4sBBBB")  # magic, mode, value coding, low bits, dtype; then varints n, m, k

_CODED = frozenset(d.torch for d in DType)


class Mode(IntEnum):
    """How a payload stores the new tensor."""

    RAW = 0  # every element: the low-byte plane, then the high-byte plane
    SPARSE = 1  # Elias-Fano positions of the changed elements, then their value changes
    CLASSED = 2  # as SPARSE, but positions per exponent class of the old value, changes in class order


class ValueCoding(IntEnum):
    """How a payload stores its values: a SPARSE one `d = new - old mod 2**16` at the changed
    positions, a RAW one every element."""

    NONE = 0  # RAW: the low-byte plane, then the high-byte plane
    SPLIT = 1  # SPARSE: per change a "|d| = 1" bit and a sign bit; `|d| - 2` as byte planes for the k others
    EXPONENT = 2  # RAW bfloat16: the exponent bytes (entropy-coded), then sign and mantissa as one byte


class Compressor(IntEnum):
    """Byte compressor of one section; recorded per section, so a reader needs no config."""

    NONE = 0
    ZSTD = 1
    LZ4 = 2  # lz4 block format, uncompressed size implied by the payload header


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


@dataclass(frozen=True)
class Change:
    """The changed elements of a tensor: strictly increasing positions, old and new bits there."""

    index: Tensor  # int64
    old: Tensor  # int16 bit patterns
    new: Tensor  # int16 bit patterns
    numel: int  # elements of the whole tensor
    dtype: torch.dtype  # of the whole tensor
    exponents: Tensor | None = None
    """The old tensor's exponent bytes (`exponent_bytes`), where the change is to be CLASSED."""


@dataclass(frozen=True)
class Packed:
    """A payload before compression: header fields and uint8 byte sections on some device."""

    mode: Mode
    values: ValueCoding
    low_bits: int
    dtype: torch.dtype
    n: int
    m: int  # changed elements (n for RAW)
    k: int  # changed by more than one (0 for RAW)
    sections: tuple[Tensor, ...]
    classes: tuple[tuple[int, int, int], ...] = ()
    """CLASSED: (exponent, members, changed members) of every class with a change, ascending."""
    alternative: Packed | None = None
    """Another packing of the same tensor; `serialize` keeps whichever is smaller."""

    def cpu(self) -> Packed:
        alternative = self.alternative.cpu() if self.alternative else None
        return replace(self, sections=tuple(s.cpu() for s in self.sections), alternative=alternative)


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


# ---------------------------------------------------------------- device side: diff and pack


def diff(old: Tensor, new: Tensor, *, exponents: bool = False) -> Change:
    """The elements whose bit patterns differ (NaN payloads and -0.0 included).

    `exponents=True` also keeps `old`'s exponent bytes, so the change can be packed CLASSED after
    `old` itself has moved on (a float dtype's; an int16 change is always SPARSE).
    """
    _check_pair(old, new)
    a, b = old.view(torch.int16), new.view(torch.int16)
    classes = exponent_bytes(old) if exponents and old.dtype in _EXPONENT_SHIFT else None
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
    _check_pair(old, new)
    a, b = old.view(torch.int16), new.view(torch.int16)
    index = torch.nonzero_static(changed, size=count).squeeze(1)
    classes = exponent_bytes(old) if exponents and old.dtype in _EXPONENT_SHIFT else None
    return Change(index, a.index_select(0, index), b.index_select(0, index), new.numel(), new.dtype, classes)


_EXPONENT_SHIFT = {torch.bfloat16: (7, 0xFF), torch.float16: (10, 0x1F)}


def positions_of(mask: Tensor) -> Tensor:
    """The int64 positions of a 1-D bool tensor's True elements, ascending.  On the CPU through
    numpy, whose scan is 2x (16K elements) to 17x (4M) faster than torch's `nonzero` there."""
    if mask.is_cpu:
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    return mask.nonzero().squeeze(1)


def exponent_bytes(t: Tensor) -> Tensor:
    """Each element's biased exponent as uint8: the class a CLASSED delta codes it in."""
    shift, mask = _EXPONENT_SHIFT[t.dtype]
    shifted = t.view(torch.int16) >> shift
    return (shifted if mask == 0xFF else shifted & mask).to(torch.uint8)  # the cast keeps the low byte


def pack_full(new: Tensor) -> Packed:
    """A RAW payload: the whole tensor.

    bfloat16 as its exponent bytes and its sign-and-mantissa bytes: weights' exponents take a
    few values (~2.7 bits of entropy), which zstd's entropy stage gets close to, while the sign
    and mantissa are near-random and stored as they are (66-67% of dense, as DFloat11 and ZipNN
    do).  Other dtypes as two byte planes (the high plane compresses well).
    """
    _check_tensor(new)
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
        _check_tensor(new)
        if (new.numel(), new.dtype) != (n, change.dtype):
            raise ValueError(f"new tensor is {new.dtype} of {new.numel()}, the change is {change.dtype} of {n}")
    step = change.new - change.old  # wraps mod 2**16
    unit = (step == 1) | (step == -1)
    far = step[~unit].to(torch.int32)
    k, low_bits = far.numel(), _low_bits(n, m)
    # Rough compressed sizes: a large change costs about the bit length of its magnitude, and
    # RAW about 12 bits an element (its exponent plane compresses to half).
    magnitude_bits = k * (1 + float(far.abs().float().log2().mean())) if k else 0.0
    if m * low_bits + _high_len(n, m, low_bits) + 2 * m + magnitude_bits > 12 * n:
        assert new is not None  # may_pack_raw holds wherever this estimate can win
        return pack_full(new)
    raw = pack_full(new) if new is not None and n <= _BOTH_BELOW and m else None
    classed = _pack_classed(change, change.exponents, step, unit, far) if change.exponents is not None and m else None
    if classed is None:
        return _pack_sparse(change, step, unit, far, raw)
    return replace(classed, alternative=_pack_sparse(change, step, unit, far, raw) if n <= _BOTH_BELOW else None)


def _pack_sparse(change: Change, step: Tensor, unit: Tensor, far: Tensor, alternative: Packed | None) -> Packed:
    n, m, k, index = change.numel, change.index.numel(), far.numel(), change.index
    low_bits = _low_bits(n, m)
    low = _pack_fixed(index & ((1 << low_bits) - 1), low_bits)
    high = torch.zeros(_high_len(n, m, low_bits), dtype=torch.bool, device=index.device)
    high[(index >> low_bits) + torch.arange(m, device=index.device)] = True
    sections = (low, _pack_bits(high), *_value_sections(step, unit, far))
    return Packed(Mode.SPARSE, ValueCoding.SPLIT, low_bits, change.dtype, n, m, k, sections, alternative=alternative)


def _pack_classed(change: Change, exponents: Tensor, step: Tensor, unit: Tensor, far: Tensor) -> Packed | None:
    """Each change's position as its rank among the old tensor's elements of the same exponent,
    one Elias-Fano sequence per class; the changes, and so their values, in class order.  None
    where the classes' sequences would not be shorter than one over the tensor."""
    n, m, device = change.numel, change.index.numel(), change.index.device
    order, first, members = _class_order(exponents)
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
    low_total, high_total = _class_bits(table)
    plain = _low_bits(n, m)
    if low_total + high_total + 32 * len(table) >= m * plain + _high_len(n, m, plain):
        return None  # no exponent structure to use
    layout = _ClassLayout(table, device)
    low_bits = layout.per_change(layout.low_bits)
    high = torch.zeros(layout.high_total, dtype=torch.bool, device=device)
    high[layout.per_change(layout.high_start) + (ranks >> low_bits) + layout.within] = True
    step, unit = step[by_class], unit[by_class]
    low = torch.zeros(layout.low_total, dtype=torch.bool, device=device)
    for bit, has in layout.low_planes(low_bits):
        low[layout.low_offset[has] + bit] = ((ranks[has] >> bit) & 1).bool()
    sections = (
        _pack_bits(low),
        _pack_bits(high),
        *_value_sections(step, unit, step[~unit].to(torch.int32)),
    )
    return Packed(Mode.CLASSED, ValueCoding.SPLIT, 0, change.dtype, n, m, far.numel(), sections, table)


def _value_sections(step: Tensor, unit: Tensor, far: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The unit flags, the signs and the magnitude planes of the changes, in the given order."""
    magnitude = (far.abs() - 2).to(torch.int16).view(torch.uint8).view(-1, 2).t().reshape(-1)
    return _pack_bits(unit), _pack_bits(step > 0), magnitude


def _class_order(exponents: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The tensor's positions in class order (exponent, then position), and where each of the 256
    classes starts in it and how many members it has."""
    values, order = torch.sort(exponents, stable=True)
    ends = torch.searchsorted(values, torch.arange(256, dtype=torch.uint8, device=values.device), right=True)
    starts = F.pad(ends[:-1], (1, 0))
    return order, starts, ends - starts


class _ClassLayout:
    """Where each class of a CLASSED payload lies in its bit streams, from the class table alone.

    Classes follow each other in both streams; a class of `n_c` members and `m_c` changes has
    `m_c * l_c` low bits and `H(n_c, m_c, l_c)` high bits, with `l_c = _low_bits(n_c, m_c)`.
    """

    def __init__(self, table: tuple[tuple[int, int, int], ...], device: torch.device) -> None:
        members = [members for _, members, _ in table]
        counts = [changed for _, _, changed in table]
        low_bits, high_lens = _class_widths(table)
        low_lens = [m * bits for m, bits in zip(counts, low_bits, strict=True)]
        self.low_total, self.high_total = sum(low_lens), sum(high_lens)

        def tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.members, self.counts, self.low_bits = tensor(members), tensor(counts), tensor(low_bits)
        self.high_lens, self.high_start = tensor(high_lens), tensor(_starts(high_lens))
        self.within = torch.arange(sum(counts), device=device) - self.per_change(tensor(_starts(counts)))
        self.low_offset = self.per_change(tensor(_starts(low_lens))) + self.within * self.per_change(self.low_bits)
        self.widest = max(low_bits, default=0)

    def per_change(self, per_class: Tensor) -> Tensor:
        return per_class.repeat_interleave(self.counts)

    def low_planes(self, low_bits: Tensor) -> Iterator[tuple[int, Tensor]]:
        """(bit, which changes have it) for each bit of the widest class's low part: a change's
        bit `b` is at `low_offset + b` of the low stream.  A loop of at most 40 passes over the
        changes, not a (changes x widest) matrix a hostile table could inflate."""
        for bit in range(self.widest):
            yield bit, low_bits > bit


def _starts(sizes: list[int]) -> list[int]:
    return list(accumulate(sizes, initial=0))[:-1]


_BOTH_BELOW = 4096
"""Tensors of at most this many elements are packed both ways (norms, biases: cheap and close)."""


# ------------------------------------------------------------------ host side: bytes


def serialize(packed: Packed, options: CodecOptions | None = None) -> bytes:
    """The payload bytes of a packed change (sections must be on the CPU)."""
    options = options or CodecOptions()
    if packed.alternative is not None:
        one, other = serialize(replace(packed, alternative=None), options), serialize(packed.alternative, options)
        return one if len(one) <= len(other) else other
    header = _HEADER.pack(MAGIC, packed.mode, packed.values, packed.low_bits, DType.of(packed.dtype).code)
    parts = [header, _varint(packed.n), _varint(packed.m), _varint(packed.k)]
    if packed.mode == Mode.CLASSED:
        parts.append(_varint(len(packed.classes)))
        parts += [bytes([key]) + _varint(members) + _varint(changed) for key, members, changed in packed.classes]
    for section, compressible in zip(packed.sections, _COMPRESSIBLE[packed.values], strict=True):
        raw = memoryview(section.contiguous().numpy().data)
        compressor, data = Compressor.NONE, raw
        if compressible and options.compressor != Compressor.NONE and len(raw) >= 64:
            squeezed = _BACKENDS[options.compressor].compress(raw, options.level)
            if len(squeezed) < len(raw):
                compressor, data = options.compressor, memoryview(squeezed)
        parts += [bytes([compressor]), _varint(len(data)), bytes(data)]
    return b"".join(parts)


def mode_of(payload: bytes | memoryview) -> Mode | None:
    """A payload's mode as its header says, unchecked (`parse` checks it): None if it has none."""
    view = memoryview(payload)
    if len(view) < _HEADER.size or view[:4] != MAGIC or view[4] not in set(Mode):
        return None
    return Mode(view[4])


def parse(payload: bytes | memoryview, numel: int) -> Packed:
    """Validate a payload against the element count the caller expects and decompress it."""
    view = memoryview(payload)
    if not 0 <= numel <= MAX_ELEMENTS:
        raise FormatError(f"a tensor payload holds at most {MAX_ELEMENTS} elements, {numel} expected")
    if len(view) < _HEADER.size:
        raise FormatError(f"tensor payload truncated: {len(view)} bytes, header needs {_HEADER.size}")
    magic, mode, coding, low_bits, dtype_code = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FormatError(f"not a lightning_delta tensor payload (magic {bytes(magic)!r})")
    n, pos = _read_varint(view, _HEADER.size)
    m, pos = _read_varint(view, pos)
    k, pos = _read_varint(view, pos)
    if n != numel:
        raise FormatError(f"tensor payload holds {n} elements, expected {numel}")
    try:
        mode, coding, dtype = Mode(mode), ValueCoding(coding), DType.from_code(dtype_code).torch
    except (ValueError, KeyError) as err:
        raise FormatError(f"tensor payload has an unknown mode, coding or dtype: {err}") from None
    raw_codings = (ValueCoding.NONE, ValueCoding.EXPONENT) if dtype == torch.bfloat16 else (ValueCoding.NONE,)
    if mode == Mode.RAW and (m != n or k or coding not in raw_codings or low_bits):
        raise FormatError("RAW tensor payload with inconsistent header fields")
    if mode == Mode.SPARSE and (m > n or k > m or coding != ValueCoding.SPLIT or low_bits != _low_bits(n, m)):
        raise FormatError(f"SPARSE tensor payload with inconsistent header (n={n}, m={m}, k={k}, l={low_bits})")
    classes: tuple[tuple[int, int, int], ...] = ()
    if mode == Mode.CLASSED:
        if dtype not in _EXPONENT_SHIFT or coding != ValueCoding.SPLIT or low_bits or not 0 < m <= n or k > m:
            raise FormatError(f"CLASSED tensor payload with inconsistent header (n={n}, m={m}, k={k}, l={low_bits})")
        classes, pos = _read_classes(view, pos, n, m, _EXPONENT_SHIFT[dtype][1])
    sections = []
    for size in _section_sizes(mode, n, m, k, low_bits, classes):
        if pos >= len(view):
            raise FormatError("tensor payload truncated before a section")
        compressor, (stored, pos) = view[pos], _read_varint(view, pos + 1)
        if pos + stored > len(view):
            raise FormatError(f"tensor payload truncated: section of {stored} bytes runs past the end")
        data, pos = view[pos : pos + stored], pos + stored
        sections.append(byte_view(_decompress(compressor, data, size)))
    if pos != len(view):
        raise FormatError(f"tensor payload has {len(view) - pos} trailing bytes")
    return Packed(mode, coding, low_bits, dtype, n, m, k, tuple(sections), classes)


def _read_classes(view: memoryview, pos: int, n: int, m: int, top: int) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """A CLASSED payload's class table: ascending exponents up to `top`, each with its members and
    changes, the changes summing to `m` and the members to at most `n`."""
    count, pos = _read_varint(view, pos)
    if not 0 < count <= top + 1:
        raise FormatError(f"CLASSED tensor payload lists {count} exponent classes, at most {top + 1} exist")
    classes, key, members_total = [], -1, 0
    for _ in range(count):
        if pos >= len(view):
            raise FormatError("tensor payload truncated inside its class table")
        if not key < view[pos] <= top:
            raise FormatError(f"CLASSED tensor payload: exponent {view[pos]} out of order or above {top}")
        key, (members, pos) = view[pos], _read_varint(view, pos + 1)
        changed, pos = _read_varint(view, pos)
        if not 0 < changed <= members:
            raise FormatError(f"CLASSED tensor payload: exponent {key} has {changed} changes among {members}")
        members_total += members
        classes.append((key, members, changed))
    if sum(c for _, _, c in classes) != m or members_total > n:
        raise FormatError(
            f"CLASSED tensor payload: its classes hold {members_total} elements and "
            f"{sum(c for _, _, c in classes)} changes, the header {n} and {m}"
        )
    return tuple(classes), pos


# ------------------------------------------------------------------ decode: unpack and apply


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
        _check_tensor(old)
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
        whole = _empty(numel, dtype, device) if out is None else out
        if packed.values == ValueCoding.EXPONENT:
            exponent, sign_mantissa = sections[0].to(torch.int16), sections[1].to(torch.int16)
            whole.view(torch.int16).copy_((sign_mantissa & 0x80) << 8 | exponent << 7 | sign_mantissa & 0x7F)
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


def _sparse_steps(packed: Packed, sections: list[Tensor], device: torch.device, chunk: int | None) -> Iterator[Steps]:
    """A SPARSE payload's changes, a run of the unary high bits at a time: each set bit there is one
    change, and a run spans `chunk` changes' worth of bits on average (`high_len / m`, under 5: the
    low bits are chosen so that there are fewer than four buckets a change), so no run holds more
    than five times `chunk`."""
    n, m, low_bits = packed.n, packed.m, packed.low_bits
    high_len = _high_len(n, m, low_bits)
    high = sections[1]
    span = high.numel() if chunk is None else max(1, -(-chunk * high_len // (8 * m)))
    seen, big, last = 0, 0, -1
    for at in range(0, high.numel(), span):
        bits = _unpack_bits(high[at : at + span], min(8 * span, high_len - 8 * at))
        ones = positions_of(bits)
        count = ones.numel()
        if not count:
            continue
        if seen + count > m:
            raise FormatError(f"Elias-Fano high bits hold more than the {m} entries the header says")
        first = seen - seen % 8  # eight values of `low_bits` bits fill whole bytes
        low_bytes = sections[0][first // 8 * low_bits : -(-(seen + count) // 8) * low_bits]
        low = _unpack_fixed(low_bytes, seen + count - first, low_bits)[seen - first :]
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
    unit = _unpack_bits(sections[2][first // 8 : -(-end // 8)], end - first)[start - first :]
    positive = _unpack_bits(sections[3][first // 8 : -(-end // 8)], end - first)[start - first :]
    larger = count - _count(unit)
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
    order, first, members = _class_order(exponents.to(device))
    layout = _ClassLayout(packed.classes, device)
    keys = torch.tensor([key for key, _, _ in packed.classes], dtype=torch.int64, device=device)
    if not torch.equal(members.index_select(0, keys), layout.members):
        raise FormatError("CLASSED tensor payload was made against another tensor: its exponent classes differ")
    low_bits = layout.per_change(layout.low_bits)
    stream, low = _unpack_bits(low_section, layout.low_total), torch.zeros(m, dtype=torch.int64, device=device)
    for bit, has in layout.low_planes(low_bits):
        low[has] |= stream[layout.low_offset[has] + bit].long() << bit
    ones = positions_of(_unpack_bits(high_section, layout.high_total))
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


def encode(old: Tensor | None, new: Tensor, options: CodecOptions | None = None) -> bytes:
    """Payload that turns `old` into `new` bit for bit; `old=None` stores `new` whole."""
    options = options or CodecOptions()
    if old is None:
        return serialize(pack_full(new).cpu(), options)
    packed = pack_delta(diff(old, new, exponents=options.conditions(new.device)), new)
    return serialize(packed.cpu(), options)


def decode(
    old: Tensor | None,
    payload: bytes | memoryview,
    *,
    numel: int | None = None,
    dtype: torch.dtype | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Inverse of `encode`: `decode(old, encode(old, new))` is bit-identical to `new`."""
    return decode_change(old, payload, numel=numel, dtype=dtype, out=out).new


# ------------------------------------------------------------------ helpers


def _varint(value: int) -> bytes:
    """Unsigned LEB128: seven bits a byte, least significant first, high bit = more follows."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); at most 9 bytes, so the value stays below 2**63."""
    value = 0
    for i in range(9):
        if pos + i >= len(view):
            raise FormatError("tensor payload truncated inside a section length")
        byte = view[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if byte == 0 and i:
                raise FormatError("tensor payload has a non-minimal section length")
            return value, pos + i + 1
    raise FormatError("tensor payload has a section length longer than 9 bytes")


def _low_bits(n: int, m: int) -> int:
    """Elias-Fano low-bit width: floor(log2(n / m)) - 1, at least 0 (0 when m == 0).

    One bit fewer than textbook Elias-Fano: the low bits are incompressible, while zstd codes the
    unary high bits near their entropy, so moving a bit from one to the other saved 1.4-2.9% of
    the positions' bytes on every sequence measured (docs/BENCHMARKS.md)."""
    return max(0, (n // m).bit_length() - 2) if m else 0


def _high_len(n: int, m: int, low_bits: int) -> int:
    """Length in bits of the unary high-bit array: one set bit per entry plus one zero per bucket."""
    return m + ((n - 1) >> low_bits) + 1 if m else 0


def _section_sizes(
    mode: Mode, n: int, m: int, k: int, low_bits: int, classes: tuple[tuple[int, int, int], ...]
) -> tuple[int, ...]:
    if mode == Mode.RAW:
        return (n, n)
    flags = (m + 7) // 8
    if mode == Mode.CLASSED:
        low, high = _class_bits(classes)
    else:
        low, high = m * low_bits, _high_len(n, m, low_bits)
    return ((low + 7) // 8, (high + 7) // 8, flags, flags, 2 * k)


def _class_widths(classes: tuple[tuple[int, int, int], ...]) -> tuple[list[int], list[int]]:
    """Per class of a CLASSED payload: its Elias-Fano low-bit width and its high-bit length."""
    widths = [_low_bits(members, changed) for _, members, changed in classes]
    highs = [_high_len(members, changed, bits) for (_, members, changed), bits in zip(classes, widths, strict=True)]
    return widths, highs


def _class_bits(classes: tuple[tuple[int, int, int], ...]) -> tuple[int, int]:
    """Low and high bits of a CLASSED payload's positions: its classes' sequences back to back."""
    widths, highs = _class_widths(classes)
    return sum(changed * bits for (_, _, changed), bits in zip(classes, widths, strict=True)), sum(highs)


_COMPRESSIBLE = {
    ValueCoding.NONE: (False, True),
    ValueCoding.EXPONENT: (True, False),
    ValueCoding.SPLIT: (False, True, True, True, True),  # SPARSE and CLASSED alike
}
"""Encoder policy: mantissas and EF low bits are near-random; skip compressing them."""


_GATHER = 0x0102040810204080  # (word * _GATHER) >> 56: eight 0/1 bytes -> one byte, byte k -> bit k
_SPREAD = 0x0101010101010101  # one byte -> the same byte in all eight lanes of a word
_LANES = 0x8040201008040201 - (1 << 64)  # lane k keeps bit k (as a signed int64)


def _pack_bits(bits: Tensor) -> Tensor:
    """Bools to bytes, least significant bit first: on the CPU through numpy (9x faster there),
    elsewhere one multiply per eight bits."""
    if bits.is_cpu:
        return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
    words = F.pad(bits.view(torch.uint8), (0, -bits.numel() % 8)).view(torch.int64)
    return (((words * _GATHER) >> 56) & 0xFF).to(torch.uint8)


def _unpack_bits(data: Tensor, count: int) -> Tensor:
    """Bytes to `count` bools (fewer if the bytes hold fewer), least significant bit first.  On the
    CPU through numpy's table lookup, 16x faster there than the multiply."""
    if data.is_cpu:
        bits = np.unpackbits(data.numpy(), count=min(count, 8 * data.numel()), bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    lanes = (data.to(torch.int64) * _SPREAD) & _LANES
    return (lanes.view(torch.uint8) != 0)[:count]


def _count(mask: Tensor) -> int:
    """How many of a 1-D bool tensor's elements are True (on the CPU, numpy's popcount: a bool
    `sum` there widens every element to int64)."""
    return int(np.count_nonzero(mask.numpy())) if mask.is_cpu else int(mask.sum())


def _pack_fixed(values: Tensor, width: int) -> Tensor:
    """Non-negative ints below 2**width, `width` bits each, concatenated LSB first."""
    count = values.numel()
    if width > 8:  # density below 1/512: few values, expand them bit by bit
        shifts = torch.arange(width, dtype=torch.int64, device=values.device)
        return _pack_bits(((values.unsqueeze(1) >> shifts) & 1).view(-1).bool())
    # Eight values of `width` bits fill exactly `width` bytes: build one int64 word per eight.
    groups = F.pad(values, (0, -count % 8)).view(-1, 8)
    word = groups[:, 0].clone(memory_format=torch.contiguous_format)
    for j in range(1, 8):
        word |= groups[:, j] << (j * width)
    return word.view(torch.uint8).view(-1, 8)[:, :width].reshape(-1)[: (count * width + 7) // 8]


def _unpack_fixed(data: Tensor, count: int, width: int) -> Tensor:
    if width > 8:
        shifts = torch.arange(width, dtype=torch.int64, device=data.device)
        bits = _unpack_bits(data, count * width).view(count, width).to(torch.int64)
        return (bits << shifts).sum(dim=1)
    groups = -(-count // 8)
    padded = F.pad(F.pad(data, (0, groups * width - data.numel())).view(groups, width), (0, 8 - width))
    word = padded.view(torch.int64).view(-1, 1)
    shifts = torch.arange(8, dtype=torch.int64, device=data.device) * width
    return ((word >> shifts) & ((1 << width) - 1)).view(-1)[:count]


def _check_tensor(t: Tensor) -> None:
    if t.dim() != 1 or t.dtype not in _CODED or not t.is_contiguous():
        raise ValueError(
            f"the codec takes contiguous 1-D tensors of {sorted(d.value for d in DType)}, "
            f"got {t.dtype} of shape {tuple(t.shape)}"
        )


def _check_pair(old: Tensor, new: Tensor) -> None:
    _check_tensor(old)
    _check_tensor(new)
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        raise ValueError(
            f"old and new must match in length, dtype and device: "
            f"{old.dtype}{tuple(old.shape)}@{old.device} vs {new.dtype}{tuple(new.shape)}@{new.device}"
        )


def byte_view(data: bytes | memoryview) -> Tensor:
    """A uint8 tensor over `data`, not a copy (its users only read it)."""
    return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


with warnings.catch_warnings():  # torch warns once a process that a read-only buffer could be written
    warnings.simplefilter("ignore", UserWarning)  # through its tensor: spent here, not guarded at each call
    byte_view(b"\0")


# ------------------------------------------------------------------ compressors


@dataclass(frozen=True)
class _Backend:
    compress: Callable[[memoryview, int], bytes]
    decompress: Callable[[memoryview, int], bytes]  # (data, exact size) -> bytes


_local = threading.local()  # zstd (de)compressor objects must not be shared between threads


# Frames without magic number, content size or checksum: the payload header implies the size
# and the part's SHA-256 covers the bytes, so those would be ~5 bytes of every section repeated.
_ZSTD_FORMAT = zstandard.FORMAT_ZSTD1_MAGICLESS


def _zstd_compress(data: memoryview, level: int) -> bytes:
    cache = _local.__dict__.setdefault("zstd_c", {})
    if level not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, format=_ZSTD_FORMAT, write_content_size=0, write_checksum=0, write_dict_id=0
        )
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level].compress(data)


def _zstd_decompress(data: memoryview, size: int) -> bytes:
    # The frame's own content size (if it carries one) must not size the output: a flipped bit
    # there would make the decoder allocate and fill gigabytes before the length check.
    declared = zstandard.get_frame_parameters(data, format=_ZSTD_FORMAT).content_size
    if declared not in (zstandard.CONTENTSIZE_UNKNOWN, size):
        raise FormatError(f"zstd frame declares {declared} bytes, expected {size}")
    if "zstd_d" not in _local.__dict__:
        _local.zstd_d = zstandard.ZstdDecompressor(format=_ZSTD_FORMAT)
    return _local.zstd_d.decompress(data, max_output_size=size)


_LZ4_MAX = 0x7E000000  # LZ4_MAX_INPUT_SIZE: the block format holds no more


def _lz4_decompress(data: memoryview, size: int) -> bytes:
    if size > _LZ4_MAX:
        raise FormatError(f"an lz4 block holds at most {_LZ4_MAX} bytes, this section {size}")
    return lz4.block.decompress(data, uncompressed_size=size)


_EXPANSION = {Compressor.ZSTD: 1 << 15, Compressor.LZ4: 1 << 8}
"""The most each stored byte can decompress to: a zstd block (3-byte header) holds at most 128 KiB
and its densest form, an RLE block, takes 4 bytes for that; an lz4 sequence adds at most 255 bytes
of match length per byte."""

_BACKENDS = {
    Compressor.ZSTD: _Backend(_zstd_compress, _zstd_decompress),
    Compressor.LZ4: _Backend(lambda data, level: lz4.block.compress(data, store_size=False), _lz4_decompress),
}


def _decompress(code: int, data: memoryview, size: int) -> bytes | memoryview:
    try:
        compressor = Compressor(code)
    except ValueError:
        raise FormatError(f"unknown compressor code {code} in tensor payload") from None
    if compressor == Compressor.NONE:
        out: bytes | memoryview = data
    elif size > len(data) * _EXPANSION[compressor]:
        # Checked before anything is allocated: a few stored bytes never size a huge output.
        raise FormatError(f"a {len(data)}-byte {compressor.name} section cannot hold the {size} bytes expected")
    else:
        try:
            out = _BACKENDS[compressor].decompress(data, size)
        except (zstandard.ZstdError, lz4.block.LZ4BlockError, ValueError) as err:
            raise FormatError(f"{compressor.name} section does not decompress: {err}") from None
    if len(out) != size:
        raise FormatError(f"{compressor.name} section holds {len(out)} bytes, expected {size}")
    return out
