"""The wire format of one rank's part of a snapshot, and where it lives in a store.

A part is two objects (docs/FORMAT.md has the byte-level rules):

* the blob `steps/<step // 1000:09d>/<step:012d>/rank-<r:05d>-of-<w:05d>.ldelta`:
  8-byte magic, u64 little-endian header length, a UTF-8 JSON header, then the tensor payloads
  back to back, exactly as the header's offsets say (no holes, nothing after);
* the commit marker `<same name>.commit`: JSON with the blob's size and SHA-256, written only
  after the blob, so its presence means the part is complete.

Parsing is strict: unknown or missing keys, wrong types and out-of-range numbers are all
`FormatError`, because a reader must refuse foreign objects rather than guess.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import torch

from .checksum import parse_checksum
from .errors import ChecksumError, FormatError

__all__ = [
    "MAX_HEADER_BYTES",
    "PART_FORMAT",
    "Kind",
    "PartHeader",
    "PayloadEntry",
    "TensorEntry",
    "blob_path",
    "commit_path",
    "decode_blob",
    "decode_commit",
    "decode_header",
    "encode_blob",
    "encode_commit",
    "header_end",
    "parse_part_name",
    "block_dir",
    "step_dir",
    "verify_blob",
]

MAGIC = b"LDELTA\x00\x02"
PART_FORMAT = "lightning_delta/2"
COMMIT_FORMAT = "lightning_delta.commit/1"
MAX_HEADER_BYTES = 256 << 20
"""A header past this is refused before it is read: ~1M tensors a rank is far beyond real models."""

_PREFIX = struct.Struct("<8sQ")
_PART_NAME = re.compile(r"rank-(\d{5})-of-(\d{5})\.ldelta\.commit")
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


@dataclass(frozen=True)
class PartHeader:
    """Everything a reader needs to place, link and verify one rank's part."""

    snapshot_id: str
    prev_snapshot_id: str | None
    step: int
    prev_step: int | None
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


# ----------------------------------------------------------------------------- names


STEPS_PER_BLOCK = 1000
"""Step folders are grouped in blocks, so a poll lists one block, not the whole run."""
LATEST = "latest"
"""Key of the pointer rank 0 rewrites after each of its commits: `{"step": N}`."""


def block_dir(block: int) -> str:
    return f"steps/{block:09d}"


def step_dir(step: int) -> str:
    return f"{block_dir(step // STEPS_PER_BLOCK)}/{step:012d}"


def blob_path(step: int, rank: int, world_size: int) -> str:
    return f"{step_dir(step)}/rank-{rank:05d}-of-{world_size:05d}.ldelta"


def commit_path(step: int, rank: int, world_size: int) -> str:
    return blob_path(step, rank, world_size) + ".commit"


def parse_part_name(name: str) -> tuple[int, int] | None:
    """(rank, world_size) of a commit marker's base name, None for anything else."""
    match = _PART_NAME.fullmatch(name)
    if not match:
        return None
    rank, world = int(match[1]), int(match[2])
    return (rank, world) if 0 <= rank < world else None


# ----------------------------------------------------------------------------- blob


def encode_blob(header: PartHeader, payloads: list[bytes]) -> bytes:
    """Header JSON plus payloads; the header's offsets and lengths must describe `payloads`."""
    text = json.dumps(_to_json(header), separators=(",", ":"), sort_keys=True).encode()
    return b"".join([_PREFIX.pack(MAGIC, len(text)), text, *payloads])


PREFIX_BYTES = _PREFIX.size


def header_end(prefix: bytes | memoryview, object_size: int) -> int:
    """Where the header of an `object_size`-byte blob ends, from its first PREFIX_BYTES bytes."""
    if len(prefix) < _PREFIX.size or object_size < _PREFIX.size:
        raise FormatError(f"part object truncated: {min(len(prefix), object_size)} bytes")
    magic, size = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise FormatError(f"not a lightning_delta part object (magic {bytes(magic)!r})")
    if size > MAX_HEADER_BYTES or _PREFIX.size + size > object_size:
        raise FormatError(f"part header of {size} bytes does not fit the {object_size}-byte object")
    return _PREFIX.size + size


def decode_header(head: bytes | memoryview) -> PartHeader:
    """The header of a blob from its first `header_end` bytes (offsets are not checked here)."""
    try:
        raw = json.loads(bytes(head[_PREFIX.size :]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"part header is not valid JSON: {err}") from None
    return _from_json(raw)


def decode_blob(blob: bytes) -> tuple[PartHeader, memoryview]:
    """Validate a blob and return its header and payload area."""
    view = memoryview(blob)
    end = header_end(view, len(view))
    header = decode_header(view[:end])
    payload = view[end:]
    end = 0
    for i, entry in enumerate(header.payloads):
        if entry.offset != end:
            raise FormatError(f"payload {i} starts at {entry.offset}, expected {end}")
        end += entry.length
    if end != len(payload):
        raise FormatError(f"part payload area is {len(payload)} bytes, its header describes {end}")
    return header, payload


# ----------------------------------------------------------------------------- commit


def encode_commit(blob: bytes) -> bytes:
    digest = hashlib.sha256(blob).hexdigest()
    return json.dumps({"format": COMMIT_FORMAT, "sha256": digest, "size": len(blob)}).encode()


def decode_commit(marker: bytes) -> tuple[int, str]:
    """(blob size, blob SHA-256 hex) from a commit marker."""
    try:
        raw = json.loads(marker)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"commit marker is not valid JSON: {err}") from None
    if not isinstance(raw, dict) or set(raw) != {"format", "sha256", "size"}:
        raise FormatError("commit marker must hold exactly format, sha256 and size")
    if raw["format"] != COMMIT_FORMAT:
        raise FormatError(f"commit marker format {raw['format']!r}, expected {COMMIT_FORMAT!r}")
    size, digest = raw["size"], raw["sha256"]
    if not _is_count(size) or not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise FormatError("commit marker has a malformed size or sha256")
    return size, digest


