"""The Triton kernels of a device walk (`device_walk`): a SPARSE payload's Elias-Fano positions and
value steps decoded a change per lane, over the segment table, in two kernels.

Change `i` is the `i`-th set bit `b` of the unary high bits, at position `(b - i) << low_bits |
low[i]`: once `count`'s per-block popcounts are summed, every lane knows its rank and decodes
alone.  The checks are local too: positions ascend within a bucket (`b - 1` set) by their low
bits and across buckets by construction, and the rank of a change larger than one is its rank
less the unit flags set before it.  Importing this module imports triton; `device_walk` does so
only when a walk is first built.

One compiled variant serves every payload of a given `LOW_BYTES` (and `CHECK`, `BLOCK`): the
table's search runs a runtime number of rounds, and no argument is specialized on its value
(Triton would otherwise compile apart the integers divisible by 16 and the 16-byte-aligned
pointers), so the variants `device_walk.prove` runs are the ones real steps run (an integer of
2**31 or more is still typed int64 by Triton: another compile, which the proof does not reach).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["count", "decode"]


@triton.jit
def _popcount8(x):
    x = x - ((x >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    return (x + (x >> 4)) & 0x0F


@triton.jit
def _mix(x):
    """checksum.py's mix, on wrapping int64 with arithmetic shifts."""
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15
    x = x ^ (x >> 32)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
    return x ^ (x >> 29)


@triton.jit
def _low_at(low, i, low_bits, low_size, mask, LOW_BYTES: tl.constexpr):
    """The `low_bits` bits of change `i`, within `LOW_BYTES` bytes at any shift."""
    at = i * low_bits
    where = at >> 3
    word = tl.zeros_like(i)
    for j in tl.static_range(LOW_BYTES):
        byte = tl.load(low + where + j, mask=mask & (where + j < low_size), other=0).to(tl.int64)
        word = word | (byte << (8 * j))
    return (word >> (at & 7)) & ((tl.zeros_like(i) + 1 << low_bits) - 1)


_COUNT_ARGS = ("high", "unit", "counts", "m", "high_bits", "result")
_DECODE_ARGS = (
    *("low", "high", "unit", "positive", "planes", "ranks", "table", "result", "touched"),
    *("n", "m", "k", "low_bits", "high_bits", "low_size", "flag_size", "rows", "search", "sign"),
)


