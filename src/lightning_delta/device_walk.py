"""One SPARSE payload applied on the device by Triton kernels: decoded, checked, hashed and
written in a fixed number of launches, with no host sync until the caller's one decision.

The CPU walk (`sparse_walk`) decodes changes one after another; a GPU decodes them all at once.
Change `i` of an Elias-Fano sequence is the `i`-th set bit `b` of the high bits, at position
`(b - i) << low_bits | low[i]`, so every set bit decodes on its own once its rank is known
(`kernels`).  `apply` takes five launches whatever the payload's size and its segment table:

1. zeroing which rows were written;
2. `kernels.count`: set high bits per block, and set unit flags per byte (the rank of the
   changes larger than one, which index the magnitude planes);
3. one cumulative sum of both (torch): every block's and byte's rank;
4. `kernels.decode` in check mode: every change decoded and checked (ascending and in range, its flags
   and planes consistent with the header), its owned old and new values hashed (checksum.py's
   key and mix, bit for bit) into partial sums, and a status;
5. `kernels.decode` in write mode: `old + step` (mod 2**16) stored where the segment table holds each
   change, every store masked by the status the check left on the device: a payload refused
   anywhere writes nothing anywhere, and a write taken back (`undo`, the same launch with the
   step negated) restores every bit.

Results stay device tensors (`DeviceWalk.result`): a group sums them (a status sums to 0 only
where every worker's is 0) and the caller syncs once, at its decision.  Values are int16 bit
patterns, which is what a step is (and the interpreter has no bf16 arithmetic).  Triton is
imported only when a walk is first built: a follower on the CPU does not need it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import codec, elias_fano
from .checksum import checksum_at
from .errors import FormatError
from .sparse_walk import MESSAGES, SEGMENT_FIELDS, Segments, Status

__all__ = [
    "AVAILABLE",
    "LOW_BYTES",
    "RESULT_FIELDS",
    "DeviceTable",
    "DeviceWalk",
    "decide",
    "low_bytes",
    "places",
    "prove",
]

AVAILABLE = importlib.util.find_spec("triton") is not None
"""Whether device walks can run here (triton importable; on the CPU only under TRITON_INTERPRET=1)."""

RESULT_FIELDS = ("status", "old", "new")
"""A walk's result tensor: its `Status` (0 where the payload holds together), and the partial sums,
mod 2**64 as int64, of checksum.py's hash over the owned changes' old values and new values."""

_BLOCK = 128
"""High-bit bytes a program decodes on a GPU (8 * _BLOCK bit lanes)."""
_INTERPRETED_BLOCK = 1 << 13
"""At most this many under the interpreter, which costs per program, not per lane."""
_ADDRESS = len(SEGMENT_FIELDS)
_WIDTH = _ADDRESS + 1
"""The device table's columns: the segment table's, then the address of the parameter a row names."""
_MASK64 = (1 << 64) - 1

LOW_BYTES = (1, 2, 3, 6)
"""The kernels' compiled variants by the bytes a change's low bits are read from (`low_bytes`):
each proved apart, since a compiler may get one wrong and not another."""


def low_bytes(low_bits: int) -> int:
    """The variant of `LOW_BYTES` whose reads hold `low_bits` bits at any shift in their first
    byte: 1 to 3 as the bits need (their exact fit: up to 1 change in 2**19 positions), then 6,
    which holds the widest (39 bits: 2**40 elements, `format.MAX_ELEMENTS`)."""
    needed = (7 + low_bits + 7) // 8
    return next(v for v in LOW_BYTES if v >= needed)


class DeviceTable:
    """A segment table on the device, each row with the address of the parameter it names (flat
    int16 tensors on one device): built once per plan, read by every step's walks.  It holds no
    parameter, only where each lies (`places`): a walk is given its targets, refuses them where they
    no longer lie there, and holds them for its own life (its launches write them by address)."""

    def __init__(self, segments: Segments, params: Sequence[Tensor], device: torch.device) -> None:
        if any(p.dtype != torch.int16 or p.dim() != 1 or not p.is_contiguous() or p.device != device for p in params):
            raise ValueError(f"parameters are contiguous flat int16 tensors on {device}")
        segments.check_fits([p.numel() for p in params])
        self.n, self.device = segments.n, device
        self.places = places(params)
        """Each parameter's (address, elements): what the rows were built for."""
        rows = [[*row, params[row[2]].data_ptr()] for row in segments.calls[:-1]]
        rows.append([self.n, self.n, -1, *[0] * (_WIDTH - 3)])  # past every position: the search's sentinel
        self.names = [row[2] for row in rows]
        """The parameter each row names (-1: the sentinel)."""
        self.rows = torch.tensor(rows, dtype=torch.int64).to(device)


