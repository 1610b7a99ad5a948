"""The wire format of a run and of one rank's part of a snapshot, and where they live in a store.

A run is one manifest, `run.json`, created exclusively before the first part: the prefix belongs
to that run, and the manifest holds the run's layout (every tensor, and which slices each rank's
payloads hold), so that a part is only a few hundred bytes of header around its payloads.  A part
is two objects (docs/FORMAT.md has the byte-level rules):

* the blob `steps/<step // 1000:09d>/<step:012d>/rank-<r:05d>-of-<w:05d>.ldelta`: 8-byte magic,
  the header's length and payload count, a UTF-8 JSON header, a binary table of the payloads
  (length, changed elements, checksum), the probe as fp32, then the payloads;
* the commit marker `<same name>.commit`: JSON with the blob's size, SHA-256, kind and
  predecessor, written only after the blob, so its presence means the part is complete and a
  reader can plan which parts to fetch from markers alone.

At a base step after a rank's first, the rank also writes a *bridge*, `rank-...bridge.ldelta`: a
delta against its previous part, so a reader that holds that part never downloads the base.

A signed run (section 10 of docs/FORMAT.md) adds a `signer` and a `signature` to the manifest, a
`signature` to every marker (over a `PartStatement`: the marker, its run and its place) and a
`heartbeat.json`; this module says what each signature signs, `signing` signs and checks.

Every JSON object goes through `records.loads`, so unknown or missing keys, wrong types and
out-of-range numbers are all `FormatError`: a reader refuses foreign objects rather than guess.
Every size a reader allocates for is bounded here, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import struct
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from . import records
from .errors import ChainError, ChecksumError, FormatError

__all__ = [
    "MAX_ELEMENTS",
    "MAX_HEADER_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_MARKER_BYTES",
    "MAX_PAYLOADS",
    "MAX_PROBE",
    "MAX_STEP",
    "MAX_WORLD_SIZE",
    "PART_FORMAT",
    "RUN_FORMAT",
    "RUN_MANIFEST",
    "HEARTBEAT",
    "CommitMarker",
    "DType",
    "Kind",
    "Head",
    "Heartbeat",
    "Part",
    "PartHeader",
    "PartName",
    "PartPlace",
    "PartRef",
    "PayloadEntry",
    "Run",
    "RunManifest",
    "SliceSpec",
    "TensorSpec",
    "blob_path",
    "block_dir",
    "check_run_id",
    "commit_marker",
    "commit_path",
    "decode_blob",
    "decode_commit",
    "decode_head",
    "decode_heartbeat",
    "decode_manifest",
    "encode_blob",
    "encode_commit",
    "encode_manifest",
    "head_end",
    "heartbeat_signed_bytes",
    "parse_block_name",
    "parse_part",
    "parse_part_name",
    "parse_step_name",
    "part_signed_bytes",
    "run_signed_bytes",
    "step_dir",
    "verify_blob",
]

MAGIC = b"LDELTA\x00\x05"
PART_FORMAT = "lightning_delta/5"
COMMIT_FORMAT = "lightning_delta.commit/3"
RUN_FORMAT = "lightning_delta.run/3"
RUN_MANIFEST = "run.json"
HEARTBEAT = "heartbeat.json"
HEARTBEAT_FORMAT = "lightning_delta.heartbeat/1"
PART_SIGNATURE = "lightning_delta.part-signature/1"
"""The `format` of the statement a commit marker's signature signs (section 10)."""
_COMMIT_FORMAT_V2 = "lightning_delta.commit/2"  # before signatures: still read, as unsigned
_RUN_FORMAT_V2 = "lightning_delta.run/2"

MAX_HEADER_BYTES = 64 << 10
"""A part's JSON header is ~250 bytes; its payloads are listed in the binary table after it."""
MAX_PAYLOADS = 1 << 20
"""Payloads of one part (24 bytes each in its table): a rank's slices come in far fewer."""
MAX_MARKER_BYTES = 4096
MAX_MANIFEST_BYTES = 256 << 20
"""The layout of every rank: ~40 bytes a slice, so a 1,000-tensor model on 4,096 ranks fits."""
MAX_ELEMENTS = 1 << 40
"""Elements of one tensor, one payload and one part.  The checksum keys element i as i * 2**16 in an
int64, so positions must stay below 2**47; 2**40 (2 TiB of bf16 in one rank's part) leaves room."""
MAX_OBJECT_BYTES = 1 << 44
"""A blob's size in its marker: a part of MAX_ELEMENTS elements stored whole is 2**41 bytes."""
MAX_PROBE = 1 << 24
"""Probe log-probs in one part: a fixed probe batch is thousands of values, not millions."""
MAX_STEP = 10**12 - 1  # step folders have 12 digits
MAX_WORLD_SIZE = 99_999  # part names have 5 digits for rank and world size

