"""The CLASSED layout: a change's position coded as its rank among the old tensor's elements of
the same exponent, one Elias-Fano sequence per exponent class, the classes back to back.

Where each class lies in the bit streams follows from the payload's class table alone
(`ClassLayout`), which the encoder and the decoder both build; the members of each class, and
their order, from the old tensor's exponent bytes (`exponent_bytes`, `class_order`).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from . import elias_fano

__all__ = ["EXPONENT_SHIFT", "ClassLayout", "class_bits", "class_order", "exponent_bytes"]

EXPONENT_SHIFT = {torch.bfloat16: (7, 0xFF), torch.float16: (10, 0x1F)}


def exponent_bytes(t: Tensor) -> Tensor:
    """Each element's biased exponent as uint8: the class a CLASSED delta codes it in."""
    shift, mask = EXPONENT_SHIFT[t.dtype]
    shifted = t.view(torch.int16) >> shift
    return (shifted if mask == 0xFF else shifted & mask).to(torch.uint8)  # the cast keeps the low byte


def class_order(exponents: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The tensor's positions in class order (exponent, then position), and where each of the 256
    classes starts in it and how many members it has."""
    values, order = torch.sort(exponents, stable=True)
    ends = torch.searchsorted(values, torch.arange(256, dtype=torch.uint8, device=values.device), right=True)
    starts = F.pad(ends[:-1], (1, 0))
    return order, starts, ends - starts


class ClassLayout:
    """Where each class of a CLASSED payload lies in its bit streams, from the class table alone.

    Classes follow each other in both streams; a class of `n_c` members and `m_c` changes has
    `m_c * l_c` low bits and `H(n_c, m_c, l_c)` high bits, with `l_c = elias_fano.low_bits(n_c, m_c)`.
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


def _class_widths(classes: tuple[tuple[int, int, int], ...]) -> tuple[list[int], list[int]]:
    """Per class of a CLASSED payload: its Elias-Fano low-bit width and its high-bit length."""
    widths = [elias_fano.low_bits(members, changed) for _, members, changed in classes]
    highs = [
        elias_fano.high_len(members, changed, bits) for (_, members, changed), bits in zip(classes, widths, strict=True)
    ]
    return widths, highs


def class_bits(classes: tuple[tuple[int, int, int], ...]) -> tuple[int, int]:
    """Low and high bits of a CLASSED payload's positions: its classes' sequences back to back."""
    widths, highs = _class_widths(classes)
    return sum(changed * bits for (_, _, changed), bits in zip(classes, widths, strict=True)), sum(highs)
