"""One pass over a SPARSE payload on the CPU: decode each change, write it into the engine's
parameter where the view map puts it, and hash the value it replaces and the one it leaves.

Torch's eager kernels decode a payload in some twenty passes over int64 temporaries, and a
follower that verifies before it writes walks the touched cache lines twice: on a CPU that is
three copies of the model's time at 2% changed.  Compiled by numba (a dependency of vLLM, so
present wherever a vLLM engine runs this), the walk decodes, writes and hashes in one pass, and
`undo` takes a walk back exactly (steps add mod 2**16), so a step that fails its check leaves
nothing written.  Every index a payload steers is checked before it is used: a hostile payload
stops the walk with a `FormatError`, and never reads or writes outside its arrays.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from enum import IntEnum

import numpy as np

from . import codec, elias_fano
from .errors import FormatError

__all__ = ["AVAILABLE", "MESSAGES", "SEGMENT_FIELDS", "Segments", "Status", "Walk", "compile"]

AVAILABLE = importlib.util.find_spec("numba") is not None
"""Whether the walk can run here (numba importable); the engine follower decodes with torch where
not.  numba is imported only when a walk is first compiled: vLLM's CPU workers scan every loaded
module as they start, and trip over llvmlite's (vLLM 0.32)."""

SEGMENT_FIELDS = ("lo", "hi", "param", "base", "first", "columns", "row", "rows", "column", "width", "stride", "owned")
"""The columns of a walk's segment table, one row per run of payload positions [lo, hi) that a
parameter holds: a run (`columns` 0) at `base + p - lo`; or a block of a 2-D tensor whose flat
position `first + p - lo` lies in rows [row, row + rows) and columns [column, column + width) of
its `columns`, at `base + (r - row) * stride + (c - column)`.  `owned`: this worker's partial
checksum counts it."""


class Status(IntEnum):
    """How a walk ended: OK, or why it refused the payload (`MESSAGES`)."""

    OK = 0
    EXTRA = 1
    ORDER = 2
    FAR = 3
    WIDE = 4
    SHORT = 5


MESSAGES = {
    Status.EXTRA: "Elias-Fano high bits hold more entries than the header says",
    Status.ORDER: "changed positions are out of range or not strictly increasing",
    Status.FAR: "tensor payload flags more changes larger than one than its header says",
    Status.WIDE: "a tensor payload holds a change larger than 16 bits",
    Status.SHORT: "tensor payload holds fewer changes than its header says",
}


