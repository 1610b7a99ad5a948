"""Fuzz every reader of stored bytes and classify what each damaged input did.

    python scripts/fuzz.py codec --cases 1000000 --seed 0   # tensor payloads through codec.decode
    python scripts/fuzz.py store --trials 10000 --seed 0    # damaged stores through DeltaLoader
    python scripts/fuzz.py store --signed --trials 10000    # signed chains, loaded with the trainer's key
    python scripts/fuzz.py codec --engine atheris           # coverage-guided (pip install atheris)
    python scripts/fuzz.py kernels --cases 10000 --seed 0   # SPARSE payloads through the device walk
    python scripts/fuzz.py mirror --trials 1000 --seed 0    # a mirror restarted on its damaged copy

Each case ends in one of these outcomes:

* refused: a `DeltaError` (the promise; mirror: a pass raised one);
* exact: the bytes the trainer held (a mutation the format does not see, say a padding bit;
  mirror: the restarted mirror serves the source's newest step exactly);
* held (mirror): no pass raised, every step it lists exact or refused, but the newest step not
  served (it stopped at damage its restart read, passed a step over for good, or the newest step
  needs an object damaged at the mirror);
* caught: a payload that decodes to other values whose checksum differs (codec target only:
  the loader refuses it, `test_reliability` shows how);
* walked (kernels): applied by the device walk (`device_walk`, Triton; on the CPU under
  TRITON_INTERPRET=1) bit for bit as torch decodes it, its partial sums checksum.py's, its undo
  exact; kernel refused: refused by the walk where torch refuses it, with nothing written;
  skipped: not SPARSE (not walked);
* split (codec): decoded in chunks, as a follower in sync takes it, or walked into the old values,
  as a vLLM engine on the CPU takes it (`sparse_walk`), the payload is refused where it decodes in
  one piece, or the other way round, or gives other values -- must never happen;
* wrong: other values that pass (codec: a checksum collision; store: weights handed out that
  are not the trainer's; signed store: a step loaded whose run, manifest or markers are not the
  trainer's signed ones; mirror: an object written that is not the trainer's, a marker written
  beside a blob that is not, a delta completed whose previous step the mirror does not list, or a
  step served with other weights) -- must never happen;
* broken (mirror): a step listed at the mirror refused although every object it needs there is
  the trainer's -- must never happen;
* other: any other exception type -- must never happen;
* bomb: peak memory over 4x the expected output plus 64 MiB -- must never happen;
* hang: a case over `--limit` seconds -- must never happen.

Random structured mutation needs nothing beyond the project; the default engine is reproducible
from `--seed`.  `tests/test_fuzz.py` runs a bounded, seeded slice of the codec, store and mirror
targets in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_delta import (
    DeltaError,
    DeltaLoader,
    DeltaPublisher,
    FormatError,
    LoaderSettings,
    Mirror,
    MirrorSettings,
    PublisherSettings,
    Store,
    codec,
    records,
    sparse_walk,
    wire,
)
from lightning_delta import format as fmt
from lightning_delta.checksum import checksum, checksum_at
from lightning_delta.retention import collect, cutoff
from lightning_delta.signing import keygen

FAILURES = ("wrong", "split", "broken", "other", "bomb", "hang")
_SLACK = 64 << 20
_MASK64 = (1 << 64) - 1


class _Hang(BaseException):
    """Raised by the alarm in a case that ran past the limit (BaseException: no `except
    Exception` in the code under test can swallow it)."""


# ----------------------------------------------------------------------------- measurement


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) << 10
    return 0


@contextlib.contextmanager
def _watched(limit: float) -> Iterator[dict]:
    """Peak memory above the start (Linux peak RSS, reset per case) and an alarm at `limit`."""
    seen: dict = {}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    start = _status("VmRSS")

    def alarm(*_):
        raise _Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    began = time.perf_counter()
    try:
        yield seen
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        seen["seconds"] = time.perf_counter() - began
        seen["memory"] = _status("VmHWM") - start


def _judge(run: Callable[[], str], expected_bytes: int, limit: float) -> tuple[str, str]:
    """(outcome, detail) of one case."""
    try:
        with _watched(limit) as seen:
            outcome = run()
    except _Hang:
        return "hang", f"over {limit} s"
    except DeltaError:
        outcome = "refused"
    except Exception as err:  # the finding: record it, keep fuzzing
        return "other", "".join(traceback.format_exception(err)[-3:])
    if seen["memory"] > 4 * expected_bytes + _SLACK:
        return "bomb", f"{seen['memory'] >> 20} MiB for {expected_bytes} bytes of output"
    return ("hang", f"{seen['seconds']:.1f} s") if seen["seconds"] > limit else (outcome, "")


# ----------------------------------------------------------------------------- codec target


def codec_corpus(seed: int) -> list[tuple[torch.Tensor | None, torch.Tensor, bytes]]:
    """(old, new, payload) seeds: RAW (both codings), SPARSE and CLASSED, every compressor, several
    densities and sizes."""
    g = torch.Generator().manual_seed(seed)
    corpus = []
    for n in (0, 1, 7, 100, 1000, 4096, 5000, 20000):
        old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        for density in (0.0, 0.01, 0.05, 0.3, 1.0):
            bits = old.view(torch.int16).clone()
            hit = torch.rand(n, generator=g) < density
            step = torch.where(torch.rand(n, generator=g) < 0.85, 1, torch.randint(-300, 300, (n,), generator=g))
            bits[hit] += step[hit].to(torch.int16)
            new = bits.view(torch.bfloat16)
            for compressor in codec.Compressor:
                options = codec.CodecOptions(compressor)
                corpus.append((old, new, codec.encode(old, new, options)))
                if density == 1.0:  # bases: bfloat16 (EXPONENT) and float16 (byte planes) codings
                    corpus.append((None, new, codec.encode(None, new, options)))
                    half = new.float().to(torch.float16)
                    corpus.append((None, half, codec.encode(None, half, options)))
    classed = codec.CodecOptions(context=codec.Context.EXPONENT)
    for n in (5000, 20000):  # CLASSED: small weights that change often, large ones that rarely do
        for dtype in (torch.bfloat16, torch.float16):
            small = torch.rand(n, generator=g) < 0.2
            old = (torch.randn(n, generator=g) * torch.where(small, 1e-3, 1.0)).to(dtype)
            hit = torch.rand(n, generator=g) < torch.where(small, 0.4, 0.01)
            step = (hit * (1 + (torch.rand(n, generator=g) < 0.1) * 4)).to(torch.int16)
            new = (old.view(torch.int16) + step).view(dtype)
            corpus.append((old, new, codec.encode(old, new, classed)))
            assert codec.parse(corpus[-1][2], n).mode == codec.Mode.CLASSED
    return corpus


def _rle_bomb(total: int, declare: bool) -> bytes:
    """A magic-less zstd frame of `total` zero bytes in 128 KiB RLE blocks (4 bytes each), with or
    without a declared content size."""
    head = bytes([0xE0]) + total.to_bytes(8, "little") if declare else bytes([0x00, 17 << 3])
    blocks, left = [], total
    while left:
        size = min(left, 1 << 17)
        left -= size
        blocks.append(((0 if left else 1) | 2 | size << 3).to_bytes(3, "little") + b"\0")
    return head + b"".join(blocks)


def mutate_payload(rng: random.Random, payload: bytes, other: bytes) -> bytes:
    data = bytearray(payload)
    kind = rng.randrange(8)
    if kind == 0 and data:  # a few bit flips
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data) * 8)
            data[i // 8] ^= 1 << (i % 8)
    elif kind == 1:  # truncated
        del data[rng.randrange(len(data) + 1) :]
    elif kind == 2:  # extended
        data += rng.randbytes(rng.randint(1, 64))
    elif kind == 3:  # spliced with another payload
        cut = rng.randrange(len(data) + 1)
        data = data[:cut] + bytearray(other[rng.randrange(len(other) + 1) :])
    elif kind == 4 and len(data) > 8:  # a header varint or byte set to something large
        data[rng.randrange(4, min(len(data), 16))] = rng.choice([0x7F, 0xFF, 0x80, 0, rng.randrange(256)])
    elif kind == 5:  # a section replaced by a zstd frame that lies about its size
        total = rng.choice([1 << 20, 3 << 29, 1 << 45])
        frame = _rle_bomb(min(total, 1 << 24), declare=rng.random() < 0.5)
        if total > 1 << 24:
            frame = bytes([0xE0]) + total.to_bytes(8, "little") + frame[9:]
        cut = rng.randrange(min(len(data), 20) + 1)
        data = data[:cut] + bytearray([1]) + bytearray(wire._varint(len(frame))) + bytearray(frame)
    elif kind == 6 and data:  # random bytes over a random range
        start = rng.randrange(len(data))
        end = min(len(data), start + rng.randint(1, 16))
        data[start:end] = rng.randbytes(end - start)
    else:  # a random element count / change count varint spliced in after the header
        head = bytes(data[:8]) if len(data) >= 8 else bytes(8)
        counts = b"".join(wire._varint(rng.choice([0, 1, 2**31, 2**40, 2**62, rng.randrange(10**6)])) for _ in range(3))
        data = bytearray(head + counts) + data[min(len(data), 11) :]
    return bytes(data)


def _in_chunks(old: torch.Tensor | None, new: torch.Tensor, payload: bytes) -> torch.Tensor | None:
    """The payload applied to `old` the way a follower in sync takes it (`codec.iter_steps`, 64
    changes at a time); None where it is refused."""

    def exponents() -> torch.Tensor:
        if old is None:
            raise FormatError("a CLASSED payload needs the previous tensor")
        return codec.exponent_bytes(old)

    try:
        out = None if old is None else old.view(torch.int16).clone()
        for steps in codec.iter_steps(
            payload, numel=new.numel(), dtype=new.dtype, device=new.device, exponents=exponents, chunk=64
        ):
            if steps.whole is not None:
                return steps.whole.view(torch.int16)
            if out is None:
                return None
            assert steps.index is not None and steps.step is not None
            out[steps.index] += steps.step
    except FormatError:
        return None
    return out


def _walked(old: torch.Tensor | None, new: torch.Tensor, payload: bytes) -> torch.Tensor | bool | None:
    """The payload walked into a copy of `old` (`sparse_walk`); None where it is refused (the walk
    then taken back, which must restore every bit), False where it is not walked (not SPARSE)."""
    if old is None or not sparse_walk.AVAILABLE or codec.mode_of(payload) != codec.Mode.SPARSE:
        return False
    try:
        packed = codec.parse(payload, new.numel())
    except FormatError:
        return None
    if packed.dtype != new.dtype:
        return None
    held = old.view(torch.int16).clone()
    whole = np.array([[0, new.numel(), 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]] if new.numel() else [], dtype=np.int64)
    whole = whole.reshape(-1, len(sparse_walk.SEGMENT_FIELDS))
    walk = sparse_walk.Walk(packed, sparse_walk.Segments(whole, new.numel()), [held.numpy()])
    try:
        walk.apply()
    except FormatError:
        walk.undo()
        if not torch.equal(held, old.view(torch.int16)):
            raise AssertionError("a refused walk, taken back, left other values") from None
        return None
    return held


def _decode_case(old: torch.Tensor | None, new: torch.Tensor, payload: bytes) -> str:
    chunked = _in_chunks(old, new, payload)
    walked = _walked(old, new, payload)
    if walked is not False and (
        (walked is None) != (chunked is None) or (chunked is not None and not torch.equal(chunked, walked))
    ):
        return "split"
    try:
        got = codec.decode(old, payload, numel=new.numel(), dtype=new.dtype)
    except DeltaError:
        if chunked is not None:
            return "split"
        raise
    if chunked is None or not torch.equal(chunked, got.view(torch.int16)):
        return "split"
    if got.dtype == new.dtype and torch.equal(got.view(torch.int16), new.view(torch.int16)):
        return "exact"
    if (got.numel(), got.dtype) != (new.numel(), new.dtype) or checksum(got.view(torch.int16)) != checksum(
        new.view(torch.int16)
    ):
        return "caught"
    return "wrong"


def fuzz_codec(cases: int, seed: int = 0, limit: float = 30.0, log: Callable[[str], None] | None = None) -> Counter:
    """Mutate seed payloads `cases` times; returns the count of each outcome."""
    rng = random.Random(seed)
    corpus = codec_corpus(seed)
    counts: Counter = Counter()
    if sparse_walk.AVAILABLE:
        sparse_walk.compile()  # its memory is the compiler's, not a case's
    for case in range(cases):
        old, new, payload = rng.choice(corpus)
        mutated = mutate_payload(rng, payload, rng.choice(corpus)[2])
        outcome, detail = _judge(partial(_decode_case, old, new, mutated), 2 * new.numel(), limit)
        counts[outcome] += 1
        if outcome in FAILURES and log:
            log(f"case {case} (seed {seed}): {outcome}: payload {mutated[:64].hex()}...\n{detail}")
    return counts


def run_atheris(seed: int, libfuzzer_args: list[str]) -> None:
    """Coverage-guided fuzzing of `codec.decode` and the part-blob parser with atheris.

    An input's first byte picks the seed tensor (bit 7 clear) or the blob parser (bit 7 set);
    the seed corpus is every codec seed payload and a published part.
    """
    import atheris

    corpus = codec_corpus(seed)[:128]
    seeds = Path(tempfile.mkdtemp(prefix="fuzz-corpus-"))
    for i, (_, _, payload) in enumerate(corpus):
        (seeds / f"payload-{i}").write_bytes(bytes([i]) + payload)
    with tempfile.TemporaryDirectory() as tmp:
        build_chain(tmp, seed)
        (seeds / "blob").write_bytes(b"\x80" + Path(tmp, fmt.blob_path(2, 0, 1)).read_bytes())

    for name in [m for m in sys.modules if m.startswith("lightning_delta")]:
        del sys.modules[name]  # imported again below, with coverage instrumentation (ours only)
    with atheris.instrument_imports(include=["lightning_delta"]):
        from lightning_delta import codec as fuzzed_codec
        from lightning_delta import format as fuzzed_format
        from lightning_delta.errors import DeltaError as FuzzedError

    def target(data: bytes) -> None:
        if not data:
            return
        try:
            if data[0] & 0x80:
                fuzzed_format.decode_blob(data[1:])
                return
            old, new, _ = corpus[data[0] % len(corpus)]
            got = fuzzed_codec.decode(old, data[1:], numel=new.numel(), dtype=new.dtype)
            bits, truth = got.view(torch.int16), new.view(torch.int16)
            if not torch.equal(bits, truth) and checksum(bits) == checksum(truth):
                raise AssertionError("a payload decoded to other values with the same checksum")
        except FuzzedError:
            pass

    atheris.Setup([sys.argv[0], *libfuzzer_args, str(seeds)], target)
    atheris.Fuzz()


# ----------------------------------------------------------------------------- kernels target


def mutate_sections(rng: random.Random, payload: bytes, n: int) -> bytes:
    """A SPARSE payload with its sections damaged and its header kept: it parses, so every case
    reaches the kernels (bytes flipped, a range of random bytes, or a whole random section)."""
    packed = codec.parse(payload, n)
    sections = [s.clone() for s in packed.sections]
    which = rng.choice([i for i, s in enumerate(sections) if s.numel()] or [0])
    section = sections[which]
    if section.numel():
        kind = rng.randrange(3)
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                section[rng.randrange(section.numel())] ^= 1 << rng.randrange(8)
        elif kind == 1:
            start = rng.randrange(section.numel())
            end = min(section.numel(), start + rng.randint(1, 16))
            section[start:end] = torch.tensor(list(rng.randbytes(end - start)), dtype=torch.uint8)
        else:
            section.copy_(torch.tensor(list(rng.randbytes(section.numel())), dtype=torch.uint8))
    return codec.serialize(replace(packed, sections=tuple(sections)), codec.CodecOptions(codec.Compressor.NONE))


def _kernel_case(old: torch.Tensor, new: torch.Tensor, payload: bytes) -> str:
    """The payload through the device walk into a copy of `old`, against torch's decoder."""
    from lightning_delta import device_walk

    decoded = _in_chunks(old, new, payload)
    packed = codec.parse(payload, new.numel())  # a refusal here is torch's too: `_in_chunks` parses first
    if packed.mode != codec.Mode.SPARSE or packed.dtype != new.dtype:
        return "refused" if decoded is None else "skipped"
    held = old.view(torch.int16).clone()
    whole = np.array([[0, new.numel(), 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]] if new.numel() else [], dtype=np.int64)
    segments = sparse_walk.Segments(whole.reshape(-1, len(sparse_walk.SEGMENT_FIELDS)), new.numel())
    walk = device_walk.DeviceWalk(packed, device_walk.DeviceTable(segments, [held], held.device), [held])
    status, before, after = walk.apply().tolist()
    if status:
        return "kernel refused" if decoded is None and torch.equal(held, old.view(torch.int16)) else "split"
    if decoded is None or not torch.equal(held, decoded):
        return "split"
    index = (decoded != old.view(torch.int16)).nonzero().view(-1)  # every step moves its value
    if (before & _MASK64, after & _MASK64) != (
        checksum_at(old.view(torch.int16)[index], index),
        checksum_at(decoded[index], index),
    ):
        return "split"
    walk.undo()
    return "walked" if torch.equal(held, old.view(torch.int16)) else "split"


