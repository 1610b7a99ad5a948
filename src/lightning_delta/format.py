"""The wire format of a run and of one rank's part of a snapshot, and where they live in a store.

A run is one manifest, `run.json`, created exclusively by the first publish: the prefix belongs to
that run, and a reader refuses parts of any other.  A part is two objects (docs/FORMAT.md has the
byte-level rules):

* the blob `steps/<step // 1000:09d>/<step:012d>/rank-<r:05d>-of-<w:05d>.ldelta`:
  8-byte magic, u64 little-endian header length, a UTF-8 JSON header, then the tensor payloads
  back to back, exactly as the header's offsets say (no holes, nothing after);
* the commit marker `<same name>.commit`: JSON with the blob's size and SHA-256, written only
  after the blob, so its presence means the part is complete.

Every JSON object goes through `records.loads`, so unknown or missing keys, wrong types and
out-of-range numbers are all `FormatError`: a reader refuses foreign objects rather than guess.
Every size a reader allocates for is bounded here, before anything is allocated.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, field
from enum import Enum

import torch

from . import records
from .checksum import parse_checksum
from .errors import ChecksumError, FormatError

__all__ = [
    "MAX_ELEMENTS",
    "MAX_HEADER_BYTES",
    "MAX_MARKER_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_STEP",
    "MAX_WORLD_SIZE",
    "PART_FORMAT",
    "RUN_FORMAT",
    "RUN_MANIFEST",
    "CommitMarker",
    "Kind",
    "PartHeader",
    "PayloadEntry",
    "RunManifest",
    "TensorEntry",
    "blob_path",
    "block_dir",
    "check_run_id",
    "commit_path",
    "decode_blob",
    "decode_commit",
    "decode_header",
    "decode_manifest",
    "encode_blob",
    "encode_commit",
    "encode_manifest",
    "header_end",
    "parse_block_name",
    "parse_part_name",
    "parse_step_name",
    "step_dir",
    "verify_blob",
]

MAGIC = b"LDELTA\x00\x03"
PART_FORMAT = "lightning_delta/3"
COMMIT_FORMAT = "lightning_delta.commit/1"
RUN_FORMAT = "lightning_delta.run/1"
RUN_MANIFEST = "run.json"

MAX_HEADER_BYTES = 256 << 20
"""A header past this is refused before it is read: ~1M tensors a rank is far beyond real models."""
MAX_MARKER_BYTES = 4096
MAX_MANIFEST_BYTES = 64 << 10
MAX_ELEMENTS = 1 << 40
"""Elements of one tensor, one payload and one part.  The checksum keys element i as i * 2**16 in an
int64, so positions must stay below 2**47; 2**40 (2 TiB of bf16 in one rank's part) leaves room."""
MAX_OBJECT_BYTES = 1 << 44
"""A blob's size in its marker: a part of MAX_ELEMENTS elements stored whole is 2**41 bytes."""
MAX_STEP = 10**12 - 1  # step folders have 12 digits
MAX_WORLD_SIZE = 99_999  # part names have 5 digits for rank and world size

_PREFIX = struct.Struct("<8sQ")
_PART_NAME = re.compile(r"rank-([0-9]{5})-of-([0-9]{5})\.ldelta\.commit")  # ASCII digits: \d takes fullwidth ones
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
DTYPE_NAMES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class Kind(str, Enum):
    BASE = "base"  # every element stored; starts a chain
    DELTA = "delta"  # changes against the same rank's part at `prev_step`


@dataclass(frozen=True)
class TensorEntry:
    """One rank's slice of one tensor: a range of its row-major flattened elements."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    numel: int
    payload: int  # index into the header's payloads
    at: int  # where the slice's elements begin in that payload's decoded elements

    def check(self) -> None:
        _require(self.dtype in DTYPE_NAMES, f"tensor {self.name!r}: dtype {self.dtype!r}")
        size = 1
        for dim in self.shape:  # each factor bounded, so the product never grows past the bound
            _require(0 <= dim <= MAX_ELEMENTS, f"tensor {self.name!r}: shape {self.shape}")
            size *= dim
            _require(size <= MAX_ELEMENTS, f"tensor {self.name!r}: shape {self.shape} over {MAX_ELEMENTS} elements")
        _require(
            min(self.start, self.numel, self.payload, self.at) >= 0 and self.start + self.numel <= size,
            f"tensor {self.name!r}: slice [{self.start}, +{self.numel}) of shape {self.shape}",
        )


@dataclass(frozen=True)
class PayloadEntry:
    """One codec payload: the concatenated elements of the slices that point to it, in order.

    Small slices share one payload, so a step costs a few codec calls, not one per norm weight.
    """

    offset: int  # relative to the end of the header
    length: int  # bytes
    numel: int  # elements, the sum of its slices'
    checksum: str  # `checksum.checksum` of its reconstructed elements, 16 hex digits
    changed: int  # elements changed since the previous part (all of them in a base)

    def check(self) -> None:
        _require(
            min(self.offset, self.length, self.changed) >= 0
            and self.length <= MAX_OBJECT_BYTES
            and 0 <= self.numel <= MAX_ELEMENTS
            and self.changed <= self.numel,
            f"payload entry at offset {self.offset}",
        )
        parse_checksum(self.checksum)  # ValueError


@dataclass(frozen=True)
class PartHeader:
    """Everything a reader needs to place, link and verify one rank's part."""

    run_id: str  # the run manifest's: a part of another run is never ours
    step: int
    prev_step: int | None  # the same rank's previous part, which a delta applies to
    kind: Kind
    rank: int
    world_size: int
    created: float  # unix seconds, informational
    tensors: tuple[TensorEntry, ...] = field(default=())
    payloads: tuple[PayloadEntry, ...] = field(default=())
    probe: tuple[float, ...] | None = None  # the trainer's log-probs of a fixed probe batch, if given
    format: str = PART_FORMAT

    @property
    def payload_bytes(self) -> int:
        return sum(p.length for p in self.payloads)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.payloads)

    @property
    def changed(self) -> int:
        return sum(p.changed for p in self.payloads)

    def check(self) -> None:
        """The rules of docs/FORMAT.md section 2 that the header alone can break."""
        _require(self.format == PART_FORMAT, f"format {self.format!r}; this reader understands {PART_FORMAT!r}")
        _require(bool(_RUN_ID.fullmatch(self.run_id)), f"run_id {self.run_id[:40]!r}")
        _require(0 <= self.step <= MAX_STEP, f"step {self.step}")
        _require(0 <= self.rank < self.world_size <= MAX_WORLD_SIZE, f"rank {self.rank} of {self.world_size}")
        if self.kind == Kind.BASE:
            _require(self.prev_step is None, "a base with a prev_step")
        else:
            _require(self.prev_step is not None and 0 <= self.prev_step < self.step, f"prev_step {self.prev_step}")
        for entry in self.tensors:
            entry.check()
        end = total = 0
        for i, payload in enumerate(self.payloads):
            payload.check()
            _require(payload.offset == end, f"payload {i} starts at {payload.offset}, expected {end}")
            end, total = end + payload.length, total + payload.numel
        _require(total <= MAX_ELEMENTS, f"the part holds {total} elements, over {MAX_ELEMENTS}")
        _check_tiling(self.tensors, self.payloads)


