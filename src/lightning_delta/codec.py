"""The tensor codec: what changed between two 16-bit tensors, in close to its entropy.

Between adjacent RL steps ~1-3% of bf16 elements change, most by one ULP.  So a delta stores

* positions as an Elias-Fano sequence (fixed-width low bits + unary high bits), which costs
  within a few percent of the binary entropy of the changed mask and decodes with plain torch ops;
* values as the wrapped integer difference of the bit patterns, `d = new - old mod 2**16`, which
  makes a one-ULP step +-1.  Most changes are +-1, so `d` is split into a "is +-1" flag and a sign
  bit per change (bit-packed: zstd's byte-level entropy stage then gets close to their binary
  entropy, which a byte per change never could) and `|d| - 2` for the rest;
* each byte section through a pluggable compressor (zstd by default) where that pays.

Under Adam a weight moves by about the same amount whatever its size, so small weights (small
ULP) change far more often, and by more ULPs, than large ones.  A CLASSED delta therefore codes
the positions per exponent class of the old value, which the decoder holds: each class gets an
Elias-Fano sequence over its own members, so its own density (on a realistic RL sequence 0.8x
the order-0 bound of the change and 0.7x a SPARSE delta's bytes, docs/BENCHMARKS.md).  Finding
each change's rank among its class costs a stable sort of the tensor's exponent bytes: nothing on
a GPU, several times the rest of the codec on a CPU, which is why `Context.AUTO` uses it on
accelerators only.

`diff`, `pack_full` and `pack_delta` are torch code that runs on the tensors' device; only the
packed sections, a few bytes per change, go to the host for `serialize`.  `parse` validates every
length against the caller's element count before it allocates, so a hostile payload can neither
write outside the tensor nor make the decoder allocate more than the tensor's own size.
The byte layout is specified in docs/FORMAT.md ("Tensor payload").

This module is the codec's front: `encode` and `decode`, and every public name of the modules
below it, one idea each: `encoder` (diff and pack), `decoder`, `wire` (the payload's bytes),
`elias_fano` and `classed` (the positions' layouts), `bitpack`, `compressors`, and `packed` (what
passes between the stages).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .bitpack import positions_of
from .classed import exponent_bytes
from .compressors import Compressor
from .decoder import Decoded, Patch, Steps, decode_change, decode_patch, decode_steps, iter_steps
from .encoder import (
    CodecOptions,
    Context,
    diff,
    diff_at,
    diff_counted,
    may_pack_raw,
    pack_delta,
    pack_full,
)
from .packed import Change, Mode, Packed, ValueCoding
from .wire import MAGIC, byte_view, mode_of, parse, serialize

__all__ = [
    "MAGIC",
    "Change",
    "CodecOptions",
    "Compressor",
    "Context",
    "Decoded",
    "Mode",
    "Packed",
    "Patch",
    "Steps",
    "ValueCoding",
    "byte_view",
    "decode",
    "decode_change",
    "decode_patch",
    "decode_steps",
    "diff",
    "diff_at",
    "diff_counted",
    "encode",
    "exponent_bytes",
    "iter_steps",
    "may_pack_raw",
    "mode_of",
    "pack_delta",
    "pack_full",
    "parse",
    "positions_of",
    "serialize",
]


def encode(old: Tensor | None, new: Tensor, options: CodecOptions | None = None) -> bytes:
    """Payload that turns `old` into `new` bit for bit; `old=None` stores `new` whole."""
    options = options or CodecOptions()
    if old is None:
        return serialize(pack_full(new).cpu(), options)
    packed = pack_delta(diff(old, new, exponents=options.conditions(new.device)), new)
    return serialize(packed.cpu(), options)


def decode(
    old: Tensor | None,
    payload: bytes | memoryview,
    *,
    numel: int | None = None,
    dtype: torch.dtype | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Inverse of `encode`: `decode(old, encode(old, new))` is bit-identical to `new`."""
    return decode_change(old, payload, numel=numel, dtype=dtype, out=out).new
