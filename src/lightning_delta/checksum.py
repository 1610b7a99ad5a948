"""The value checksum: a position-keyed sum of 64-bit hashes of 16-bit bit patterns.

    checksum(v) = sum_i mix(i * 2**16 + u_i)  mod 2**64,   u_i = v_i's bits as unsigned

`mix` is two multiply / xor-shift rounds on a two's-complement int64 (arithmetic shifts);
docs/FORMAT.md spells it out for other languages.  Because it is a *sum* over elements, a delta
changes it by `sum(mix(new) - mix(old))` over the changed positions only: the trainer keeps it
current at O(changes) per step, and a loader can check every intermediate step of a chain without
rehashing the whole shard.  Everything is torch code, so it runs on the tensor's own device.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["checksum", "checksum_update", "format_checksum", "parse_checksum"]

_MASK64 = (1 << 64) - 1
_K1 = 0x9E3779B97F4A7C15 - (1 << 64)  # as signed int64
_K2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_CHUNK = 1 << 22  # bounds the int64 temporaries to 32 MiB each


def _mix_sum(index: Tensor, bits: Tensor) -> int:
    """sum(mix(index * 2**16 + bits)) mod 2**64 for int64 `index` and 16-bit `bits`."""
    x = index * 65536 + (bits.view(torch.int16).to(torch.int64) & 0xFFFF)
    x.mul_(_K1)
    x.bitwise_xor_(x >> 32)
    x.mul_(_K2)
    x.bitwise_xor_(x >> 29)
    return int(x.sum()) & _MASK64


def checksum(bits: Tensor) -> int:
    """Checksum of a 1-D tensor of 16-bit elements, computed on its device."""
    _check_bits(bits)
    total = 0
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK]
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=bits.device)
        total += _mix_sum(index, part)
    return total & _MASK64


def checksum_update(previous: int, index: Tensor, old: Tensor, new: Tensor) -> int:
    """The checksum after the elements at `index` changed from `old` to `new`."""
    return (previous + _mix_sum(index, new) - _mix_sum(index, old)) & _MASK64


def format_checksum(value: int) -> str:
    """The manifest spelling: 16 lower-case hex digits."""
    return f"{value:016x}"


def parse_checksum(text: str) -> int:
    """Inverse of `format_checksum`; raises ValueError on anything else."""
    if len(text) != 16 or text.strip("0123456789abcdef"):
        raise ValueError(f"not a 16-digit hex checksum: {text!r}")
    return int(text, 16)


def _check_bits(bits: Tensor) -> None:
    if bits.dim() != 1 or bits.element_size() != 2:
        raise ValueError(f"expected a 1-D 16-bit tensor, got {bits.dtype} of shape {tuple(bits.shape)}")