@dataclass(frozen=True)
class CommitMarker:
    """Written after its blob: the part counts from then on, and its bytes are pinned."""

    size: int
    sha256: str
    format: str = COMMIT_FORMAT

    def check(self) -> None:
        _require(self.format == COMMIT_FORMAT, f"format {self.format!r}, expected {COMMIT_FORMAT!r}")
        _require(0 <= self.size <= MAX_OBJECT_BYTES, f"size {self.size}")
        _require(bool(_SHA256.fullmatch(self.sha256)), "sha256 is not 64 lower-case hex digits")


@dataclass(frozen=True)
class RunManifest:
    """`run.json`: which run owns the prefix.  Created exclusively, never rewritten."""

    run_id: str
    world_size: int
    created: float  # unix seconds, informational
    part_format: str = PART_FORMAT
    format: str = RUN_FORMAT

    def check(self) -> None:
        _require(self.format == RUN_FORMAT, f"format {self.format!r}; this reader understands {RUN_FORMAT!r}")
        _require(self.part_format == PART_FORMAT, f"parts of format {self.part_format!r}, not {PART_FORMAT!r}")
        _require(bool(_RUN_ID.fullmatch(self.run_id)), f"run_id {self.run_id[:40]!r}")
        _require(1 <= self.world_size <= MAX_WORLD_SIZE, f"world_size {self.world_size}")


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


def block_dir(block: int) -> str:
    return f"steps/{block:09d}"


def step_dir(step: int) -> str:
    return f"{block_dir(step // STEPS_PER_BLOCK)}/{step:012d}"


def blob_path(step: int, rank: int, world_size: int) -> str:
    return f"{step_dir(step)}/rank-{rank:05d}-of-{world_size:05d}.ldelta"


def commit_path(step: int, rank: int, world_size: int) -> str:
    return blob_path(step, rank, world_size) + ".commit"