_PREFIX = struct.Struct("<8sII")  # magic, JSON header bytes, payloads
_ENTRY = struct.Struct("<QQQ")  # a payload's length, changed elements, checksum
_PART_NAME = re.compile(r"rank-([0-9]{5})-of-([0-9]{5})(\.bridge)?\.ldelta\.commit")  # \d takes fullwidth digits
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SIGNER = re.compile(r"ed25519:[0-9a-f]{64}")
_SIGNATURE = re.compile(r"[0-9a-f]{128}")


_TorchDType = torch.dtype  # named here: inside DType, `torch` is its property


class DType(str, Enum):
    """Every 16-bit element type of the format, named once: the manifest spells a tensor's dtype by
    its value, a tensor payload by its `code` (docs/FORMAT.md sections 3 and 4)."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    int16 = "int16"  # tensor payloads only: a run ships floating-point weights

    @property
    def torch(self) -> _TorchDType:
        return _TORCH[self]

    @property
    def code(self) -> int:
        return _CODES[self]

    @property
    def shipped(self) -> bool:
        """Whether a run may ship tensors of this type."""
        return self is not DType.int16

    @classmethod
    def of(cls, dtype: _TorchDType | str) -> DType:
        """The format's name of a torch dtype, or of its spelling in a config ("bfloat16")."""
        if isinstance(dtype, str):
            return cls(dtype)
        for member, value in _TORCH.items():
            if value == dtype:
                return member
        raise ValueError(f"{dtype} is not a 16-bit type of this format ({', '.join(d.value for d in cls)})")

    @classmethod
    def from_code(cls, code: int) -> DType:
        for member, value in _CODES.items():
            if value == code:
                return member
        raise ValueError(f"dtype code {code}")


_TORCH = {DType.bfloat16: torch.bfloat16, DType.float16: torch.float16, DType.int16: torch.int16}
_CODES = {DType.bfloat16: 1, DType.float16: 2, DType.int16: 3}
_SHIPPED = frozenset(d.value for d in DType if d.shipped)


class Kind(str, Enum):
    BASE = "base"  # every element stored; starts a chain
    DELTA = "delta"  # changes against the same rank's part at `prev_step`


# ----------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model as the trainer ships it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def check(self) -> None:
        _require(0 < len(self.name) <= 1024, f"tensor name of {len(self.name)} characters")
        _require(self.dtype in _SHIPPED, f"tensor {self.name!r}: dtype {self.dtype!r}")
        size = 1
        for dim in self.shape:  # each factor bounded, so the product never grows past the bound
            _require(0 <= dim <= MAX_ELEMENTS, f"tensor {self.name!r}: shape {self.shape}")
            size *= dim
            _require(size <= MAX_ELEMENTS, f"tensor {self.name!r}: shape {self.shape} over {MAX_ELEMENTS} elements")


@dataclass(frozen=True)
class SliceSpec:
    """Elements `[start, start + numel)` of tensor number `tensor`, row-major flattened."""

    tensor: int
    start: int
    numel: int


Layout = tuple[tuple[SliceSpec, ...], ...]
"""One rank's payloads, each the slices whose elements it holds back to back."""


