"""The Elias-Fano layout of a sequence of changed positions, defined once: the encoder, the
decoders (torch, the CPU walk, the device kernels) and the payload's section sizes take it from here.

A sequence of `m` strictly increasing positions below `n` is stored as `low_bits(n, m)` low bits of
each position, concatenated, then the high parts in unary: position `i`'s high part `h` is set bit
`h + i` of a bit array of `high_len(n, m, low_bits)` bits.  Change `i` is the `i`-th set bit `b`,
at position `(b - i) << low_bits | low[i]`.
"""

from __future__ import annotations

__all__ = ["high_len", "low_bits"]


def low_bits(n: int, m: int) -> int:
    """Elias-Fano low-bit width: floor(log2(n / m)) - 1, at least 0 (0 when m == 0).

    One bit fewer than textbook Elias-Fano: the low bits are incompressible, while zstd codes the
    unary high bits near their entropy, so moving a bit from one to the other saved 1.4-2.9% of
    the positions' bytes on every sequence measured (docs/BENCHMARKS.md)."""
    return max(0, (n // m).bit_length() - 2) if m else 0


def high_len(n: int, m: int, low_bits: int) -> int:
    """Length in bits of the unary high-bit array: one set bit per entry plus one zero per bucket."""
    return m + ((n - 1) >> low_bits) + 1 if m else 0