def parse_block_name(name: str) -> int | None:
    """The block of a folder name under `steps/`, None for any other name."""
    return int(name) if _BLOCK_NAME.fullmatch(name) else None


def parse_step_name(name: str, block: int) -> int | None:
    """The step of a folder name in `block`, None for any other name or a step of another block."""
    if not _STEP_NAME.fullmatch(name) or int(name) // STEPS_PER_BLOCK != block:
        return None
    return int(name)


def parse_part_name(name: str) -> tuple[int, int] | None:
    """(rank, world_size) of a commit marker's base name, None for anything else."""
    match = _PART_NAME.fullmatch(name)
    if not match:
        return None
    rank, world = int(match[1]), int(match[2])
    return (rank, world) if 0 <= rank < world <= MAX_WORLD_SIZE else None


# ----------------------------------------------------------------------------- blob


def encode_blob(header: PartHeader, payloads: list[bytes]) -> bytes:
    """Header JSON plus payloads; the header's offsets and lengths must describe `payloads`."""
    text = records.dumps(header)
    return b"".join([_PREFIX.pack(MAGIC, len(text)), text, *payloads])


PREFIX_BYTES = _PREFIX.size


def header_end(prefix: bytes | memoryview, object_size: int) -> int:
    """Where the header of an `object_size`-byte blob ends, from its first PREFIX_BYTES bytes."""
    if len(prefix) < _PREFIX.size or object_size < _PREFIX.size:
        raise FormatError(f"part object truncated: {min(len(prefix), object_size)} bytes")
    magic, size = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise FormatError(f"not a {PART_FORMAT} part object (magic {bytes(magic)!r})")
    if size > MAX_HEADER_BYTES or _PREFIX.size + size > object_size:
        raise FormatError(f"part header of {size} bytes does not fit the {object_size}-byte object")
    return _PREFIX.size + size


def decode_header(head: bytes | memoryview) -> PartHeader:
    """The header of a blob from its first `header_end` bytes (the payload area is not checked)."""
    return records.loads(head[_PREFIX.size :], PartHeader, what="part header", max_bytes=MAX_HEADER_BYTES)


def decode_blob(blob: bytes | memoryview) -> tuple[PartHeader, memoryview]:
    """Validate a blob and return its header and payload area."""
    view = memoryview(blob)
    end = header_end(view, len(view))
    header = decode_header(view[:end])
    payload = view[end:]
    if header.payload_bytes != len(payload):
        raise FormatError(f"part payload area is {len(payload)} bytes, its header describes {header.payload_bytes}")
    return header, payload


# ----------------------------------------------------------------------------- commit and run


def encode_commit(blob: bytes) -> bytes:
    return records.dumps(CommitMarker(len(blob), hashlib.sha256(blob).hexdigest()))


def decode_commit(marker: bytes) -> CommitMarker:
    return records.loads(marker, CommitMarker, what="commit marker", max_bytes=MAX_MARKER_BYTES)


def verify_blob(blob: bytes, marker: CommitMarker, where: str) -> None:
    """Check a blob against its commit marker."""
    if len(blob) != marker.size:
        raise FormatError(f"{where}: object is {len(blob)} bytes, its commit says {marker.size} (truncated?)")
    if hashlib.sha256(blob).hexdigest() != marker.sha256:
        raise ChecksumError(f"{where}: SHA-256 of the object does not match its commit marker")


def encode_manifest(manifest: RunManifest) -> bytes:
    return records.dumps(manifest)


def decode_manifest(data: bytes) -> RunManifest:
    return records.loads(data, RunManifest, what="run manifest", max_bytes=MAX_MANIFEST_BYTES)


# ----------------------------------------------------------------------------- rules


def _check_tiling(tensors: tuple[TensorEntry, ...], payloads: tuple[PayloadEntry, ...]) -> None:
    """Each payload is exactly its slices (at least one) back to back, in header order, of one dtype."""
    filled = [0] * len(payloads)
    dtypes: dict[int, str] = {}
    for entry in tensors:
        _require(
            entry.payload < len(payloads) and entry.at == filled[entry.payload],
            f"tensor entry {entry.name!r} is not the next slice of payload {entry.payload}",
        )
        _require(dtypes.setdefault(entry.payload, entry.dtype) == entry.dtype, f"payload {entry.payload} mixes dtypes")
        filled[entry.payload] += entry.numel
    for i, (payload, numel) in enumerate(zip(payloads, filled, strict=True)):
        _require(i in dtypes, f"payload {i} holds no slice")
        _require(payload.numel == numel, f"payload {i} holds {payload.numel} elements, its slices {numel}")
