"""A tensor payload's bytes: its header, class table and sections (docs/FORMAT.md, "Tensor
payload").  `serialize` writes a packed payload; `parse` validates every length against the
caller's element count before it allocates or decompresses anything.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import replace

import torch
from torch import Tensor

from . import elias_fano
from .classed import EXPONENT_SHIFT, class_bits
from .compressors import Compressor, compress, decompress
from .encoder import CodecOptions
from .errors import FormatError
from .format import MAX_ELEMENTS, DType
from .packed import Mode, Packed, ValueCoding

__all__ = ["MAGIC", "byte_view", "mode_of", "parse", "serialize"]

MAGIC = b"LDC\x01"
_HEADER = struct.Struct("<4sBBBB")  # magic, mode, value coding, low bits, dtype; then varints n, m, k


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
            squeezed = compress(options.compressor, raw, options.level)
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
    if mode == Mode.SPARSE and (m > n or k > m or coding != ValueCoding.SPLIT or low_bits != elias_fano.low_bits(n, m)):
        raise FormatError(f"SPARSE tensor payload with inconsistent header (n={n}, m={m}, k={k}, l={low_bits})")
    classes: tuple[tuple[int, int, int], ...] = ()
    if mode == Mode.CLASSED:
        if dtype not in EXPONENT_SHIFT or coding != ValueCoding.SPLIT or low_bits or not 0 < m <= n or k > m:
            raise FormatError(f"CLASSED tensor payload with inconsistent header (n={n}, m={m}, k={k}, l={low_bits})")
        classes, pos = _read_classes(view, pos, n, m, EXPONENT_SHIFT[dtype][1])
    sections = []
    for size in _section_sizes(mode, n, m, k, low_bits, classes):
        if pos >= len(view):
            raise FormatError("tensor payload truncated before a section")
        compressor, (stored, pos) = view[pos], _read_varint(view, pos + 1)
        if pos + stored > len(view):
            raise FormatError(f"tensor payload truncated: section of {stored} bytes runs past the end")
        data, pos = view[pos : pos + stored], pos + stored
        sections.append(byte_view(decompress(compressor, data, size)))
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


def _section_sizes(
    mode: Mode, n: int, m: int, k: int, low_bits: int, classes: tuple[tuple[int, int, int], ...]
) -> tuple[int, ...]:
    if mode == Mode.RAW:
        return (n, n)
    flags = (m + 7) // 8
    if mode == Mode.CLASSED:
        low, high = class_bits(classes)
    else:
        low, high = m * low_bits, elias_fano.high_len(n, m, low_bits)
    return ((low + 7) // 8, (high + 7) // 8, flags, flags, 2 * k)


_COMPRESSIBLE = {
    ValueCoding.NONE: (False, True),
    ValueCoding.EXPONENT: (True, False),
    ValueCoding.SPLIT: (False, True, True, True, True),  # SPARSE and CLASSED alike
}
"""Encoder policy: mantissas and EF low bits are near-random; skip compressing them."""


def byte_view(data: bytes | memoryview) -> Tensor:
    """A uint8 tensor over `data`, not a copy (its users only read it)."""
    return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


with warnings.catch_warnings():  # torch warns once a process that a read-only buffer could be written
    warnings.simplefilter("ignore", UserWarning)  # through its tensor: spent here, not guarded at each call
    byte_view(b"\0")
