"""The tensor codec: what changed between two 16-bit tensors, in close to its entropy.

Between adjacent RL steps ~1-3% of bf16 elements change, most by one ULP.  So a delta stores

* positions as an Elias-Fano sequence (fixed-width low bits + unary high bits), which costs
  within a few percent of the binary entropy of the changed mask and decodes with plain torch ops;
* values as the wrapped integer difference of the bit patterns, `new - old mod 2**16`, which
  makes a one-ULP step +-1: one sign bit each when every change is +-1, else zigzag byte planes;
* each byte section through a pluggable compressor (zstd by default) where that pays.

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
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import lz4.block
import torch
import torch.nn.functional as F
import zstandard
from torch import Tensor

from .errors import FormatError

__all__ = [
    "Change",
    "CodecOptions",
    "Compressor",
    "Decoded",
    "Mode",
    "Packed",
    "ValueCoding",
    "decode",
    "decode_change",
    "diff",
    "encode",
    "pack_delta",
    "pack_full",
    "parse",
    "serialize",
]

if sys.byteorder != "little":  # byte planes below are views of little-endian memory
    raise ImportError("lightning_delta.codec requires a little-endian host")

MAGIC = b"LDC\x01"
_HEADER = struct.Struct("<4sBBBBQQ")  # magic, mode, value coding, low bits, dtype, n, m
_SECTION = struct.Struct("<BQ")  # compressor, stored length

DTYPE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2, torch.int16: 3}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class Mode(IntEnum):
    """How a payload stores the new tensor."""

    RAW = 0  # every element: the low-byte plane, then the high-byte plane
    SPARSE = 1  # Elias-Fano positions of the changed elements, then their value changes


class ValueCoding(IntEnum):
    """How a SPARSE payload stores `new - old mod 2**16` at the changed positions."""

    NONE = 0  # RAW payloads
    ZIGZAG = 1  # zigzag-coded differences: low-byte plane, then high-byte plane
    SIGN = 2  # every difference is +-1: one bit each, set for +1


class Compressor(IntEnum):
    """Byte compressor of one section; recorded per section, so a reader needs no config."""

    NONE = 0
    ZSTD = 1
    LZ4 = 2  # lz4 block format, uncompressed size implied by the payload header


@dataclass(frozen=True)
class CodecOptions:
    """Encoder choices; decoding never needs them."""

    compressor: Compressor = Compressor.ZSTD
    level: int = 3
    """zstd level (1-22); ignored by lz4 and none."""

    def __post_init__(self) -> None:
        if not 1 <= self.level <= 22:
            raise ValueError(f"compression level must be in 1..22, got {self.level}")


@dataclass(frozen=True)
class Change:
    """The changed elements of a tensor: strictly increasing positions, old and new bits there."""

    index: Tensor  # int64
    old: Tensor  # int16 bit patterns
    new: Tensor  # int16 bit patterns


@dataclass(frozen=True)
class Packed:
    """A payload before compression: header fields and uint8 byte sections on some device."""

    mode: Mode
    values: ValueCoding
    low_bits: int
    dtype: torch.dtype
    n: int
    m: int
    sections: tuple[Tensor, ...]

    def cpu(self) -> Packed:
        return Packed(**{**self.__dict__, "sections": tuple(s.cpu() for s in self.sections)})


@dataclass(frozen=True)
class Decoded:
    """A decoded tensor and, for SPARSE payloads, the change that produced it."""

    new: Tensor
    change: Change | None


# ---------------------------------------------------------------- device side: diff and pack


def diff(old: Tensor, new: Tensor) -> Change:
    """The elements whose bit patterns differ (NaN payloads and -0.0 included)."""
    _check_pair(old, new)
    a, b = old.view(torch.int16), new.view(torch.int16)
    index = (a != b).nonzero().squeeze(1)
    return Change(index, a[index], b[index])


def pack_full(new: Tensor) -> Packed:
    """A RAW payload: the whole tensor as two byte planes (the high plane compresses well)."""
    _check_tensor(new)
    planes = new.view(torch.uint8).view(-1, 2).t().contiguous()
    n = new.numel()
    return Packed(Mode.RAW, ValueCoding.NONE, 0, new.dtype, n, n, (planes[0], planes[1]))


def pack_delta(change: Change, new: Tensor) -> Packed:
    """A SPARSE payload of `change`, or RAW when more than half of `new` changed."""
    _check_tensor(new)
    n, m = new.numel(), change.index.numel()
    if 2 * m > n:
        return pack_full(new)
    low_bits = _low_bits(n, m)
    index = change.index
    low = _pack_fixed(index & ((1 << low_bits) - 1), low_bits)
    high = torch.zeros(_high_len(n, m, low_bits), dtype=torch.bool, device=new.device)
    high[(index >> low_bits) + torch.arange(m, device=new.device)] = True
    step = change.new - change.old  # wraps mod 2**16
    if m and bool(((step == 1) | (step == -1)).all()):
        coding, values = ValueCoding.SIGN, _pack_bits(step == 1)
    else:
        wide = step.to(torch.int32)
        zigzag = ((wide << 1) ^ (wide >> 31)).to(torch.int16)
        coding, values = ValueCoding.ZIGZAG, zigzag.view(torch.uint8).view(-1, 2).t().reshape(-1)
    sections = (low, _pack_bits(high), values)
    return Packed(Mode.SPARSE, coding, low_bits, new.dtype, n, m, sections)


# ------------------------------------------------------------------ host side: bytes


def serialize(packed: Packed, options: CodecOptions | None = None) -> bytes:
    """The payload bytes of a packed change (sections must be on the CPU)."""
    options = options or CodecOptions()
    header = _HEADER.pack(
        MAGIC,
        packed.mode,
        packed.values,
        packed.low_bits,
        DTYPE_CODES[packed.dtype],
        packed.n,
        packed.m,
    )
    parts = [header]
    for section, compressible in zip(packed.sections, _COMPRESSIBLE[packed.mode], strict=True):
        raw = memoryview(section.numpy())
        compressor, data = Compressor.NONE, raw
        if compressible and options.compressor != Compressor.NONE and len(raw) >= 64:
            squeezed = _BACKENDS[options.compressor].compress(raw, options.level)
            if len(squeezed) < len(raw):
                compressor, data = options.compressor, squeezed
        parts += [_SECTION.pack(compressor, len(data)), data]
    return b"".join(parts)


def parse(payload: bytes | memoryview, numel: int) -> Packed:
    """Validate a payload against the element count the caller expects and decompress it."""
    view = memoryview(payload)
    if len(view) < _HEADER.size:
        raise FormatError(f"tensor payload truncated: {len(view)} bytes, header needs {_HEADER.size}")
    magic, mode, coding, low_bits, dtype_code, n, m = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FormatError(f"not a lightning_delta tensor payload (magic {bytes(magic)!r})")
    if n != numel:
        raise FormatError(f"tensor payload holds {n} elements, expected {numel}")
    try:
        mode, coding, dtype = Mode(mode), ValueCoding(coding), _DTYPES[dtype_code]
    except (ValueError, KeyError) as err:
        raise FormatError(f"tensor payload has an unknown mode, coding or dtype: {err}") from None
    if mode == Mode.RAW and (m != n or coding != ValueCoding.NONE or low_bits):
        raise FormatError("RAW tensor payload with inconsistent header fields")
    if mode == Mode.SPARSE and (m > n or coding == ValueCoding.NONE or low_bits != _low_bits(n, m)):
        raise FormatError(f"SPARSE tensor payload with inconsistent header (n={n}, m={m}, l={low_bits})")
    sections, pos = [], _HEADER.size
    for size in _section_sizes(mode, coding, n, m, low_bits):
        if pos + _SECTION.size > len(view):
            raise FormatError("tensor payload truncated inside its section table")
        compressor, stored = _SECTION.unpack_from(view, pos)
        pos += _SECTION.size
        if pos + stored > len(view):
            raise FormatError(f"tensor payload truncated: section of {stored} bytes runs past the end")
        data, pos = view[pos : pos + stored], pos + stored
        sections.append(_as_bytes_tensor(_decompress(compressor, data, size)))
    if pos != len(view):
        raise FormatError(f"tensor payload has {len(view) - pos} trailing bytes")
    return Packed(mode, coding, low_bits, dtype, n, m, tuple(sections))


# ------------------------------------------------------------------ decode: unpack and apply


def decode_change(old: Tensor | None, payload: bytes | memoryview, *, numel: int | None = None) -> Decoded:
    """Decode a payload against `old` (None for a RAW payload of `numel` elements)."""
    if old is None:
        if numel is None:
            raise ValueError("decoding without `old` needs the expected `numel`")
    else:
        _check_tensor(old)
        numel = old.numel()
    packed = parse(payload, numel)
    device = old.device if old is not None else torch.device("cpu")
    sections = [s.to(device) for s in packed.sections]
    if packed.mode == Mode.RAW:
        new = torch.stack(sections, dim=1).view(packed.dtype).view(-1)
        return Decoded(_match_dtype(new, old), None)
    if old is None:
        raise FormatError("a SPARSE tensor payload needs the previous tensor to decode against")
    if old.dtype != packed.dtype:
        raise FormatError(f"tensor payload is {packed.dtype}, the previous tensor {old.dtype}")
    n, m, low_bits = packed.n, packed.m, packed.low_bits
    bits = old.view(torch.int16)
    if m == 0:
        nothing = torch.empty(0, dtype=torch.int64, device=device)
        return Decoded(old.clone(), Change(nothing, bits[nothing], bits[nothing]))
    low = _unpack_fixed(sections[0], m, low_bits)
    ones = _unpack_bits(sections[1], _high_len(n, m, low_bits)).nonzero().squeeze(1)
    if ones.numel() != m:
        raise FormatError(f"Elias-Fano high bits hold {ones.numel()} entries, header says {m}")
    index = ((ones - torch.arange(m, device=device)) << low_bits) | low
    if int(index[-1]) >= n or bool((index[1:] <= index[:-1]).any()):
        raise FormatError("changed positions are out of range or not strictly increasing")
    if packed.values == ValueCoding.SIGN:
        step = torch.where(_unpack_bits(sections[2], m), 1, -1).to(torch.int16)
    else:
        planes = sections[2].view(2, m)
        zigzag = torch.stack((planes[0], planes[1]), dim=1).view(torch.int16).view(-1).to(torch.int32) & 0xFFFF
        if bool((zigzag == 0).any()):
            raise FormatError("a SPARSE tensor payload lists an element that did not change")
        step = ((zigzag >> 1) ^ -(zigzag & 1)).to(torch.int16)
    change = Change(index, bits[index], bits[index] + step)
    new = bits.clone()
    new[index] = change.new
    return Decoded(new.view(old.dtype), change)


def encode(old: Tensor | None, new: Tensor, options: CodecOptions | None = None) -> bytes:
    """Payload that turns `old` into `new` bit for bit; `old=None` stores `new` whole."""
    packed = pack_full(new) if old is None else pack_delta(diff(old, new), new)
    return serialize(packed.cpu(), options)


def decode(old: Tensor | None, payload: bytes | memoryview, *, numel: int | None = None) -> Tensor:
    """Inverse of `encode`: `decode(old, encode(old, new))` is bit-identical to `new`."""
    return decode_change(old, payload, numel=numel).new


# ------------------------------------------------------------------ helpers


def _low_bits(n: int, m: int) -> int:
    """Elias-Fano low-bit width: floor(log2(n / m)), 0 when m == 0 or m >= n."""
    return max(0, (n // m).bit_length() - 1) if m else 0


def _high_len(n: int, m: int, low_bits: int) -> int:
    """Length in bits of the unary high-bit array: one set bit per entry plus one zero per bucket."""
    return m + ((n - 1) >> low_bits) + 1 if m else 0


def _section_sizes(mode: Mode, coding: ValueCoding, n: int, m: int, low_bits: int) -> tuple[int, ...]:
    if mode == Mode.RAW:
        return (n, n)
    values = (m + 7) // 8 if coding == ValueCoding.SIGN else 2 * m
    return ((m * low_bits + 7) // 8, (_high_len(n, m, low_bits) + 7) // 8, values)


_COMPRESSIBLE = {Mode.RAW: (False, True), Mode.SPARSE: (False, True, True)}
"""Encoder policy: the mantissa plane and EF low bits are near-random; skip compressing them."""


def _pack_bits(bits: Tensor) -> Tensor:
    """Bools to bytes, least significant bit first."""
    padded = F.pad(bits.to(torch.uint8), (0, -bits.numel() % 8)).view(-1, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (padded << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(data: Tensor, count: int) -> Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return ((data.unsqueeze(1) >> shifts) & 1).view(-1)[:count].bool()


def _pack_fixed(values: Tensor, width: int) -> Tensor:
    """Non-negative ints below 2**width, `width` bits each, concatenated LSB first."""
    shifts = torch.arange(width, dtype=torch.int64, device=values.device)
    return _pack_bits(((values.unsqueeze(1) >> shifts) & 1).view(-1))


def _unpack_fixed(data: Tensor, count: int, width: int) -> Tensor:
    shifts = torch.arange(width, dtype=torch.int64, device=data.device)
    bits = _unpack_bits(data, count * width).view(count, width).to(torch.int64)
    return (bits << shifts).sum(dim=1)


def _match_dtype(new: Tensor, old: Tensor | None) -> Tensor:
    if old is not None and old.dtype != new.dtype:
        raise FormatError(f"tensor payload is {new.dtype}, the previous tensor {old.dtype}")
    return new


def _check_tensor(t: Tensor) -> None:
    if t.dim() != 1 or t.dtype not in DTYPE_CODES or not t.is_contiguous():
        raise ValueError(
            f"the codec takes contiguous 1-D tensors of {sorted(map(str, DTYPE_CODES))}, "
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


def _as_bytes_tensor(data: bytes | memoryview) -> Tensor:
    with warnings.catch_warnings():  # read-only buffers: we never write through these views
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


# ------------------------------------------------------------------ compressors


@dataclass(frozen=True)
class _Backend:
    compress: Callable[[memoryview, int], bytes]
    decompress: Callable[[memoryview, int], bytes]  # (data, exact size) -> bytes


_local = threading.local()  # zstd (de)compressor objects must not be shared between threads


def _zstd_compress(data: memoryview, level: int) -> bytes:
    cache = _local.__dict__.setdefault("zstd_c", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level].compress(data)


def _zstd_decompress(data: memoryview, size: int) -> bytes:
    if "zstd_d" not in _local.__dict__:
        _local.zstd_d = zstandard.ZstdDecompressor()
    return _local.zstd_d.decompress(data, max_output_size=size)


_BACKENDS = {
    Compressor.ZSTD: _Backend(_zstd_compress, _zstd_decompress),
    Compressor.LZ4: _Backend(
        lambda data, level: lz4.block.compress(data, store_size=False),
        lambda data, size: lz4.block.decompress(data, uncompressed_size=size),
    ),
}


def _decompress(code: int, data: memoryview, size: int) -> bytes | memoryview:
    try:
        compressor = Compressor(code)
    except ValueError:
        raise FormatError(f"unknown compressor code {code} in tensor payload") from None
    if compressor == Compressor.NONE:
        out: bytes | memoryview = data
    else:
        try:
            out = _BACKENDS[compressor].decompress(data, size)
        except (zstandard.ZstdError, lz4.block.LZ4BlockError) as err:
            raise FormatError(f"{compressor.name} section does not decompress: {err}") from None
    if len(out) != size:
        raise FormatError(f"{compressor.name} section holds {len(out)} bytes, expected {size}")
    return out
