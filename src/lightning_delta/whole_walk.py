"""One pass over a RAW payload on the CPU: assemble each element, write it where the view map
puts it, and hash it into this worker's share of the payload's checksum.

A base step writes every element, so joining costs what loading costs only if each element is
touched once: torch's eager decode makes the whole payload as a temporary, the checksum hashes it
in some ten passes over int64 temporaries, and a verify-then-write follower did both twice.
Compiled by numba (nogil, so payloads go side by side on threads), the walk reads the payload's
decompressed byte planes once and only over the segments this worker holds; the checksum is a sum
over positions, so the owned segments' shares, summed over the group, are the payload's checksum.
A walk writes before it is checked: it is for a follower that holds no step (a base step), which
on a failed check still holds none.

In a tensor-parallel group a part is decompressed once, by the worker that read it (`scatter`):
`gather` takes the elements a peer's table holds, in the order its walk visits them, and the peer
writes them with `Scattered`, hashing its owned ones as its own walk would have.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from . import codec
from .sparse_walk import Segments

__all__ = ["Scattered", "WholeWalk", "compile", "count"]

_MASK64 = (1 << 64) - 1
_WALK, _GATHER, _SCATTER, _COUNT = 0, 1, 2, 3  # what the kernel does with the elements it visits
_NONE8, _NONE16 = np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.int16)


class WholeWalk:
    """One RAW payload's elements, written into parameters (`params`, flat int16 arrays) through
    a segment table (`sparse_walk.Segments`)."""

    def __init__(self, packed: codec.Packed, segments: Segments, params: Sequence[np.ndarray]) -> None:
        if packed.mode != codec.Mode.RAW:
            raise ValueError(f"only RAW payloads are walked whole, not {packed.mode.name}")
        segments.check_fits([len(p) for p in params], packed.n)
        first, second = (np.ascontiguousarray(s.numpy()) for s in packed.sections)
        if len(first) != packed.n or len(second) != packed.n:  # `codec.parse` sizes them: never, unless it changes
            raise ValueError(f"a RAW payload of {packed.n} elements has planes of {len(first)} and {len(second)}")
        self._planes = (first, second, int(packed.values == codec.ValueCoding.EXPONENT))
        self._segments, self._params = segments, params

    def apply(self) -> int:
        """Write every element this worker holds; returns the owned elements' share of the
        payload's checksum, mod 2**64."""
        total = 0
        for lo, hi, param, *geometry in self._segments.calls[:-1]:  # the last is the walk's sentinel
            total += int(_kernel()(*self._planes, self._params[param], lo, hi, *geometry, _WALK, _NONE16, 0)[0])
        return total & _MASK64

    def gather(self, segments: Segments) -> np.ndarray:
        """The elements another worker's table (`segments`, for this payload) holds, as int16 in the
        order its walk visits them: what it writes with `Scattered`."""
        if segments.n != len(self._planes[0]):
            raise ValueError(f"the segment table is for payloads of {segments.n} positions, not {len(self._planes[0])}")
        out, at = np.empty(count(segments), dtype=np.int16), 0
        for lo, hi, _, *geometry in segments.calls[:-1]:
            at = int(_kernel()(*self._planes, _NONE16, lo, hi, *geometry, _GATHER, out, at)[1])
        return out


class Scattered:
    """A payload's elements that this worker's table holds, as the worker that decompressed it sent
    them (`WholeWalk.gather`), written into parameters as `WholeWalk` would write them."""

    def __init__(self, values: np.ndarray, segments: Segments, params: Sequence[np.ndarray]) -> None:
        segments.check_fits([len(p) for p in params])
        if values.dtype != np.int16 or len(values) != count(segments):
            raise ValueError(f"{len(values)} {values.dtype} elements sent, the segment table holds {count(segments)}")
        self._values, self._segments, self._params = values, segments, params

    def apply(self) -> int:
        """Write every element; returns the owned elements' share of the payload's checksum, mod 2**64."""
        total, at = 0, 0
        for lo, hi, param, *geometry in self._segments.calls[:-1]:
            share, at = _kernel()(_NONE8, _NONE8, 0, self._params[param], lo, hi, *geometry, _SCATTER, self._values, at)
            total += int(share)
        return total & _MASK64


