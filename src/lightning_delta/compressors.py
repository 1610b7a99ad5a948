"""The byte compressors of a payload's sections, and decompression bounded before it allocates."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import lz4.block
import zstandard

from .errors import FormatError

__all__ = ["Compressor", "compress", "decompress"]


class Compressor(IntEnum):
    """Byte compressor of one section; recorded per section, so a reader needs no config."""

    NONE = 0
    ZSTD = 1
    LZ4 = 2  # lz4 block format, uncompressed size implied by the payload header


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


def compress(compressor: Compressor, data: memoryview, level: int) -> bytes:
    """`data` through `compressor` (not `NONE`) at `level`, in the form `decompress` reads."""
    return _BACKENDS[compressor].compress(data, level)


def decompress(code: int, data: memoryview, size: int) -> bytes | memoryview:
    """A section stored with compressor `code`, which must hold exactly `size` bytes."""
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
