"""Bit packing: bools to bytes and back, fixed-width integers, and the set elements of a mask.

The codec's flag and Elias-Fano sections are bit streams, least significant bit first.  On the CPU
each step goes through numpy, several times faster there than torch's ops; elsewhere through
word-wide multiplies and shifts, so nothing leaves the device.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["pack_bits", "pack_fixed", "popcount", "positions_of", "unpack_bits", "unpack_fixed"]


def positions_of(mask: Tensor) -> Tensor:
    """The int64 positions of a 1-D bool tensor's True elements, ascending.  On the CPU through
    numpy, whose scan is 2x (16K elements) to 17x (4M) faster than torch's `nonzero` there."""
    if mask.is_cpu:
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    return mask.nonzero().squeeze(1)


_GATHER = 0x0102040810204080  # (word * _GATHER) >> 56: eight 0/1 bytes -> one byte, byte k -> bit k
_SPREAD = 0x0101010101010101  # one byte -> the same byte in all eight lanes of a word
_LANES = 0x8040201008040201 - (1 << 64)  # lane k keeps bit k (as a signed int64)


def pack_bits(bits: Tensor) -> Tensor:
    """Bools to bytes, least significant bit first: on the CPU through numpy (9x faster there),
    elsewhere one multiply per eight bits."""
    if bits.is_cpu:
        return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
    words = F.pad(bits.view(torch.uint8), (0, -bits.numel() % 8)).view(torch.int64)
    return (((words * _GATHER) >> 56) & 0xFF).to(torch.uint8)


def unpack_bits(data: Tensor, count: int) -> Tensor:
    """Bytes to `count` bools (fewer if the bytes hold fewer), least significant bit first.  On the
    CPU through numpy's table lookup, 16x faster there than the multiply."""
    if data.is_cpu:
        bits = np.unpackbits(data.numpy(), count=min(count, 8 * data.numel()), bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    lanes = (data.to(torch.int64) * _SPREAD) & _LANES
    return (lanes.view(torch.uint8) != 0)[:count]


def popcount(mask: Tensor) -> int:
    """How many of a 1-D bool tensor's elements are True (on the CPU, numpy's popcount: a bool
    `sum` there widens every element to int64)."""
    return int(np.count_nonzero(mask.numpy())) if mask.is_cpu else int(mask.sum())


def pack_fixed(values: Tensor, width: int) -> Tensor:
    """Non-negative ints below 2**width, `width` bits each, concatenated LSB first."""
    count = values.numel()
    if width > 8:  # density below 1/512: few values, expand them bit by bit
        shifts = torch.arange(width, dtype=torch.int64, device=values.device)
        return pack_bits(((values.unsqueeze(1) >> shifts) & 1).view(-1).bool())
    # Eight values of `width` bits fill exactly `width` bytes: build one int64 word per eight.
    groups = F.pad(values, (0, -count % 8)).view(-1, 8)
    word = groups[:, 0].clone(memory_format=torch.contiguous_format)
    for j in range(1, 8):
        word |= groups[:, j] << (j * width)
    return word.view(torch.uint8).view(-1, 8)[:, :width].reshape(-1)[: (count * width + 7) // 8]


def unpack_fixed(data: Tensor, count: int, width: int) -> Tensor:
    if width > 8:
        shifts = torch.arange(width, dtype=torch.int64, device=data.device)
        bits = unpack_bits(data, count * width).view(count, width).to(torch.int64)
        return (bits << shifts).sum(dim=1)
    groups = -(-count // 8)
    padded = F.pad(F.pad(data, (0, groups * width - data.numel())).view(groups, width), (0, 8 - width))
    word = padded.view(torch.int64).view(-1, 1)
    shifts = torch.arange(8, dtype=torch.int64, device=data.device) * width
    return ((word >> shifts) & ((1 << width) - 1)).view(-1)[:count]