def verify_blob(blob: bytes, size: int, digest: str, where: str) -> None:
    """Check a blob against its commit marker."""
    if len(blob) != size:
        raise FormatError(f"{where}: object is {len(blob)} bytes, its commit says {size} (truncated?)")
    if hashlib.sha256(blob).hexdigest() != digest:
        raise ChecksumError(f"{where}: SHA-256 of the object does not match its commit marker")


# ----------------------------------------------------------------------------- JSON


def _to_json(header: PartHeader) -> dict[str, Any]:
    out = asdict(header)
    out["kind"] = header.kind.value
    return out


_HEADER_KEYS = {f for f in PartHeader.__dataclass_fields__}
_ENTRY_KEYS = {f for f in TensorEntry.__dataclass_fields__}
_PAYLOAD_KEYS = {f for f in PayloadEntry.__dataclass_fields__}


def _from_json(raw: Any) -> PartHeader:
    if not isinstance(raw, dict) or set(raw) != _HEADER_KEYS:
        raise FormatError(f"part header keys differ from {sorted(_HEADER_KEYS)}")
    if raw["format"] != PART_FORMAT:
        raise FormatError(f"part format {raw['format']!r}; this reader understands {PART_FORMAT!r}")
    try:
        kind = Kind(raw["kind"])
    except ValueError:
        raise FormatError(f"unknown part kind {raw['kind']!r}") from None
    checks = {
        "snapshot_id": isinstance(raw["snapshot_id"], str),
        "step": _is_count(raw["step"]),
        "rank": _is_count(raw["rank"]),
        "world_size": _is_count(raw["world_size"]) and raw["world_size"] > raw["rank"],
        "created": isinstance(raw["created"], (int, float)) and math.isfinite(raw["created"]),
        "tensors": isinstance(raw["tensors"], list),
        "payloads": isinstance(raw["payloads"], list),
        "probe": raw["probe"] is None
        or (
            isinstance(raw["probe"], list)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in raw["probe"])
        ),
    }
    if kind == Kind.BASE:
        checks["prev"] = raw["prev_step"] is None and raw["prev_snapshot_id"] is None
    else:
        checks["prev"] = (
            _is_count(raw["prev_step"]) and raw["prev_step"] < raw["step"] and isinstance(raw["prev_snapshot_id"], str)
        )
    bad = [key for key, ok in checks.items() if not ok]
    if bad:
        raise FormatError(f"part header has malformed fields: {', '.join(bad)}")
    tensors = tuple(_entry_from_json(e) for e in raw["tensors"])
    payloads = tuple(_payload_from_json(p) for p in raw["payloads"])
    _check_tiling(tensors, payloads)
    probe = None if raw["probe"] is None else tuple(float(v) for v in raw["probe"])
    return PartHeader(**{**raw, "kind": kind, "tensors": tensors, "payloads": payloads, "probe": probe})


def _check_tiling(tensors: tuple[TensorEntry, ...], payloads: tuple[PayloadEntry, ...]) -> None:
    """Each payload is exactly its slices back to back, in header order, of one dtype."""
    filled = [0] * len(payloads)
    dtypes: dict[int, str] = {}
    for entry in tensors:
        if entry.payload >= len(payloads) or entry.at != filled[entry.payload]:
            raise FormatError(f"tensor entry {entry.name!r} is not the next slice of payload {entry.payload}")
        if dtypes.setdefault(entry.payload, entry.dtype) != entry.dtype:
            raise FormatError(f"payload {entry.payload} mixes dtypes")
        filled[entry.payload] += entry.numel
    for i, (payload, numel) in enumerate(zip(payloads, filled, strict=True)):
        if payload.numel != numel:
            raise FormatError(f"payload {i} holds {payload.numel} elements, its slices {numel}")


def _payload_from_json(raw: Any) -> PayloadEntry:
    if not isinstance(raw, dict) or set(raw) != _PAYLOAD_KEYS:
        raise FormatError(f"payload entry keys differ from {sorted(_PAYLOAD_KEYS)}")
    ok = (
        all(_is_count(raw[k]) for k in ("offset", "length", "numel", "changed"))
        and raw["changed"] <= raw["numel"]
        and isinstance(raw["checksum"], str)
    )
    if ok:
        try:
            parse_checksum(raw["checksum"])
        except ValueError:
            ok = False
    if not ok:
        raise FormatError(f"malformed payload entry at offset {raw.get('offset')!r}")
    return PayloadEntry(**raw)


def _entry_from_json(raw: Any) -> TensorEntry:
    if not isinstance(raw, dict) or set(raw) != _ENTRY_KEYS:
        raise FormatError(f"tensor entry keys differ from {sorted(_ENTRY_KEYS)}")
    shape = raw["shape"]
    ok = (
        isinstance(raw["name"], str)
        and raw["dtype"] in DTYPE_NAMES
        and isinstance(shape, list)
        and all(_is_count(d) for d in shape)
        and all(_is_count(raw[k]) for k in ("start", "numel", "payload", "at"))
        and raw["start"] + raw["numel"] <= math.prod(shape)
    )
    if not ok:
        raise FormatError(f"malformed tensor entry {raw.get('name')!r}")
    return TensorEntry(**{**raw, "shape": tuple(shape)})


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
