"""One pass over a RAW payload on the CPU: assemble each element, write it where the view map
puts it, and hash it into this worker's share of the payload's checksum.

A base step writes every element, so joining costs what loading costs only if each element is
touched once: a decode makes the whole payload as a temporary, the checksum hashes it in another
pass, and a verify-then-write follower then copies it into place.
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
            total += int(_kernel()(*self._planes, self._params[param], lo, hi, *geometry, _WALK, _NONE16, 0, 0, 0)[0])
        return total & _MASK64

    def gather(self, segments: Segments, start: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """The elements another worker's table (`segments`, for this payload) holds, as int16 in the
        order its walk visits them: what it writes with `Scattered`.  With `out`, only those from
        the `start`-th on, as many as `out` holds, into `out` (a transfer's piece)."""
        if segments.n != len(self._planes[0]):
            raise ValueError(f"the segment table is for payloads of {segments.n} positions, not {len(self._planes[0])}")
        if out is None:
            out = np.empty(count(segments) - start, dtype=np.int16)
        _visit(segments, self._planes, _GATHER, out, start)
        return out


class Scattered:
    """A payload's elements that this worker's table holds, as the worker that decompressed it sent
    them (`WholeWalk.gather`), written into parameters as `WholeWalk` would write them: all of them,
    or with `start` a piece of them, from the `start`-th visited on (a transfer's piece)."""

    def __init__(
        self, values: np.ndarray, segments: Segments, params: Sequence[np.ndarray], start: int | None = None
    ) -> None:
        segments.check_fits([len(p) for p in params])
        held, first = count(segments), start or 0
        if (
            values.dtype != np.int16
            or first < 0
            or first + len(values) > held
            or (start is None and len(values) != held)
        ):
            where = "" if start is None else f" from the {start}-th"
            raise ValueError(f"{len(values)} {values.dtype} elements sent{where}, the segment table holds {held}")
        self._values, self._segments, self._params, self._start = values, segments, params, first

    def apply(self) -> int:
        """Write every element; returns the owned elements' share of the payload's checksum, mod 2**64."""
        return _visit(self._segments, (_NONE8, _NONE8, 0), _SCATTER, self._values, self._start, self._params)


def count(segments: Segments) -> int:
    """How many elements a table's walk visits (a replicated one counted in each of its rows)."""
    at = 0
    for lo, hi, _, *geometry in segments.calls[:-1]:
        at = int(_kernel()(_NONE8, _NONE8, 0, _NONE16, lo, hi, *geometry, _COUNT, _NONE16, at, 0, 0)[1])
    return at


def _visit(
    segments: Segments,
    planes: tuple[np.ndarray, np.ndarray, int],
    mode: int,
    sent: np.ndarray,
    start: int,
    params: Sequence[np.ndarray] | None = None,
) -> int:
    """Gather into `sent` (`_GATHER`), or write from it (`_SCATTER`), the elements the table's walk
    visits from the `start`-th on, as many as `sent` holds; the owned written ones' share of the
    checksum, mod 2**64.  A segment before the piece is only counted past."""
    total, at, end = 0, 0, start + len(sent)
    for lo, hi, param, *geometry in segments.calls[:-1]:
        if at >= end:
            break
        flat = params[param] if params is not None else _NONE16
        share, at = _kernel()(*planes, flat, lo, hi, *geometry, mode, sent, at, start, end)
        total += int(share)
    return total & _MASK64


def compile() -> None:
    """Compile the walk now (seconds; numba caches it on disk), not in the first base step."""
    _kernel()(_NONE8, _NONE8, 1, _NONE16, 0, 0, *[0] * 9, _WALK, _NONE16, 0, 0, 0)


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
    window: int,
    end: int,
) -> tuple[np.int64, int]:
    """Visit the elements at payload positions [lo, hi) that the segment holds (its geometry as in
    `sparse_walk.SEGMENT_FIELDS`), a run in one span, a block one row's columns at a time, and as
    `mode` says: write them from the planes (`_WALK`), copy those of visit indices [window, end)
    into `sent` (`_GATHER`, the `window`-th at 0; `at`: the segment's first element's index), write
    those from `sent` (`_SCATTER`), or only count them (`_COUNT`).  Returns the sum of the written
    ones' mixes if `owned`, and the visit index after the segment's last element."""
    if columns == 0:
        if mode == _COUNT:
            return np.int64(0), at + hi - lo
        return _clipped(
            first, second, exponent, flat, lo, base, hi - lo, owned, mode, sent, at, window, end
        ), at + hi - lo
    total, stop = np.int64(0), start + hi - lo  # flat positions [start, stop) of the tensor
    for r in range(max(row, start // columns), min(row + rows, (stop + columns - 1) // columns)):
        q0, q1 = max(r * columns + column, start), min(r * columns + column + width, stop)
        if q1 > q0:
            if mode != _COUNT:
                target = base + (r - row) * stride + (q0 - r * columns - column)
                total += _clipped(
                    first, second, exponent, flat, lo + q0 - start, target, q1 - q0, owned, mode, sent, at, window, end
                )
            at += q1 - q0
    return total, at


def _clipped(
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
    window: int,
    end: int,
) -> np.int64:
    """`_span` of the visit indices [at, at + count), all of them (`_WALK`), or those in a piece's
    [window, end) (`_GATHER`, `_SCATTER`: `sent` holds the piece)."""
    if mode == _WALK:
        return _span(first, second, exponent, flat, p0, t0, count, owned, mode, sent, 0)
    j0, j1 = max(0, window - at), min(count, end - at)
    if j1 <= j0:
        return np.int64(0)
    return _span(first, second, exponent, flat, p0 + j0, t0 + j0, j1 - j0, owned, mode, sent, at + j0 - window)


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
    """`_whole`, compiled (and `_clipped` and `_span` with it, which it calls)."""
    import numba

    global _span, _clipped
    jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    _span = jit(_span)
    _clipped = jit(_clipped)
    return jit(_whole)