def fuzz_kernels(cases: int, seed: int = 0, limit: float = 60.0, log: Callable[[str], None] | None = None) -> Counter:
    """Damage SPARSE payloads `cases` times (a quarter through `mutate_payload`, the rest in their
    sections) and run each through the device walk; returns the count of each outcome."""
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")  # before triton loads
    rng = random.Random(seed)
    corpus = [
        case for case in codec_corpus(seed) if case[0] is not None and codec.mode_of(case[2]) == codec.Mode.SPARSE
    ]
    counts: Counter = Counter()
    _kernel_case(*max(corpus, key=lambda case: len(case[2])))  # triton's import and first launches: no case's
    for case in range(cases):
        old, new, payload = rng.choice(corpus)
        if rng.random() < 0.25:
            mutated = mutate_payload(rng, payload, rng.choice(corpus)[2])
        else:
            mutated = mutate_sections(rng, payload, new.numel())
        outcome, detail = _judge(partial(_kernel_case, old, new, mutated), 2 * new.numel(), limit)
        counts[outcome] += 1
        if outcome in FAILURES and log:
            log(f"case {case} (seed {seed}): {outcome}: payload {mutated[:64].hex()}...\n{detail}")
    return counts


# ----------------------------------------------------------------------------- store target

_STEPS, _BASE_EVERY = 8, 4


