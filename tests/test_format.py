from __future__ import annotations

import json

import pytest

from lightning_delta import format as fmt
from lightning_delta.errors import ChecksumError, FormatError


def header(**changes) -> fmt.PartHeader:
    entry = fmt.TensorEntry("w", "bfloat16", (2, 3), 0, 6, 0, 0)
    payload = fmt.PayloadEntry(0, 4, 6, "00000000000000ff", 6)
    base = dict(
        snapshot_id="run-000000000001",
        prev_snapshot_id=None,
        step=1,
        prev_step=None,
        kind=fmt.Kind.BASE,
        rank=0,
        world_size=1,
        created=1.5,
        tensors=(entry,),
        payloads=(payload,),
    )
    return fmt.PartHeader(**{**base, **changes})


def test_blob_round_trip():
    h = header()
    blob = fmt.encode_blob(h, [b"abcd"])
    parsed, payload = fmt.decode_blob(blob)
    assert parsed == h and bytes(payload) == b"abcd"


def test_blob_layout_is_magic_length_json_payload():
    blob = fmt.encode_blob(header(), [b"abcd"])
    assert blob[:8] == b"LDELTA\x00\x02"
    size = int.from_bytes(blob[8:16], "little")
    assert json.loads(blob[16 : 16 + size])["format"] == "lightning_delta/2"
    assert blob[16 + size :] == b"abcd"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("rank"), "keys"),
        (lambda d: d.update(extra=1), "keys"),
        (lambda d: d.update(format="lightning_delta/9"), "understands"),
        (lambda d: d.update(kind="diff"), "kind"),
        (lambda d: d.update(step=-1), "step"),
        (lambda d: d.update(rank=True), "rank"),
        (lambda d: d.update(world_size=0), "world_size"),
        (lambda d: d.update(prev_step=0), "prev"),
        (lambda d: d.update(kind="delta"), "prev"),
        (lambda d: d["tensors"][0].update(dtype="float32"), "entry"),
        (lambda d: d["tensors"][0].update(numel=7), "entry"),
        (lambda d: d["tensors"][0].update(start=1), "entry"),
        (lambda d: d["tensors"][0].update(payload=1), "next slice"),
        (lambda d: d["tensors"][0].update(at=2), "next slice"),
        (lambda d: d["tensors"].append({**d["tensors"][0], "name": "v", "dtype": "float16", "at": 6}), "mixes"),
        (lambda d: d["payloads"][0].update(numel=7), "holds 7 elements"),
        (lambda d: d["payloads"][0].update(changed=7), "payload entry"),
        (lambda d: d["payloads"][0].update(checksum="xyz"), "payload entry"),
        (lambda d: d["payloads"][0].pop("checksum"), "payload entry keys"),
        (lambda d: d["payloads"][0].update(length=5), "payload area"),
        (lambda d: d["payloads"][0].update(offset=1), "starts at"),
    ],
)
def test_strict_header_parsing(mutate, message):
    blob = fmt.encode_blob(header(), [b"abcd"])
    size = int.from_bytes(blob[8:16], "little")
    raw = json.loads(blob[16 : 16 + size])
    mutate(raw)
    text = json.dumps(raw).encode()
    with pytest.raises(FormatError, match=message):
        fmt.decode_blob(blob[:8] + len(text).to_bytes(8, "little") + text + b"abcd")


def test_foreign_and_truncated_objects():
    with pytest.raises(FormatError, match="magic"):
        fmt.decode_blob(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(FormatError, match="truncated"):
        fmt.decode_blob(b"LDELTA")
    blob = fmt.encode_blob(header(), [b"abcd"])
    with pytest.raises(FormatError, match="does not fit"):
        fmt.decode_blob(blob[:20])
    huge = blob[:8] + (fmt.MAX_HEADER_BYTES + 1).to_bytes(8, "little") + blob[16:]
    with pytest.raises(FormatError, match="does not fit"):
        fmt.decode_blob(huge)


def test_commit_marker_round_trip_and_verification():
    blob = b"some blob"
    size, digest = fmt.decode_commit(fmt.encode_commit(blob))
    fmt.verify_blob(blob, size, digest, "x")
    with pytest.raises(ChecksumError):
        fmt.verify_blob(b"some blub", size, digest, "x")
    with pytest.raises(FormatError, match="truncated"):
        fmt.verify_blob(blob[:-1], size, digest, "x")
    for bad in [b"{", b"[]", b'{"format":"lightning_delta.commit/1","size":-1,"sha256":"00"}']:
        with pytest.raises(FormatError):
            fmt.decode_commit(bad)


def test_part_names():
    assert fmt.commit_path(7, 1, 2) == "steps/000000000/000000000007/rank-00001-of-00002.ldelta.commit"
    assert fmt.step_dir(123456) == "steps/000000123/000000123456"
    assert fmt.parse_part_name("rank-00001-of-00002.ldelta.commit") == (1, 2)
    assert fmt.parse_part_name("rank-00002-of-00002.ldelta.commit") is None
    assert fmt.parse_part_name("rank-00001-of-00002.ldelta") is None
