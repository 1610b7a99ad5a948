"""A forged part that only the trainer's value checksum can catch: one of its values changed,
everything else as a consistent liar would write it.  It needs nothing of pytest's: the jobs
in other venvs (tests/vllm_job.py) and processes (tests/replica_job.py) forge with it too.

The payload is encoded again with one value changed (a delta's step at one changed position is
reversed, so the same elements change and the payload keeps its mode; a whole payload has one
low mantissa bit flipped), the payload table keeps the trainer's checksum and count of changed
elements, and the commit marker is signed over the new blob.  It decodes cleanly, passes the
SHA-256 check and every format rule: a reader that hands out its values has skipped the value
checksum.  Every reading path's test of the checksum forges its part here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_delta import DeltaLoader, Store, codec
from lightning_delta import format as fmt
from lightning_delta.codec import CodecOptions, Context, Mode

MESSAGE = "does not reproduce the trainer's checksum"
"""What every reading path's `ChecksumError` says, whatever else it names."""


def payload_bits(run: fmt.Run, rank: int, payload: int, state: dict[str, Tensor]) -> Tensor:
    """Payload `payload` of `rank`'s int16 bits, read off a whole state (name -> tensor)."""
    pieces = []
    for s in run.manifest.ranks[rank][payload]:
        flat = state[run.manifest.tensors[s.tensor].name].reshape(-1).view(torch.int16)
        pieces.append(flat[s.start : s.start + s.numel])
    return torch.cat(pieces)


def forge_value(store: Store, step: int, rank: int = 0, world: int = 1, *, payload: int = 0) -> int:
    """Rewrite payload `payload` of `step`'s part of `rank` with one value changed, keeping the
    trainer's checksum; returns the position changed in the payload."""
    run = store.run()
    part = store.read_part(step, rank, world)
    numel, dtype = run.payloads[rank][payload]
    data = part.payloads[payload]
    mode = codec.mode_of(data)
    old = None
    if part.header.kind == fmt.Kind.DELTA:
        assert part.header.prev_step is not None
        old = payload_bits(run, rank, payload, DeltaLoader(store).state_dict(part.header.prev_step)[1]).clone()
    exponents = None if old is None else (lambda: codec.exponent_bytes(old.view(dtype)))
    steps = codec.decode_steps(data, numel=numel, dtype=dtype, device=torch.device("cpu"), exponents=exponents)
    if steps.whole is not None:
        honest = steps.whole.view(torch.int16)
        at, forged_bits = 0, honest.clone()
        forged_bits[at] ^= 1
    else:
        assert old is not None and steps.index is not None and steps.step is not None and steps.index.numel()
        honest = old.clone()
        honest[steps.index] = old[steps.index] + steps.step
        at, delta = int(steps.index[0]), int(steps.step[0])
        forged_bits = honest.clone()  # still changed at `at`, by another step: the same positions change
        forged_bits[at] = old[at] - delta if delta != -(1 << 15) else old[at] + 1
    assert int((forged_bits != honest).sum()) == 1
    options = CodecOptions(context=Context.EXPONENT if mode == Mode.CLASSED else Context.NONE)
    forged = codec.encode(None if old is None else old.view(dtype), forged_bits.view(dtype), options)
    assert codec.mode_of(forged) == mode, "the forged payload must be read as the trainer's was"
    entries = list(part.entries)
    entries[payload] = fmt.PayloadEntry(len(forged), entries[payload].changed, entries[payload].checksum)
    payloads = [bytes(p) for p in part.payloads]
    payloads[payload] = forged
    blob = fmt.encode_blob(part.header, entries, payloads, part.probe)
    store.objects.put(fmt.blob_path(step, rank, world), blob)
    store.objects.put(fmt.commit_path(step, rank, world), fmt.encode_commit(blob, part.header))
    return at