@dataclass(frozen=True)
class RunManifest:
    """`run.json`: which run owns the prefix, and what every rank's parts hold.

    Created exclusively, never rewritten; every part names its SHA-256.
    """

    run_id: str
    world_size: int
    created: float  # unix seconds, informational
    tensors: tuple[TensorSpec, ...]
    ranks: tuple[Layout, ...]  # per rank
    part_format: str = PART_FORMAT
    format: str = RUN_FORMAT
    signer: str | None = None  # the public key that signs the run's manifest, markers and heartbeat
    signature: str | None = None  # of `run_signed_bytes` by `signer`

    def check(self) -> None:
        """Section 3's rules: every tensor is tiled exactly by the slices of all ranks."""
        _require(
            self.format in (RUN_FORMAT, _RUN_FORMAT_V2),
            f"format {self.format!r}; this reader understands {RUN_FORMAT!r} and {_RUN_FORMAT_V2!r}",
        )
        _check_signed(self.signer, self.signature, self.format == RUN_FORMAT)
        _require(self.part_format == PART_FORMAT, f"parts of format {self.part_format!r}, not {PART_FORMAT!r}")
        _require(bool(_RUN_ID.fullmatch(self.run_id)), f"run_id {self.run_id[:40]!r}")
        _require(1 <= self.world_size <= MAX_WORLD_SIZE, f"world_size {self.world_size}")
        _require(len(self.ranks) == self.world_size, f"layouts of {len(self.ranks)} ranks for {self.world_size}")
        for spec in self.tensors:
            spec.check()
        _require(len({t.name for t in self.tensors}) == len(self.tensors), "a tensor name repeats")
        pieces: list[list[tuple[int, int]]] = [[] for _ in self.tensors]
        for rank, layout in enumerate(self.ranks):
            total = 0
            for i, payload in enumerate(layout):
                _require(len(payload) > 0, f"rank {rank} payload {i} holds no slice")
                dtypes = set()
                for s in payload:
                    _require(0 <= s.tensor < len(self.tensors), f"rank {rank} payload {i}: tensor {s.tensor}")
                    spec = self.tensors[s.tensor]
                    _require(
                        s.start >= 0 and s.numel >= 0 and s.start + s.numel <= spec.numel,
                        f"rank {rank}: slice [{s.start}, +{s.numel}) of {spec.name!r} {spec.shape}",
                    )
                    dtypes.add(spec.dtype)
                    pieces[s.tensor].append((s.start, s.numel))
                    total += s.numel
                _require(len(dtypes) == 1, f"rank {rank} payload {i} mixes dtypes")
            _require(total <= MAX_ELEMENTS, f"rank {rank} holds {total} elements, over {MAX_ELEMENTS}")
        for spec, found in zip(self.tensors, pieces, strict=True):
            _require(bool(found), f"no rank holds tensor {spec.name!r}")
            end = 0
            for start, numel in sorted(p for p in found if p[1]):
                _require(start == end, f"{spec.name!r}: slices leave a gap or overlap at element {end}")
                end += numel
            _require(end == spec.numel, f"{spec.name!r}: slices cover {end} of {spec.numel} elements")