def count(segments: Segments) -> int:
    """How many elements a table's walk visits (a replicated one counted in each of its rows)."""
    at = 0
    for lo, hi, _, *geometry in segments.calls[:-1]:
        at = int(_kernel()(_NONE8, _NONE8, 0, _NONE16, lo, hi, *geometry, _COUNT, _NONE16, at)[1])
    return at


def compile() -> None:
    """Compile the walk now (seconds; numba caches it on disk), not in the first base step."""
    _kernel()(_NONE8, _NONE8, 1, _NONE16, 0, 0, *[0] * 9, _WALK, _NONE16, 0)


_K1 = np.int64(0x9E3779B97F4A7C15 - (1 << 64))  # checksum.py's mix, as wrapping int64 arithmetic
_K2 = np.int64(0xBF58476D1CE4E5B9 - (1 << 64))


def _whole(
    first: np.ndarray,
    second: np.ndarray,
    exponent: int,
    flat: np.ndarray,
    lo: int,
    hi: int,
    base: int,
    start: int,
    columns: int,
    row: int,
    rows: int,
    column: int,
    width: int,
    stride: int,
    owned: int,
    mode: int,
    sent: np.ndarray,
    at: int,
) -> tuple[np.int64, int]:
    """Visit the elements at payload positions [lo, hi) that the segment holds (its geometry as in
    `sparse_walk.SEGMENT_FIELDS`), a run in one span, a block one row's columns at a time, and as
    `mode` says: write them from the planes (`_WALK`), copy them into `sent` from `at` on
    (`_GATHER`), write them from `sent` (`_SCATTER`), or only count them (`_COUNT`).  Returns the
    sum of the written ones' mixes if `owned`, and where the next segment's elements start in `sent`."""
    if columns == 0:
        if mode == _COUNT:
            return np.int64(0), at + hi - lo
        return _span(first, second, exponent, flat, lo, base, hi - lo, owned, mode, sent, at), at + hi - lo
    total, end = np.int64(0), start + hi - lo  # flat positions [start, end) of the tensor
    for r in range(max(row, start // columns), min(row + rows, (end + columns - 1) // columns)):
        q0, q1 = max(r * columns + column, start), min(r * columns + column + width, end)
        if q1 > q0:
            if mode != _COUNT:
                target = base + (r - row) * stride + (q0 - r * columns - column)
                total += _span(first, second, exponent, flat, lo + q0 - start, target, q1 - q0, owned, mode, sent, at)
            at += q1 - q0
    return total, at


def _span(
    first: np.ndarray,
    second: np.ndarray,
    exponent: int,
    flat: np.ndarray,
    p0: int,
    t0: int,
    count: int,
    owned: int,
    mode: int,
    sent: np.ndarray,
    at: int,
) -> np.int64:
    """Payload positions [p0, p0 + count): into `flat` from `t0` on (from the planes, or from
    `sent` at `at` with `_SCATTER`), or from the planes into `sent` at `at` (`_GATHER`); the sum
    of the written ones' mixes if `owned`."""
    total = np.int64(0)
    for j in range(count):
        p = p0 + j
        if mode == _SCATTER:
            value = np.int64(sent[at + j]) & 0xFFFF
        else:
            a, b = np.int64(first[p]), np.int64(second[p])
            value = ((b & 0x80) << 8) | (a << 7) | (b & 0x7F) if exponent else a | (b << 8)
        bits = value - 65536 if value >= 32768 else value
        if mode == _GATHER:
            sent[at + j] = bits
            continue
        flat[t0 + j] = bits
        if owned:
            x = ((np.int64(p) << 16) + value) * _K1
            x ^= x >> 32
            x = x * _K2
            total += x ^ (x >> 29)
    return total


@functools.cache
def _kernel() -> Callable[..., tuple[np.int64, int]]:
    """`_whole`, compiled (and `_span` with it, which it calls)."""
    import numba

    global _span
    jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    _span = jit(_span)
    return jit(_whole)