def build_chain(url: str, seed: int, key: str | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """A small published chain and the trainer's state at each step: small weights change more
    often than large ones, as under Adam, so its deltas and bridges are CLASSED payloads."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.where(torch.rand(5800, generator=g) < 0.5, 2e-4, 0.02)  # half of them small
    tensors = {
        "a": (torch.randn(3000, generator=g) * scale[:3000]).to(torch.bfloat16),
        "b.weight": (torch.randn(40, 70, generator=g) * scale[3000:].view(40, 70)).to(torch.bfloat16),
        "norm": torch.ones(64, dtype=torch.bfloat16),
    }
    truth = {}
    options = codec.CodecOptions(context=codec.Context.EXPONENT)
    settings = PublisherSettings(base_every=_BASE_EVERY, codec=options, signing_key=key)
    with DeltaPublisher(url, lambda: tensors, settings) as publisher:
        for step in range(1, _STEPS + 1):
            for t in tensors.values():
                flat = t.view(-1).view(torch.int16)
                rate = torch.where(flat & 0x7FFF < 0x3A00, 0.3, 0.01)  # |w| below 2^-11: a small weight
                hit = torch.rand(flat.numel(), generator=g) < rate
                flat[hit] += 1
            truth[step] = {k: v.clone() for k, v in tensors.items()}
            publisher.publish(step)
    return truth


def _objects(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _hostile_json(rng: random.Random) -> object:
    return rng.choice(
        [
            10**30,
            -1,
            2**63,
            1e308,
            "7",
            [],
            {},
            None,
            True,
            json.loads("[" * 19 + "1" + "]" * 19),
            "x" * 300,
            0.5,
            2**40 + 1,
        ]
    )


def damage(
    rng: random.Random,
    root: Path,
    foreign: Path,
    signed: bool = False,
    objects: list[Path] | None = None,
    first: int = 1,
) -> str:
    """One random act of damage on the store at `root` (of a signed chain: signatures too);
    returns what it did.  `objects`: those it may act on (default: all); `first`: the first step
    a part is copied to."""
    objects = _objects(root) if objects is None else objects
    parts = [p for p in objects if p.name.endswith(".ldelta")]
    target = rng.choice(objects)
    kind = rng.randrange(12 if signed else 10)
    if kind >= 10:
        return mutate_signature(rng, [p for p in objects if p.suffix in (".commit", ".json")])
    if kind == 0:  # bit flips in any object
        data = bytearray(target.read_bytes())
        for _ in range(rng.randint(1, 4)):
            if data:
                i = rng.randrange(len(data) * 8)
                data[i // 8] ^= 1 << (i % 8)
        target.write_bytes(bytes(data))
        return f"flip {target.name}"
    if kind == 1:  # a payload byte changed and the marker re-signed: only checksums can tell
        part = rng.choice(parts)
        data = bytearray(part.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        _resign(part, bytes(data))
        return f"resigned flip {part.name}"
    if kind == 2:  # one header field, payload table entry or manifest field made hostile, re-signed
        if rng.random() < 0.2:
            manifest = json.loads((root / fmt.RUN_MANIFEST).read_bytes())
            node, key = _pick_field(rng, manifest)
            node[key] = _hostile_json(rng) if rng.random() < 0.5 else _nearby(rng, node[key])
            (root / fmt.RUN_MANIFEST).write_bytes(json.dumps(manifest).encode())
            return f"manifest {key}"
        part = rng.choice(parts)
        blob = part.read_bytes()
        size, count = struct.unpack_from("<II", blob, 8)
        header, table = json.loads(blob[16 : 16 + size]), bytearray(blob[16 + size : 16 + size + 24 * count])
        if table and rng.random() < 0.4:  # a length, change count or checksum of the binary table
            at = 8 * rng.randrange(len(table) // 8)
            value = int.from_bytes(table[at : at + 8], "little")
            wrong = rng.choice([value + 1, value - 1, 0, 2**63, 2**64 - 1, value * 2]) % 2**64
            table[at : at + 8] = wrong.to_bytes(8, "little")
            what = f"table word {at // 8}"
        else:
            key = rng.choice(sorted(header))
            header[key] = _hostile_json(rng) if rng.random() < 0.5 else _nearby(rng, header[key])
            what = f"header {key}"
        text = json.dumps(header).encode()
        rest = blob[16 + size + 24 * count :]
        _resign(part, fmt.MAGIC + struct.pack("<II", len(text), count) + text + bytes(table) + rest)
        return f"{what} of {part.name}"
    if kind == 3:  # truncated or extended
        data = target.read_bytes()
        target.write_bytes(data[: rng.randrange(len(data) + 1)] if rng.random() < 0.5 else data + bytes(1 << 20))
        return f"resize {target.name}"
    if kind == 4:  # deleted
        target.unlink()
        return f"delete {target.name}"
    if kind == 5:  # an object replaced by a folder
        target.unlink()
        (target / "x").mkdir(parents=True)
        return f"folder {target.name}"
    if kind == 6:  # stray names
        for name in rng.sample(["\u00b2", "5", "0" * 11 + "\uff15", "000000001005", "x.tmp", "000000000"], 3):
            folder = rng.choice([root / "steps", root / fmt.block_dir(0), target.parent])
            (folder / name).mkdir(parents=True, exist_ok=True)
        return "stray names"
    if kind == 7:  # a part and its marker copied to another step
        part = rng.choice(parts)
        step = rng.randint(first, _STEPS)
        dest = root / fmt.blob_path(step, 0, 1)
        if dest == part:
            return "copy onto itself (nothing)"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(part, dest)
        shutil.copyfile(f"{part}.commit", f"{dest}.commit")
        return f"copy {part.parent.name} to {step}"
    if kind == 8:  # a part of another run with the same layout
        step = rng.randint(first, _STEPS)
        for suffix in ("", ".commit"):
            source = foreign / (fmt.blob_path(step, 0, 1) + suffix)
            dest = root / (fmt.blob_path(step, 0, 1) + suffix)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest)
        return f"foreign part at {step}"
    # a hostile JSON object in place of a marker, the manifest or a `latest` pointer
    victim = rng.choice([p for p in objects if p.suffix in (".commit", ".json")] + [root / "latest"])
    victim.write_bytes(
        rng.choice(
            [b"[" * 100_000, b'{"step": 1000000000000}', b'{"size": 1e400}', json.dumps(_hostile_json(rng)).encode()]
        )
    )
    return f"json {victim.name}"


def mutate_signature(rng: random.Random, objects: list[Path]) -> str:
    """A signature field of a marker, the manifest or the heartbeat: truncated, one digit altered,
    doubled, another object's, null, upper-case, removed, or junk; the rest of the object kept."""
    victim = rng.choice(objects)
    try:
        raw = json.loads(victim.read_bytes())
        donor = json.loads(rng.choice(objects).read_bytes())
    except (ValueError, OSError):
        return "no signature to mutate"
    if not isinstance(raw, dict) or not isinstance(raw.get("signature"), str):
        return "no signature to mutate"
    sig: str = raw["signature"]
    at = rng.randrange(len(sig))
    choices: list[Any] = [
        sig[: rng.randrange(len(sig))],
        sig[:at] + ("0" if sig[at] != "0" else "1") + sig[at + 1 :],
        sig + sig,
        donor.get("signature") if isinstance(donor, dict) else None,
        None,
        sig.upper(),
        _hostile_json(rng),
    ]
    how = rng.randrange(len(choices) + 1)
    if how == len(choices):
        del raw["signature"]
    else:
        raw["signature"] = choices[how]
    if "signer" in raw and rng.random() < 0.3:  # the manifest's signer too
        raw["signer"] = rng.choice([None, "ed25519:" + "0" * 64, str(raw["signer"])[:-1]])
    victim.write_bytes(json.dumps(raw, separators=(",", ":"), sort_keys=True).encode())
    return f"signature {how} of {victim.name}"


def _pick_field(rng: random.Random, node: Any) -> tuple[Any, Any]:
    """A random (container, key) inside a parsed JSON object, leaves preferred."""
    while True:
        key = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or rng.random() < 0.2:
            return node, key
        node = child


def _nearby(rng: random.Random, value: Any) -> Any:
    """A plausible wrong value: what a bug, not an attacker, would write."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {"base": "delta", "delta": "base"}.get(value) if isinstance(value, str) else 0
    return value + rng.choice([-2, -1, 1, 2])


def _resign(part: Path, blob: bytes) -> None:
    """`blob` in place of the part at `part`, its marker re-signed with the marker's own kind and
    predecessor, so only what is inside the blob can tell."""
    marker = json.loads(Path(f"{part}.commit").read_bytes())
    signed = fmt.CommitMarker(
        len(blob), hashlib.sha256(blob).hexdigest(), fmt.Kind(marker["kind"]), marker["prev_step"]
    )
    part.write_bytes(blob)
    Path(f"{part}.commit").write_bytes(records.dumps(signed))


def _load_case(url: str, truth: dict, rng: random.Random, trusted: tuple[str, ...] = ()) -> str:
    loader = DeltaLoader(url, LoaderSettings(trusted_keys=trusted))
    outcomes = []
    steps = loader.steps()
    for step in [*rng.sample(range(0, _STEPS + 2), 4), None]:
        try:
            got, state = loader.state_dict(step)
        except DeltaError:
            outcomes.append("refused")
            continue
        expected = truth.get(got)
        exact = (
            expected is not None
            and got in steps
            and state.keys() == expected.keys()
            and all(torch.equal(state[k].view(torch.int16), v.view(torch.int16)) for k, v in expected.items())
        )
        if not exact:
            return "wrong"
        outcomes.append("exact")
    collect(Store(url), keep_bases=1)  # retention over a damaged store: a DeltaError or a clean run
    return "exact" if "exact" in outcomes else "refused"


def fuzz_store(
    trials: int, seed: int = 0, limit: float = 60.0, log: Callable[[str], None] | None = None, signed: bool = False
) -> Counter:
    """Damage a published chain `trials` times and load from each; returns outcome counts.

    `signed`: the chain (and the foreign one) signed by one key, loaded trusting it, and the
    damage includes signature fields (`mutate_signature`)."""
    rng = random.Random(seed)
    counts: Counter = Counter()
    logging.getLogger("lightning_delta").setLevel(logging.ERROR)  # stray names are logged, by design
    with tempfile.TemporaryDirectory() as tmp:
        pristine, foreign = Path(tmp, "pristine"), Path(tmp, "foreign")
        key, trusted = None, ()
        if signed:
            keygen(Path(tmp, "key"))
            key, trusted = str(Path(tmp, "key")), (str(Path(tmp, "key.pub")),)
        truth = build_chain(str(pristine), seed, key)
        build_chain(str(foreign), seed, key)  # same bytes, another run id (signed by the same key)
        expected = sum(t.numel() * 2 for t in truth[1].values())
        for trial in range(trials):
            root = Path(tmp, "trial")
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(pristine, root)
            acts = []
            for _ in range(rng.randint(1, 3)):
                try:
                    acts.append(damage(rng, root, foreign, signed))
                except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError, DeltaError):
                    acts.append("nothing to damage")  # earlier damage left nothing to act on
            outcome, detail = _judge(partial(_load_case, str(root), truth, rng, trusted), expected, limit)
            counts[outcome] += 1
            if outcome in FAILURES and log:
                log(f"trial {trial} (seed {seed}): {outcome} after {acts}\n{detail}")
    return counts


# ----------------------------------------------------------------------------- mirror target

_MIRRORED = 6
"""The newest step a mirror held when it stopped (its newest base: 5); the source went on to `_STEPS`."""


def _tree(root: Path) -> dict[str, bytes]:
    """Every object under `root`, by its key."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in _objects(root)}


def mirror_setups(tmp: Path, pristine: Path) -> list[tuple[Path, Path]]:
    """(source, mirror) pairs: a mirror that copied the chain at `pristine` up to step `_MIRRORED`
    and stopped, and the source it restarts from, which went on to `_STEPS`.  Caught up; passed
    over (step 3's blob damaged at the source: the mirror holds 1, 2 and base 5 on, and must never
    copy it); came late (step 3's marker reached the source after the mirror stopped, which held 4,
    which applies to it, until lost, then passed it over: restarted, the mirror copies 3 and 4 below
    its newest base)."""
    setups, published = [], _tree(pristine)
    for name, holds in (
        ("caught-up", [1, 2, 3, 4, 5, 6]),
        ("passed-over", [1, 2, 5, 6]),
        ("came-late", [1, 2, 5, 6]),
    ):
        source, early, mirror = (tmp / f"{name}-{what}" for what in ("source", "early", "mirror"))
        shutil.copytree(pristine, source)
        if name == "passed-over":
            blob = source / fmt.blob_path(3, 0, 1)
            blob.write_bytes(blob.read_bytes()[:-1])
        shutil.copytree(source, early)
        for step in range(_MIRRORED + 1, _STEPS + 1):
            shutil.rmtree(early / fmt.step_dir(step))
        if name == "came-late":
            (early / fmt.commit_path(3, 0, 1)).unlink()
        with Mirror(str(early), str(mirror), MirrorSettings(missing_after=0.0)) as m:  # came late: 3 lost
            m.sync()
        shutil.rmtree(early)
        listed = DeltaLoader(str(mirror)).steps()
        copied = _tree(mirror).items()
        if listed != holds or cutoff(Store(str(mirror)), 1) != 5 or any(published.get(k) != v for k, v in copied):
            raise AssertionError(f"the {name} mirror is not a copy of steps {holds} (newest base 5)")
        setups.append((source, mirror))
    return setups


def damage_mirror(rng: random.Random, root: Path, foreign: Path, base: int) -> str:
    """One random act of damage at a mirror's destination, where its restart reads (`cutoff`): the
    other run's manifest in place of its own; a marker of a step from its newest base `base` on
    removed, its blob torn or not (the mirror killed between them); or `damage` on the manifest and
    the objects of the steps from that base on (earlier acts' objects too), a part copied, or the
    other run's part, at a step from that base on (one the mirror lacks too)."""
    roll = rng.random()
    if roll < 0.1:
        shutil.copyfile(foreign / fmt.RUN_MANIFEST, root / fmt.RUN_MANIFEST)
        return "foreign manifest"
    folders = tuple(fmt.step_dir(s) + "/" for s in range(base, _STEPS + 1))
    reads = [root / key for key in _tree(root) if key == fmt.RUN_MANIFEST or key.startswith(folders)]
    if roll < 0.3:  # killed between a blob and its marker: the marker gone, the blob torn or whole
        marker = rng.choice([p for p in reads if p.suffix == ".commit"])
        marker.unlink()
        blob = marker.with_suffix("")
        if rng.random() < 0.5 and blob.is_file():
            data = blob.read_bytes()
            blob.write_bytes(data[: rng.randrange(len(data))])
        return f"killed before {marker.relative_to(root)}"
    return damage(rng, root, foreign, objects=reads, first=base)


def _sound(tree: dict[str, bytes], pristine: dict[str, bytes], step: int) -> bool:
    """Whether every object `step` needs at the mirror is the trainer's: the manifest, and each
    step's objects from its base on exactly those the trainer published."""
    if tree.get(fmt.RUN_MANIFEST) != pristine[fmt.RUN_MANIFEST]:
        return False
    for needed in range(step - (step - 1) % _BASE_EVERY, step + 1):
        folder = fmt.step_dir(needed) + "/"
        if {k: v for k, v in tree.items() if k.startswith(folder)} != {
            k: v for k, v in pristine.items() if k.startswith(folder)
        }:
            return False
    return True


def _wrote_wrong(root: Path, before: dict[str, bytes], after: dict[str, bytes], pristine: dict[str, bytes]) -> bool:
    """Whether a mirror's passes wrote at `root` what the trainer did not publish, committed a blob
    there that is not the trainer's, or completed a delta whose previous step it does not list
    (whose marker's name is not there: damage in its place is the loader's to refuse)."""
    for key, data in after.items():
        if before.get(key) == data:
            continue
        if pristine.get(key) != data:
            return True  # an object written that is not the trainer's
        if key.endswith(".commit"):
            blob = key.removesuffix(".commit")
            if after.get(blob) != pristine[blob]:
                return True  # a marker that commits another blob
            marker = fmt.decode_commit(data)
            if ".bridge" not in key and marker.kind == fmt.Kind.DELTA:
                assert marker.prev_step is not None
                if not (root / fmt.commit_path(marker.prev_step, 0, 1)).exists():
                    return True  # a step listed that no reader can reach
    return False


def _mirror_case(source: Path, root: Path, truth: dict, pristine: dict[str, bytes], settings: MirrorSettings) -> str:
    """A mirror restarted on its damaged destination `root`: two passes (each may raise a
    `DeltaError`), then what they wrote is checked (`_wrote_wrong`), and every step the mirror
    lists must load exactly or raise a `DeltaError`, exactly where all it needs there is the trainer's."""
    before = _tree(root)
    refused = False
    with Mirror(str(source), str(root), settings) as mirror:
        for _ in range(2):
            try:
                mirror.sync()
            except DeltaError:
                refused = True
    after = _tree(root)
    if _wrote_wrong(root, before, after, pristine):
        return "wrong"
    served = set()
    try:
        loader = DeltaLoader(str(root))
        listed = loader.steps()
    except DeltaError:
        listed = []
    for step in listed:
        try:
            got, state = loader.state_dict(step)
        except DeltaError:
            if _sound(after, pristine, step):
                return "broken"
            continue
        expected = truth.get(step)
        if got != step or expected is None or state.keys() != expected.keys():
            return "wrong"
        if not all(torch.equal(state[k].view(torch.int16), v.view(torch.int16)) for k, v in expected.items()):
            return "wrong"
        served.add(step)
    if refused:
        return "refused"
    return "exact" if _STEPS in served else "held"


def fuzz_mirror(trials: int, seed: int = 0, limit: float = 60.0, log: Callable[[str], None] | None = None) -> Counter:
    """Damage a stopped mirror's destination where its restart reads `trials` times (one to three
    acts), restart it on each (with or without `keep_bases`, passes listing or by names) and judge
    it (`_mirror_case`); returns outcome counts."""
    rng = random.Random(seed)
    counts: Counter = Counter()
    logging.getLogger("lightning_delta").setLevel(logging.CRITICAL)  # damage is logged, by design
    with tempfile.TemporaryDirectory() as tmp:
        pristine, foreign = Path(tmp, "pristine"), Path(tmp, "foreign")
        truth = build_chain(str(pristine), seed)
        build_chain(str(foreign), seed)  # same bytes, another run id
        published = _tree(pristine)
        setups = mirror_setups(Path(tmp), pristine)
        expected = sum(t.numel() * 2 for t in truth[1].values())
        for trial in range(trials):
            source, stopped = rng.choice(setups)
            root = Path(tmp, "trial")
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(stopped, root)
            acts = []
            for _ in range(rng.randint(1, 3)):
                try:  # at every setup's newest base, 5 (`mirror_setups` checks)
                    acts.append(damage_mirror(rng, root, foreign, 5))
                except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError, struct.error, DeltaError):
                    acts.append("nothing to damage")  # earlier damage left nothing to act on
            settings = MirrorSettings(keep_bases=rng.choice([None, None, 1, 2]), list_seconds=rng.choice([1e-9, 30.0]))
            outcome, detail = _judge(partial(_mirror_case, source, root, truth, published, settings), expected, limit)
            counts[outcome] += 1
            if outcome in FAILURES and log:
                log(f"trial {trial} (seed {seed}): {outcome} after {acts} on {source.name}, {settings}\n{detail}")
    return counts