class Segments:
    """A segment table (rows of `SEGMENT_FIELDS`) for payloads of `n` positions, checked once: its
    segments are disjoint, ascending and within the payload, and `needs[p]` is how many elements
    parameter `p` must have for every target the table names (a walk trusts the table)."""

    def __init__(self, rows: np.ndarray, n: int) -> None:
        if rows.dtype != np.int64 or rows.ndim != 2 or rows.shape[1] != len(SEGMENT_FIELDS):
            raise ValueError(
                f"a segment table is int64 of {len(SEGMENT_FIELDS)} columns, got {rows.dtype} {rows.shape}"
            )
        end, needs = 0, dict[int, int]()
        for lo, hi, param, base, first, columns, _, height, column, width, stride, _ in rows.tolist():
            if lo < end or hi > n:
                raise ValueError(f"segment ({lo}, {hi}) overlaps another or runs past the payload's {n} positions")
            end, last = hi, base + (hi - lo - 1 if columns == 0 else (height - 1) * stride + width - 1)
            if not (0 <= lo < hi and param >= 0 and base >= 0) or (
                columns and not (first >= 0 and column >= 0 and column + width <= columns and 0 < width <= stride)
            ):
                raise ValueError(f"segment ({lo}, {hi}) names elements outside parameter {param}")
            needs[param] = max(needs.get(param, 0), last + 1)
        self.n = n
        self.needs = [needs.get(p, 0) for p in range(max(needs, default=-1) + 1)]
        self.calls = [*rows.tolist(), [n, n, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
        """The kernel's calls: a segment each, then one past every segment (its changes are decoded
        and checked, held by no one here)."""

    def check_fits(self, sizes: Sequence[int], n: int | None = None) -> None:
        """Refuse (`ValueError`) parameters of `sizes` elements too small for a target the table
        names, and with `n`, a payload of another size: a walk then trusts the table."""
        if n is not None and n != self.n:
            raise ValueError(f"the segment table is for payloads of {self.n} positions, not {n}")
        if len(sizes) < len(self.needs) or any(size < need for size, need in zip(sizes, self.needs, strict=False)):
            raise ValueError(
                f"the segment table names {self.needs} elements of its parameters, which hold {list(sizes)}"
            )


class Walk:
    """One SPARSE payload's changes, applied to parameters (`params`, flat int16 arrays) through a
    segment table; `apply` once, then `undo` if the step must not stay written."""

    def __init__(self, packed: codec.Packed, segments: Segments, params: Sequence[np.ndarray]) -> None:
        if packed.mode != codec.Mode.SPARSE:
            raise ValueError(f"only SPARSE payloads are walked, not {packed.mode.name}")
        segments.check_fits([len(p) for p in params], packed.n)
        self._sections = tuple(np.ascontiguousarray(s.numpy()) for s in packed.sections)
        n, m, low_bits = packed.n, packed.m, packed.low_bits
        self._fields = (n, m, packed.k, low_bits, elias_fano.high_len(n, m, low_bits))
        self._segments, self._params = segments, params
        self._wrote: set[int] = set()
        self.applied = 0
        """How many changes the last `apply` wrote (all of them unless it raised)."""

    def apply(self) -> int:
        """Write every change; returns the owned changes' partial checksum move, mod 2**64.  A
        malformed payload raises `FormatError` with `applied` changes written (`undo` them)."""
        status, self.applied, moved = self._run(1, -1)
        if status != Status.OK:
            raise FormatError(MESSAGES[Status(status)])
        return moved & ((1 << 64) - 1)

    def wrote(self, param: int) -> bool:
        """Whether the last `apply` wrote anything into parameter `param`."""
        return param in self._wrote

    def check(self) -> int:
        """What `apply` would return, writing nothing."""
        status, _, moved = self._run(0, -1)
        if status != Status.OK:
            raise FormatError(MESSAGES[Status(status)])
        return moved & ((1 << 64) - 1)

    def undo(self, changes: int | None = None) -> None:
        """Subtract what `apply` added (its first `changes` changes, by default those of this
        walk's last `apply`): the parameters hold what they held before it."""
        self._run(-1, self.applied if changes is None else changes)
        self.applied = 0

    def _run(self, sign: int, limit: int) -> tuple[int, int, int]:
        """One kernel call a segment (`Segments.calls`), the decoder's state carried from each to the next."""
        state, moved = np.zeros(_STATE, dtype=np.int64), 0
        self._wrote.clear()
        state[_BITS], state[_LAST] = (self._sections[1][0] if len(self._sections[1]) else 0), -1
        for lo, hi, param, *geometry in self._segments.calls:
            flat = self._params[param] if param >= 0 else _NOWHERE
            status, part, held = _kernel()(*self._sections, *self._fields, state, flat, lo, hi, *geometry, sign, limit)
            moved += int(part)
            if held and sign:
                self._wrote.add(param)
            if status != Status.OK:
                return status, int(state[_SEEN]), moved
        return Status.OK, int(state[_SEEN]), moved


def compile() -> None:
    """Compile the walk now (seconds; numba caches it on disk for the next process), not in the
    first step it walks."""
    sections, state = [np.empty(0, dtype=np.uint8)] * 5, np.zeros(_STATE, dtype=np.int64)
    _kernel()(*sections, 0, 0, 0, 0, 0, state, np.empty(0, dtype=np.int16), *[0] * 11, 1, -1)


_CTZ = np.array([0] + [(i & -i).bit_length() - 1 for i in range(1, 256)], dtype=np.int64)
_K1 = np.int64(0x9E3779B97F4A7C15 - (1 << 64))  # checksum.py's mix, as wrapping int64 arithmetic
_K2 = np.int64(0xBF58476D1CE4E5B9 - (1 << 64))


def _mix(x: np.int64) -> np.int64:
    x = x * _K1
    x ^= x >> 32
    x = x * _K2
    return x ^ (x >> 29)


_NOWHERE = np.empty(0, dtype=np.int16)
_BLOCK = 256
"""Changes decoded before any is written: their loads are issued side by side, not one cache miss at a time."""
_STATE = 5
_BYTE, _BITS, _SEEN, _BIG, _LAST = range(_STATE)
"""The decoder's state between calls: the high-bit byte it is in and its bits not yet taken, the
changes and the larger-than-one changes taken, and the last position."""


def _walk(
    low: np.ndarray,
    high: np.ndarray,
    unit: np.ndarray,
    positive: np.ndarray,
    planes: np.ndarray,
    n: int,
    m: int,
    k: int,
    low_bits: int,
    high_bits: int,
    state: np.ndarray,
    flat: np.ndarray,
    lo: int,
    hi: int,
    base: int,
    first: int,
    columns: int,
    row: int,
    rows: int,
    column: int,
    width: int,
    stride: int,
    owned: int,
    sign: int,
    limit: int,
) -> tuple[int, np.int64, int]:
    """Decode changes from `state` on, up to (not including) the first at or after `hi`, and add
    each step (`sign` 1), subtract it (-1) or only hash it (0) where the segment [lo, hi) of `flat`
    holds it; stop after `limit` changes in all (no limit if negative).  Returns (status, the owned
    changes' checksum move, as if the steps were added, and how many changes it held).
    Section sizes are `codec.parse`'s, so `seen < m` and `big < k` bound every read; a position is
    checked against `n` and the one before it before anything is written."""
    moved, held = np.int64(0), 0
    at, byte, seen, big, last = state[_BYTE], state[_BITS], state[_SEEN], state[_BIG], state[_LAST]
    mask, size = (1 << low_bits) - 1, low.shape[0]
    positions, steps = np.empty(_BLOCK, dtype=np.int64), np.empty(_BLOCK, dtype=np.int64)
    targets, values = np.empty(_BLOCK, dtype=np.int64), np.empty(_BLOCK, dtype=np.int64)
    status, stop, count = 0, False, high.shape[0]
    while True:
        filled = 0  # decode a block of changes, checking each
        while at < count:
            while byte and filled < _BLOCK:
                if seen == limit:
                    stop = True
                    break
                bit = at * 8 + _CTZ[byte]
                if bit >= high_bits:  # the last byte's padding
                    byte = 0
                    break
                if seen >= m:
                    status = 1
                    break
                where, shift = (seen * low_bits) >> 3, (seen * low_bits) & 7
                if shift + low_bits <= 16 and where + 1 < size:
                    word = np.int64(low[where]) | (np.int64(low[where + 1]) << 8)
                else:
                    word, j = np.int64(0), 0
                    while j * 8 < shift + low_bits:  # within the low section while seen < m
                        if where + j < size:
                            word |= np.int64(low[where + j]) << (8 * j)
                        j += 1
                p = ((bit - seen) << low_bits) | ((word >> shift) & mask)
                if p >= n or p <= last:
                    status = 2
                    break
                if p >= hi:  # the next segment's (left untaken)
                    stop = True
                    break
                flags, flag = seen >> 3, seen & 7
                magnitude = 1
                if not (unit[flags] >> flag) & 1:
                    if big >= k:
                        status = 3
                        break
                    magnitude = (np.int64(planes[big]) | (np.int64(planes[k + big]) << 8)) + 2
                    big += 1
                up = (positive[flags] >> flag) & 1
                if magnitude > 32767 + (1 - up):
                    status = 4
                    break
                positions[filled], steps[filled] = p, magnitude if up != (sign < 0) else -magnitude
                filled += 1
                byte &= byte - 1
                last = p
                seen += 1
            if status or stop or filled == _BLOCK:
                break
            at += 1
            byte = np.int64(high[at]) if at < count else 0
        for j in range(filled):  # where they are held, and the values there: loads side by side
            p, target = positions[j], -1
            if p >= lo:
                if columns == 0:
                    target = base + p - lo
                else:
                    q = first + p - lo
                    r, c = q // columns - row, q % columns - column
                    if 0 <= r < rows and 0 <= c < width:
                        target = base + r * stride + c
            targets[j] = target
            if target >= 0:
                values[j] = np.int64(flat[target]) & 0xFFFF
        for j in range(filled):
            target = targets[j]
            if target >= 0:
                held += 1
                before = values[j]
                after = (before + steps[j]) & 0xFFFF
                if sign:
                    flat[target] = after - 65536 if after >= 32768 else after
                if owned:
                    key = positions[j] << 16
                    moved += _mix(key + after) - _mix(key + before)
        if status or stop or at >= count:
            break
    if status == 0 and at >= high.shape[0] and limit < 0 and (seen != m or big != k):
        status = 5
    state[_BYTE], state[_BITS], state[_SEEN], state[_BIG], state[_LAST] = at, byte, seen, big, last
    return status, moved, held


@functools.cache
def _kernel() -> Callable[..., tuple[int, np.int64, int]]:
    """`_walk`, compiled (and `_mix` with it, which it calls)."""
    import numba

    global _mix
    jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    _mix = jit(_mix)
    return jit(_walk)