class DeviceWalk:
    """One SPARSE payload's changes applied through a `DeviceTable`: `check` or `apply`, then
    `undo` if the step must not stay.  `result` holds the status and partial sums on the device
    until the caller decides.  Its sections belong on the table's device already (copied there
    ahead of the step, on a side stream): a copy from pageable host memory would wait.  It holds
    `targets`, which must lie where the table was built, for its own life: its launches (and an
    `undo`) write them by address."""

    def __init__(self, packed: codec.Packed, table: DeviceTable, targets: Sequence[Tensor]) -> None:
        if places(targets) != table.places:
            raise ValueError("the targets do not lie where the device table was built for: build it for them")
        if packed.mode != codec.Mode.SPARSE:
            raise ValueError(f"only SPARSE payloads are walked, not {packed.mode.name}")
        if packed.n != table.n:
            raise ValueError(f"the segment table is for payloads of {table.n} positions, not {packed.n}")
        n, m, k, low_bits, device = packed.n, packed.m, packed.k, packed.low_bits, table.device
        self._sections = _on_device(packed.sections, device)
        self._table, self._targets = table, tuple(targets)
        high_bytes = len(self._sections[1])
        self._block = (
            _BLOCK if device.type == "cuda" else min(_INTERPRETED_BLOCK, 1 << max(7, (high_bytes - 1).bit_length()))
        )
        self._blocks = -(-high_bytes // self._block)
        self._low_bytes = low_bytes(low_bits)
        flag_size = len(self._sections[2])
        self._fields = (n, m, k, low_bits, elias_fano.high_len(n, m, low_bits), len(self._sections[0]), flag_size)
        self._counts = torch.empty(1 + self._blocks + flag_size, dtype=torch.int64, device=device)
        self._ranks = self._counts
        self._touched = torch.zeros(len(table.names), dtype=torch.int32, device=device)
        self._applied = False
        self.result = torch.zeros(len(RESULT_FIELDS), dtype=torch.int64, device=device)
        """`RESULT_FIELDS`, set by `check` and `apply`."""

    def check(self) -> Tensor:
        """Decode, check and hash every change, writing nothing; returns `result`."""
        if self._blocks:  # no changes: nothing to count (`result` stays zero)
            _, m, _, _, high_bits, _, _ = self._fields
            count, _ = _kernels()
            count[(self._blocks,)](
                self._sections[1], self._sections[2], self._counts, m, high_bits, self.result, BLOCK=self._block
            )
            self._ranks = self._counts.cumsum(0)
            self._decode(check=True, sign=0)
        return self.result

    def apply(self) -> Tensor:
        """`check`, then write every change unless the check refused the payload; returns `result`
        (no host sync: the write reads the status on the device)."""
        self._touched.zero_()
        self.check()
        self._decode(check=False, sign=1)
        self._applied = True
        return self.result

    def undo(self) -> None:
        """Subtract what `apply` added: the parameters hold what they held before it (it wrote
        nothing where its check refused the payload; nothing to undo without an `apply`).  Its
        write reads `result`'s status: reduce a copy over a group, never `result` itself."""
        if self._applied:
            self._decode(check=False, sign=-1)
            self._applied = False

    def wrote(self, param: int) -> bool:
        """Whether the last `apply` wrote into parameter `param` (a host sync: for after the decision)."""
        return any(t and name == param for t, name in zip(self._touched.tolist(), self._table.names, strict=True))

    def _decode(self, *, check: bool, sign: int) -> None:
        if not self._blocks:
            return
        _, decode = _kernels()
        decode[(self._blocks,)](
            *self._sections,
            self._ranks,
            self._table.rows,
            self.result,
            self._touched,
            *self._fields,
            len(self._table.names),
            len(self._table.names).bit_length(),
            sign,
            CHECK=check,
            LOW_BYTES=self._low_bytes,
            BLOCK=self._block,
            WIDTH=_WIDTH,
        )


def places(params: Sequence[Tensor]) -> tuple[tuple[int, int], ...]:
    """Where each of `params` lies: (address, elements), which a `DeviceTable` is built for."""
    return tuple((p.data_ptr(), p.numel()) for p in params)


def _on_device(sections: Sequence[Tensor], device: torch.device) -> tuple[Tensor, ...]:
    """A payload's sections on `device`: on a GPU, staged in one pinned buffer and copied in one
    transfer that does not wait for the device (a copy from pageable memory would)."""
    if device.type == "cpu":
        return tuple(sections)
    sizes = [s.numel() for s in sections]
    staged = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    torch.cat([s.view(-1) for s in sections], out=staged)
    return tuple(staged.to(device, non_blocking=True).split(sizes))


def decide(result: Sequence[int]) -> int:
    """A walk's result once read on the host (its status, old and new partial sums: the step reads
    every walk's at once, the one wait): raises `FormatError` where the status refuses the payload,
    else returns the checksum move, mod 2**64."""
    status, old, new = result
    if status != Status.OK:
        raise FormatError(MESSAGES[Status(status)] if status in set(Status) else "tensor payloads refused")
    return (new - old) & _MASK64


_PROOF_ROWS, _PROOF_COLUMNS = 256, 128
"""The proof's synthetic tensor: 256 x 128, after a run, of which the worker holds a block of rows
8-23 and columns 32-95, as a tensor-parallel worker does."""
PROOF_CASES = ((4096, 7373), (4096, 1843), (4096, 8), (1 << 20, 2))
"""The proof's payloads, (run, changes) over the run and the tensor: one per `LOW_BYTES` variant
(1 change in 5 positions: 1 byte; 1 in 20: 2; 1 in 4,608: 3; 1 in 540,672: 6), the densest with
high bits over several of a GPU's blocks, so that ranks carry from block to block."""


def prove(device: torch.device) -> str | None:
    """Run the kernels on `device` over small synthetic steps (`PROOF_CASES`: a run and a 2-D block,
    changes of every kind: unit, planar, both signs, the widest) and compare them bit for bit with
    torch's decoder: the values written, the partial sums, and the undo.  None where they agree;
    else what failed (a compile, a launch, a device the kernels do not support, a wrong value), for
    the caller to fall back to torch before anything of the engine's is written.

    What it covers: every compiled variant a real step launches on this device (`check` and write,
    each `LOW_BYTES`, the device's block; the search's rounds are a runtime bound and no argument is
    specialized on its value or alignment, `kernels`), over blocks, a run and a 2-D slice.  What it
    cannot: a payload of 2**31 positions or more (Triton types its integers int64, another compile),
    and a fault that depends on values or addresses the proof's steps do not hold."""
    try:
        for run, changes in PROOF_CASES:
            failed = _proof(device, run, changes)
            if failed is not None:
                return f"{failed}, on a step of {changes} changes in {run + _PROOF_ROWS * _PROOF_COLUMNS} positions"
        return None
    except Exception as err:  # whatever it is, the kernels are not to be trusted here
        return f"the kernels raised {type(err).__name__}: {str(err)[:300]}"


def _proof(device: torch.device, run: int, changes: int) -> str | None:
    g = torch.Generator().manual_seed(36)
    n = run + _PROOF_ROWS * _PROOF_COLUMNS
    old = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int16)
    index = torch.randperm(n, generator=g)[:changes].sort().values
    step = torch.randint(1, 5, (index.numel(),), generator=g, dtype=torch.int16)
    step[::7] = torch.randint(1, 32768, step[::7].shape, generator=g, dtype=torch.int16)
    step[::3] = -step[::3]
    step[:2] = torch.tensor([32767, -32768], dtype=torch.int16)  # the widest steps either way
    new = old.clone()
    new.index_add_(0, index, step)  # int16 wraps, as a step does
    options = codec.CodecOptions(compressor=codec.Compressor.NONE, context=codec.Context.NONE)
    payload = codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16), options)
    packed = codec.parse(payload, n)
    steps = codec.decode_steps(payload, numel=n, dtype=torch.bfloat16, device=torch.device("cpu"), exponents=None)
    assert packed.mode == codec.Mode.SPARSE and steps.index is not None and steps.step is not None
    torch_path = old.clone()
    torch_path.index_add_(0, steps.index, steps.step)
    # the table: positions [0, run) as a run of `params[0]`, and rows 8-23, columns 32-95 of the
    # tensor after it as a block in `params[1]` (a 16 x 64 slice, as a tensor-parallel worker holds)
    columns = _PROOF_COLUMNS
    block = (slice(8, 24), slice(32, 96))
    rows = [
        [0, run, 0, 0, *[0] * 7, 1],
        [run + 8 * columns, run + 24 * columns, 1, 0, 8 * columns, columns, 8, 16, 32, 64, 64, 1],
    ]
    held = torch.cat([torch.arange(run), torch.arange(run, n).view(-1, columns)[block].reshape(-1)])
    moved = (checksum_at(torch_path[held], held) - checksum_at(old[held], held)) & _MASK64
    before = [old[:run], old[run:].view(-1, columns)[block].reshape(-1)]
    after = [torch_path[:run], torch_path[run:].view(-1, columns)[block].reshape(-1)]
    params = [t.clone().to(device) for t in before]
    walk = DeviceWalk(packed, DeviceTable(Segments(np.array(rows, dtype=np.int64), n), params, device), params)
    result = walk.apply().tolist()
    if result[0] != Status.OK or decide(result) != moved:
        return f"the kernels' status and partial sums {result} differ from torch's (status 0, a move of {moved})"
    if not all(torch.equal(p.cpu(), e) for p, e in zip(params, after, strict=True)):
        return "the kernels wrote other values than torch's decoder"
    walk.undo()
    if not all(torch.equal(p.cpu(), e) for p, e in zip(params, before, strict=True)):
        return "the kernels' undo did not restore every bit"
    return None


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The kernels (importing triton, and compiling them on first launch)."""
    from . import kernels

    return kernels.count, kernels.decode