# ----------------------------------------------------------------------------- command line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", choices=["codec", "kernels", "store", "mirror"])
    p.add_argument("--cases", type=int, default=100_000, help="codec cases")
    p.add_argument("--trials", type=int, default=1_000, help="store and mirror trials")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=float, default=30.0, help="seconds before a case counts as a hang")
    p.add_argument("--engine", choices=["random", "atheris"], default="random")
    p.add_argument("--signed", action="store_true", help="store: a signed chain, loaded with its key")
    ours, _, libfuzzer = " ".join(sys.argv[1:]).partition(" -- ")  # after --: libFuzzer's own flags
    args = p.parse_args(ours.split())
    logging_sink = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    if args.engine == "atheris":
        run_atheris(args.seed, libfuzzer.split())
        return 0
    if args.target == "codec":
        counts = fuzz_codec(args.cases, args.seed, args.limit, logging_sink)
    elif args.target == "kernels":
        counts = fuzz_kernels(args.cases, args.seed, args.limit, logging_sink)
    elif args.target == "mirror":
        counts = fuzz_mirror(args.trials, args.seed, args.limit, logging_sink)
    else:
        counts = fuzz_store(args.trials, args.seed, args.limit, logging_sink, signed=args.signed)
    total = sum(counts.values())
    print(f"{args.target}: {total} cases, seed {args.seed}, {time.perf_counter() - started:.0f} s")
    if args.target == "kernels":
        print(f"  {'kernel':14} {counts['walked'] + counts['kernel refused']:>10}  (reached the kernels)")
    for outcome in ("refused", "exact", "held", "caught", "walked", "kernel refused", "skipped", *FAILURES):
        print(f"  {outcome:14} {counts[outcome]:>10}")
    return 1 if any(counts[f] for f in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
