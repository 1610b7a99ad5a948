"""What passes between the codec's stages: a `Change` (diff -> pack), a `Packed` payload (pack ->
serialize, parse -> decode) and the header enums that say how a payload stores its tensor; and
the tensors the codec takes."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from enum import IntEnum

import torch
from torch import Tensor

from .format import DType

__all__ = ["Change", "Mode", "Packed", "ValueCoding", "check_pair", "check_tensor"]

if sys.byteorder != "little":  # the codec's byte planes are views of little-endian memory
    raise ImportError("lightning_delta.codec requires a little-endian host")

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


def check_tensor(t: Tensor) -> None:
    if t.dim() != 1 or t.dtype not in _CODED or not t.is_contiguous():
        raise ValueError(
            f"the codec takes contiguous 1-D tensors of {sorted(d.value for d in DType)}, "
            f"got {t.dtype} of shape {tuple(t.shape)}"
        )


def check_pair(old: Tensor, new: Tensor) -> None:
    check_tensor(old)
    check_tensor(new)
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        raise ValueError(
            f"old and new must match in length, dtype and device: "
            f"{old.dtype}{tuple(old.shape)}@{old.device} vs {new.dtype}{tuple(new.shape)}@{new.device}"
        )