@dataclass(frozen=True)
class _RunManifestV2:
    """A run manifest of format version 2 (before signatures): read as an unsigned `RunManifest`."""

    run_id: str
    world_size: int
    created: float
    tensors: tuple[TensorSpec, ...]
    ranks: tuple[Layout, ...]
    part_format: str
    format: str

    def check(self) -> None:
        _require(
            self.format == _RUN_FORMAT_V2,
            f"format {self.format!r} without the keys 'signer' and 'signature' (version 2's keys, "
            f"{_RUN_FORMAT_V2!r}): a {RUN_FORMAT!r} manifest holds both, null if unsigned",
        )
        self.upgrade().check()

    def upgrade(self) -> RunManifest:
        return RunManifest(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclass(frozen=True)
class Run:
    """A run manifest with its digest and what readers derive from it once."""

    manifest: RunManifest
    sha256: str  # of `run.json`'s bytes: every part names it

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @cached_property
    def payloads(self) -> tuple[tuple[tuple[int, torch.dtype], ...], ...]:
        """Per rank, per payload: (elements, dtype)."""
        tensors = self.manifest.tensors
        return tuple(
            tuple((sum(s.numel for s in p), DType(tensors[p[0].tensor].dtype).torch) for p in layout)
            for layout in self.manifest.ranks
        )

    def numel(self, rank: int) -> int:
        return sum(n for n, _ in self.payloads[rank])


# ----------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class PayloadEntry:
    """One codec payload: what it takes in the blob and what it decodes to (checked)."""

    length: int  # bytes; payloads follow the probe back to back, in layout order
    changed: int  # elements changed since the previous part (all of them in a base)
    checksum: int  # `checksum.checksum` of its reconstructed elements, as u64

    def check(self) -> None:
        _require(self.length <= MAX_OBJECT_BYTES, f"payload of {self.length} bytes")
        _require(self.changed <= MAX_ELEMENTS, f"payload with {self.changed} changes")


@dataclass(frozen=True)
class PartHeader:
    """What a reader needs besides the run manifest to link and verify one rank's part."""

    manifest: str  # SHA-256 of the run manifest: a part of another run, or another layout, is never ours
    step: int
    prev_step: int | None  # the same rank's previous part, which a delta applies to
    kind: Kind
    rank: int
    world_size: int
    created: float  # unix seconds, informational
    probe: int  # fp32 probe log-probs stored before the payloads (0: none published)
    format: str = PART_FORMAT

    def check(self) -> None:
        """The rules of docs/FORMAT.md section 2 that the header alone can break."""
        _require(self.format == PART_FORMAT, f"format {self.format!r}; this reader understands {PART_FORMAT!r}")
        _require(bool(_SHA256.fullmatch(self.manifest)), "manifest is not 64 lower-case hex digits")
        _require(0 <= self.step <= MAX_STEP, f"step {self.step}")
        _require(0 <= self.rank < self.world_size <= MAX_WORLD_SIZE, f"rank {self.rank} of {self.world_size}")
        if self.kind == Kind.BASE:
            _require(self.prev_step is None, "a base with a prev_step")
        else:
            _require(self.prev_step is not None and 0 <= self.prev_step < self.step, f"prev_step {self.prev_step}")
        _require(0 <= self.probe <= MAX_PROBE, f"probe of {self.probe} values")


@dataclass(frozen=True)
class Head:
    """What a blob says before its probe and payloads: enough to describe a part."""

    header: PartHeader
    entries: tuple[PayloadEntry, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(e.length for e in self.entries)

    @property
    def changed(self) -> int:
        return sum(e.changed for e in self.entries)


@dataclass(frozen=True)
class Part:
    """A parsed blob: its header, payload table, probe and payloads (views of the blob)."""

    header: PartHeader
    entries: tuple[PayloadEntry, ...]
    probe: tuple[float, ...] | None
    payloads: tuple[memoryview, ...]


@dataclass(frozen=True)
class PartRef:
    """A committed part as its commit marker describes it: what a reader plans with."""

    step: int
    kind: Kind
    prev_step: int | None  # None for a base
    size: int  # bytes of its blob: what fetching it costs
    bridge: bool = False  # the delta written beside a base
    sha256: str = ""  # of its blob, from the marker: what the fetched bytes are checked against
    signature: str | None = None  # the marker's (checked where the marker was read, if keys are trusted)

    @property
    def marker(self) -> CommitMarker:
        return CommitMarker(self.size, self.sha256, self.kind, self.prev_step, signature=self.signature)


class PartPlace(NamedTuple):
    """Where a commit marker was found: what its signature binds besides the marker's own fields."""

    step: int
    rank: int
    world_size: int
    bridge: bool


@dataclass(frozen=True)
class CommitMarker:
    """Written after its blob: the part counts from then on, its bytes are pinned, and a reader
    learns what it is (and what it costs) without fetching it."""

    size: int
    sha256: str
    kind: Kind
    prev_step: int | None
    format: str = COMMIT_FORMAT
    signature: str | None = None  # of `part_signed_bytes`, by the run's signer

    def check(self) -> None:
        _require(
            self.format in (COMMIT_FORMAT, _COMMIT_FORMAT_V2),
            f"format {self.format!r}, expected {COMMIT_FORMAT!r} (or {_COMMIT_FORMAT_V2!r})",
        )
        _require(self.signature is None or self.format == COMMIT_FORMAT, "a signature in a version 2 marker")
        _require(self.signature is None or bool(_SIGNATURE.fullmatch(self.signature)), "malformed signature")
        _require(0 <= self.size <= MAX_OBJECT_BYTES, f"size {self.size}")
        _require(bool(_SHA256.fullmatch(self.sha256)), "sha256 is not 64 lower-case hex digits")
        _require((self.kind == Kind.BASE) == (self.prev_step is None), f"a {self.kind.value} with prev_step")
        _require(self.prev_step is None or 0 <= self.prev_step <= MAX_STEP, f"prev_step {self.prev_step}")


@dataclass(frozen=True)
class _CommitMarkerV2:
    """A commit marker of format version 2 (before signatures): read as an unsigned `CommitMarker`."""

    size: int
    sha256: str
    kind: Kind
    prev_step: int | None
    format: str

    def check(self) -> None:
        _require(
            self.format == _COMMIT_FORMAT_V2,
            f"format {self.format!r} without the key 'signature' (version 2's keys, {_COMMIT_FORMAT_V2!r}): "
            f"a {COMMIT_FORMAT!r} marker holds it, null if unsigned",
        )
        self.upgrade().check()

    def upgrade(self) -> CommitMarker:
        return CommitMarker(self.size, self.sha256, self.kind, self.prev_step, self.format)


@dataclass(frozen=True)
class PartStatement:
    """What a commit marker's signature signs (section 10): the marker, and where it belongs."""

    run_id: str
    manifest: str  # SHA-256 of `run.json`'s bytes (the signed manifest, signature included)
    step: int
    rank: int
    world_size: int
    kind: str  # "base", "delta" or "bridge"
    prev_step: int | None
    size: int
    sha256: str
    format: str = PART_SIGNATURE


@dataclass(frozen=True)
class Heartbeat:
    """`heartbeat.json`, rewritten on a cadence by rank 0 of a signed run: the trainer was alive at
    `time` and had committed `step` (None: none yet), so a follower tells "no new step yet" from
    "new steps withheld" (TUF's timestamp role)."""

    run_id: str
    manifest: str
    step: int | None
    time: float  # unix seconds
    signature: str | None = None  # of `heartbeat_signed_bytes` by the run's signer
    format: str = HEARTBEAT_FORMAT

    def check(self) -> None:
        _require(self.format == HEARTBEAT_FORMAT, f"format {self.format!r}, expected {HEARTBEAT_FORMAT!r}")
        _require(bool(_RUN_ID.fullmatch(self.run_id)), f"run_id {self.run_id[:40]!r}")
        _require(bool(_SHA256.fullmatch(self.manifest)), "manifest is not 64 lower-case hex digits")
        _require(self.step is None or 0 <= self.step <= MAX_STEP, f"step {self.step}")
        _require(self.signature is None or bool(_SIGNATURE.fullmatch(self.signature)), "malformed signature")


def _check_signed(signer: str | None, signature: str | None, may_sign: bool) -> None:
    _require((signer is None) == (signature is None), "a signer without a signature, or a signature without one")
    _require(signer is None or may_sign, "a signature in a version 2 manifest")
    _require(signer is None or bool(_SIGNER.fullmatch(signer)), "signer is not 'ed25519:' and 64 hex digits")
    _require(signature is None or bool(_SIGNATURE.fullmatch(signature)), "malformed signature")


def check_run_id(run_id: str) -> str:
    """`run_id`, if it is a valid one (what a user passes to resume a run)."""
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id must be 1-128 letters, digits, '.', '_' or '-', got {run_id!r}")
    return run_id


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


# ----------------------------------------------------------------------------- names


STEPS_PER_BLOCK = 1000
"""Step folders are grouped in blocks, so a poll lists one block, not the whole run."""
_BLOCK_NAME = re.compile(r"[0-9]{9}")
_STEP_NAME = re.compile(r"[0-9]{12}")


class PartName(NamedTuple):
    rank: int
    world_size: int
    bridge: bool


def block_dir(block: int) -> str:
    return f"steps/{block:09d}"


def step_dir(step: int) -> str:
    return f"{block_dir(step // STEPS_PER_BLOCK)}/{step:012d}"


def blob_path(step: int, rank: int, world_size: int, *, bridge: bool = False) -> str:
    return f"{step_dir(step)}/rank-{rank:05d}-of-{world_size:05d}{'.bridge' if bridge else ''}.ldelta"


def commit_path(step: int, rank: int, world_size: int, *, bridge: bool = False) -> str:
    return blob_path(step, rank, world_size, bridge=bridge) + ".commit"


def parse_block_name(name: str) -> int | None:
    """The block of a folder name under `steps/`, None for any other name."""
    return int(name) if _BLOCK_NAME.fullmatch(name) else None


def parse_step_name(name: str, block: int) -> int | None:
    """The step of a folder name in `block`, None for any other name or a step of another block."""
    if not _STEP_NAME.fullmatch(name) or int(name) // STEPS_PER_BLOCK != block:
        return None
    return int(name)


def parse_step_key(key: str) -> int | None:
    """The step whose folder holds `key` (a part's blob or marker), None for any other key."""
    names = key.split("/")
    block = parse_block_name(names[1]) if len(names) > 3 and names[0] == "steps" else None
    return None if block is None else parse_step_name(names[2], block)


def parse_part_name(name: str) -> PartName | None:
    """The part a commit marker's base name commits, None for anything else."""
    match = _PART_NAME.fullmatch(name)
    if not match:
        return None
    rank, world = int(match[1]), int(match[2])
    return PartName(rank, world, match[3] is not None) if 0 <= rank < world <= MAX_WORLD_SIZE else None


# ----------------------------------------------------------------------------- blob

_PROBE = "<f4"


def encode_blob(
    header: PartHeader, entries: list[PayloadEntry], payloads: list[bytes], probe: tuple[float, ...] | None = None
) -> bytes:
    """Prefix, header JSON, payload table, probe, payloads; the table must describe the payloads."""
    values = probe or ()
    if header.probe != len(values) or [e.length for e in entries] != [len(p) for p in payloads]:
        raise ValueError("the header and table do not describe the probe and payloads given")
    text = records.dumps(header)
    table = b"".join(_ENTRY.pack(e.length, e.changed, e.checksum) for e in entries)
    probe_bytes = np.asarray(values, dtype=_PROBE).tobytes()
    return b"".join([_PREFIX.pack(MAGIC, len(text), len(entries)), text, table, probe_bytes, *payloads])


PREFIX_BYTES = _PREFIX.size


def head_end(prefix: bytes | memoryview, object_size: int) -> int:
    """Where the payload table of an `object_size`-byte blob ends, from its first PREFIX_BYTES."""
    if len(prefix) < _PREFIX.size or object_size < _PREFIX.size:
        raise FormatError(f"part object truncated: {min(len(prefix), object_size)} bytes")
    magic, size, count = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise FormatError(f"not a {PART_FORMAT} part object (magic {bytes(magic)!r})")
    if size > MAX_HEADER_BYTES or count > MAX_PAYLOADS:
        raise FormatError(f"part header of {size} bytes and {count} payloads is over the bounds")
    end = _PREFIX.size + size + _ENTRY.size * count
    if end > object_size:
        raise FormatError(f"part header of {size} bytes and {count} payloads does not fit a {object_size}-byte object")
    return end


def decode_head(head: bytes | memoryview) -> Head:
    """Header and payload table from a blob's first `head_end` bytes (nothing after is checked)."""
    view = memoryview(head)
    _, size, count = _PREFIX.unpack_from(view)
    text_end = _PREFIX.size + size
    header = records.loads(view[_PREFIX.size : text_end], PartHeader, what="part header", max_bytes=MAX_HEADER_BYTES)
    entries = tuple(PayloadEntry(*_ENTRY.unpack_from(view, text_end + i * _ENTRY.size)) for i in range(count))
    for i, entry in enumerate(entries):
        try:
            entry.check()
        except ValueError as err:
            raise FormatError(f"payload table entry {i}: {err}") from None
    return Head(header, entries)


def decode_blob(blob: bytes | memoryview) -> Part:
    """Validate a blob's structure and split it into header, table, probe and payloads."""
    view = memoryview(blob)
    end = head_end(view, len(view))
    head = decode_head(view[:end])
    header = head.header
    probe_end = end + 4 * header.probe
    if probe_end + head.payload_bytes != len(view):
        raise FormatError(
            f"part is {len(view)} bytes; its header describes {probe_end + head.payload_bytes} "
            f"({header.probe} probe values and {len(head.entries)} payloads)"
        )
    probe = None
    if header.probe:
        values = np.frombuffer(view[end:probe_end], dtype=_PROBE)
        if not np.isfinite(values).all():
            raise FormatError("probe holds a value that is not finite")
        probe = tuple(values.astype(np.float64).tolist())
    payloads, pos = [], probe_end
    for entry in head.entries:
        payloads.append(view[pos : pos + entry.length])
        pos += entry.length
    return Part(header, head.entries, probe, tuple(payloads))


def check_placed(header: PartHeader, step: int, rank: int, world_size: int) -> PartHeader:
    """`header`, if it belongs where it was found: a part copied to another step, rank or world size
    is damage, not that part."""
    if (header.step, header.rank, header.world_size) != (step, rank, world_size):
        raise FormatError(f"holds step {header.step} rank {header.rank} of {header.world_size}")
    return header


def parse_part(blob: bytes | memoryview, ref: PartRef, rank: int, run: Run) -> Part:
    """The one parser of a fetched part (its bytes already checked against `ref`'s marker): the
    blob's own rules, where it was found, what its marker says it is, the run that owns the prefix
    (a part of another run is a `ChainError`), and the run's layout for `rank`."""
    part = decode_blob(blob)
    header = check_placed(part.header, ref.step, rank, run.world_size)
    if (header.kind, header.prev_step) != (ref.kind, ref.prev_step):
        raise FormatError("its header and its commit marker disagree on what it is")
    if header.manifest != run.sha256:
        raise ChainError(
            f"is a part of another run (its manifest {header.manifest[:12]}..., the prefix's "
            f"{run.sha256[:12]}..., run {run.run_id}): a foreign part"
        )
    layout = run.payloads[rank]
    if len(part.entries) != len(layout):
        raise FormatError(f"has {len(part.entries)} payloads, the run's layout {len(layout)}")
    for entry, (numel, _) in zip(part.entries, layout, strict=True):
        if entry.changed > numel:
            raise FormatError(f"says {entry.changed} of a payload's {numel} elements changed")
    return part


# ----------------------------------------------------------------------------- commit and run


def commit_marker(blob: bytes, header: PartHeader) -> CommitMarker:
    """The (unsigned) commit marker of a blob with this header."""
    return CommitMarker(len(blob), hashlib.sha256(blob).hexdigest(), header.kind, header.prev_step)


def encode_commit(blob: bytes, header: PartHeader) -> bytes:
    return records.dumps(commit_marker(blob, header))


def decode_commit(marker: bytes) -> CommitMarker:
    return _either(marker, CommitMarker, _CommitMarkerV2, what="commit marker", max_bytes=MAX_MARKER_BYTES)


def verify_blob(blob: bytes | memoryview, marker: CommitMarker) -> None:
    """Check a blob against its commit marker."""
    if len(blob) != marker.size:
        raise FormatError(f"object is {len(blob)} bytes, its commit says {marker.size} (truncated?)")
    if hashlib.sha256(blob).hexdigest() != marker.sha256:
        raise ChecksumError("SHA-256 of the object does not match its commit marker")


def encode_manifest(manifest: RunManifest) -> bytes:
    return records.dumps(manifest)


def decode_manifest(data: bytes) -> Run:
    manifest = _either(data, RunManifest, _RunManifestV2, what="run manifest", max_bytes=MAX_MANIFEST_BYTES)
    if manifest.signature is not None and records.dumps(manifest) != data:
        raise FormatError("a signed run manifest must be stored in its canonical encoding (section 10)")
    return Run(manifest, hashlib.sha256(data).hexdigest())


def decode_heartbeat(data: bytes) -> Heartbeat:
    beat = records.loads(data, Heartbeat, what="heartbeat", max_bytes=MAX_MARKER_BYTES)
    if beat.signature is not None and records.dumps(beat) != data:
        raise FormatError("a signed heartbeat must be stored in its canonical encoding (section 10)")
    return beat


_Record = TypeVar("_Record", RunManifest, CommitMarker)


def _either(data: bytes, cls: type[_Record], legacy: type[Any], *, what: str, max_bytes: int) -> _Record:
    """`data` as a `cls` record, or as the `legacy` version 2 record (upgraded, unsigned); the error
    is the current version's, unless the object has the legacy version's keys."""
    try:
        return records.loads(data, cls, what=what, max_bytes=max_bytes)
    except FormatError as err:
        try:
            upgraded: _Record = records.loads(data, legacy, what=what, max_bytes=max_bytes).upgrade()
        except FormatError as old:
            keys = "must hold exactly the keys"
            raise (old if keys in str(err) and keys not in str(old) else err) from None
        return upgraded


# ----------------------------------------------------------------------------- signed bytes


def run_signed_bytes(manifest: RunManifest) -> bytes:
    """What the run's signature signs: the canonical encoding of the manifest with `signature` null."""
    return records.dumps(dataclasses.replace(manifest, signature=None))


def part_signed_bytes(run_id: str, manifest: str, place: PartPlace, marker: CommitMarker) -> bytes:
    """What a commit marker's signature signs: the canonical encoding of its `PartStatement`."""
    kind = "bridge" if place.bridge else marker.kind.value
    return records.dumps(
        PartStatement(
            run_id,
            manifest,
            place.step,
            place.rank,
            place.world_size,
            kind,
            marker.prev_step,
            marker.size,
            marker.sha256,
        )
    )


def heartbeat_signed_bytes(beat: Heartbeat) -> bytes:
    """What a heartbeat's signature signs: its canonical encoding with `signature` null."""
    return records.dumps(dataclasses.replace(beat, signature=None))