@triton.jit(do_not_specialize=_COUNT_ARGS, do_not_specialize_on_alignment=_COUNT_ARGS)
def count(high, unit, counts, m, high_bits, result, BLOCK: tl.constexpr):
    """`counts[1 + b]`: the high bits set in block `b` (below `high_bits`: the last byte's padding
    is no change); `counts[1 + blocks + j]`: the unit flags set in byte `j` (of the first `m`).
    Program 0 also zeroes `counts[0]` and the result."""
    pid = tl.program_id(0)
    blocks = tl.num_programs(0)
    at = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = tl.minimum(tl.maximum(high_bits - at * 8, 0), 8).to(tl.int32)
    byte = tl.load(high + at, mask=keep > 0, other=0).to(tl.int32) & ((1 << keep) - 1)
    tl.store(counts + 1 + pid, tl.sum(_popcount8(byte), 0).to(tl.int64))
    keep = tl.minimum(tl.maximum(m - at * 8, 0), 8).to(tl.int32)
    flags = tl.load(unit + at, mask=keep > 0, other=0).to(tl.int32) & ((1 << keep) - 1)
    tl.store(counts + 1 + blocks + at, _popcount8(flags).to(tl.int64), mask=at < (m + 7) // 8)
    first = tl.arange(0, 4)
    mine = tl.where(pid == 0, 3, 0)  # program 0's
    tl.store(result + first, tl.zeros_like(first).to(tl.int64), mask=first < mine)
    tl.store(counts + first, tl.zeros_like(first).to(tl.int64), mask=first < mine - 2)


@triton.jit(do_not_specialize=_DECODE_ARGS, do_not_specialize_on_alignment=_DECODE_ARGS)
def decode(
    low,
    high,
    unit,
    positive,
    planes,
    ranks,
    table,
    result,
    touched,
    n,
    m,
    k,
    low_bits,
    high_bits,
    low_size,
    flag_size,
    rows,
    search,
    sign,
    CHECK: tl.constexpr,
    LOW_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """Every change of `8 * BLOCK` high bits.  CHECK: its status (`sparse_walk.Status`, the
    largest any lane finds, into `result[0]`) and the owned held changes' hashes of old and new
    values (`result[1]`, `result[2]`); otherwise add `sign * step` where the table holds it, every
    store masked by `result[0] == 0`.  `ranks` is the inclusive cumulative sum of `count`'s."""
    pid = tl.program_id(0)
    blocks = tl.num_programs(0)
    b = pid.to(tl.int64) * (8 * BLOCK) + tl.arange(0, 8 * BLOCK)
    byte = tl.load(high + (b >> 3), mask=b < high_bits, other=0).to(tl.int64)
    bit = (byte >> (b & 7)) & 1
    rank = tl.load(ranks + pid) + tl.cumsum(bit, 0) - bit
    live = (bit == 1) & (rank < m)
    status = tl.where((bit == 1) & (rank >= m), 1, 0)  # Status.EXTRA
    i = tl.where(live, rank, 0)
    bits = _low_at(low, i, low_bits, low_size, live, LOW_BYTES)
    p = ((b - i) << low_bits) | bits
    before = tl.maximum(b - 1, 0)  # the bit before: set, the change before shares the bucket
    shared = live & (b > 0) & (((tl.load(high + (before >> 3), mask=live & (b > 0), other=0) >> (before & 7)) & 1) == 1)
    ascending = ~shared | (_low_at(low, tl.maximum(i - 1, 0), low_bits, low_size, shared, LOW_BYTES) < bits)
    status = tl.maximum(status, tl.where(live & ((p >= n) | ~ascending), 2, 0))  # Status.ORDER
    live = live & (p < n)

    flags = tl.load(unit + (i >> 3), mask=live, other=0).to(tl.int64)
    up = (tl.load(positive + (i >> 3), mask=live, other=0).to(tl.int64) >> (i & 7)) & 1
    ones = tl.load(ranks + blocks + (i >> 3), mask=live, other=0) - tl.load(ranks + blocks)
    big = i - ones - _popcount8(flags & ((1 << (i & 7)) - 1))
    far = live & (((flags >> (i & 7)) & 1) == 0)
    status = tl.maximum(status, tl.where(far & (big >= k), 3, 0))  # Status.FAR
    planar = far & (big < k)
    magnitude = (
        tl.load(planes + big, mask=planar, other=0).to(tl.int64)
        | (tl.load(planes + k + big, mask=planar, other=0).to(tl.int64) << 8)
    ) + 2
    magnitude = tl.where(far, magnitude, 1)
    status = tl.maximum(status, tl.where(live & (magnitude > 32768 - up), 4, 0))  # Status.WIDE
    step = tl.where(up == 1, magnitude, -magnitude)

    lo = tl.zeros_like(p)  # the last row whose `lo` is at most p: rows past it hold more
    hi = tl.zeros_like(p) + rows
    for _ in range(search):  # rounds of the binary search over `rows` rows
        mid = (lo + hi) >> 1
        go = live & (lo < hi)
        right = tl.load(table + mid * WIDTH, mask=go, other=0) <= p
        lo = tl.where(go & right, mid + 1, lo)
        hi = tl.where(go & ~right, mid, hi)
    s = tl.maximum(lo - 1, 0)
    row = table + s * WIDTH
    found = live & (lo > 0)
    start = tl.load(row, mask=found, other=0)
    columns = tl.load(row + 5, mask=found, other=0)
    wide = tl.maximum(columns, 1)
    q = tl.load(row + 4, mask=found, other=0) + p - start
    r = q // wide - tl.load(row + 6, mask=found, other=0)
    c = q % wide - tl.load(row + 8, mask=found, other=0)
    inside = (
        (r >= 0) & (r < tl.load(row + 7, mask=found, other=0)) & (c >= 0) & (c < tl.load(row + 9, mask=found, other=0))
    )
    held = found & (p < tl.load(row + 1, mask=found, other=0)) & ((columns == 0) | inside)
    target = tl.load(row + 3, mask=held, other=0) + tl.where(
        columns == 0, p - start, r * tl.load(row + 10, mask=held, other=0) + c
    )
    where = tl.load(row + WIDTH - 1, mask=held, other=0).to(tl.pointer_type(tl.int16)) + target
    old = tl.load(where, mask=held, other=0).to(tl.int64) & 0xFFFF

    if CHECK:
        total = tl.load(ranks + blocks)  # set high bits
        larger = m - (tl.load(ranks + blocks + flag_size) - total)  # changes flagged larger than one
        status = tl.maximum(status, tl.where((pid == 0) & (larger > k), 3, 0))
        status = tl.maximum(status, tl.where((pid == 0) & ((total < m) | (larger < k)), 5, 0))  # SHORT
        mine = held & (tl.load(row + 11, mask=held, other=0) != 0)
        key = p << 16
        tl.atomic_max(result, tl.max(status, 0).to(tl.int64))
        tl.atomic_add(result + 1, tl.sum(tl.where(mine, _mix(key + old), 0), 0))
        tl.atomic_add(result + 2, tl.sum(tl.where(mine, _mix(key + ((old + step) & 0xFFFF)), 0), 0))
    else:
        write = held & ((tl.zeros_like(p) + tl.load(result)) == 0)
        tl.store(where, ((old + sign * step) & 0xFFFF).to(tl.int16), mask=write)
        tl.store(touched + s, (tl.zeros_like(s) + 1).to(tl.int32), mask=write)
