from __future__ import annotations

import hashlib
import json

import pytest

from lightning_delta import format as fmt
from lightning_delta import records
from lightning_delta.errors import ChecksumError, FormatError


def header(**changes) -> fmt.PartHeader:
    entry = fmt.TensorEntry("w", "bfloat16", (2, 3), 0, 6, 0, 0)
    payload = fmt.PayloadEntry(0, 4, 6, "00000000000000ff", 6)
    base = dict(
        run_id="run",
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


GOLDEN_HEADER = (
    b'{"created":1.5,"format":"lightning_delta/3","kind":"base","payloads":[{"changed":6,'
    b'"checksum":"00000000000000ff","length":4,"numel":6,"offset":0}],"prev_step":null,"probe":null,'
    b'"rank":0,"run_id":"run","step":1,"tensors":[{"at":0,"dtype":"bfloat16","name":"w","numel":6,'
    b'"payload":0,"shape":[2,3],"start":0}],"world_size":1}'
)


def test_golden_bytes_pin_the_blob_marker_and_manifest():
    """A change to any of these bytes is a format change: bump the version and FORMAT.md."""
    blob = fmt.encode_blob(header(), [b"abcd"])
    assert blob == b"LDELTA\x00\x03" + len(GOLDEN_HEADER).to_bytes(8, "little") + GOLDEN_HEADER + b"abcd"
    digest = hashlib.sha256(blob).hexdigest()
    marker = f'{{"format":"lightning_delta.commit/1","sha256":"{digest}","size":{len(blob)}}}'
    assert fmt.encode_commit(blob) == marker.encode()
    manifest = fmt.RunManifest("run", 2, 1.5)
    assert fmt.encode_manifest(manifest) == (
        b'{"created":1.5,"format":"lightning_delta.run/1","part_format":"lightning_delta/3",'
        b'"run_id":"run","world_size":2}'
    )
    assert fmt.decode_manifest(fmt.encode_manifest(manifest)) == manifest


def _reencoded(mutate) -> bytes:
    blob = fmt.encode_blob(header(), [b"abcd"])
    size = int.from_bytes(blob[8:16], "little")
    raw = json.loads(blob[16 : 16 + size])
    mutate(raw)
    text = json.dumps(raw).encode()
    return blob[:8] + len(text).to_bytes(8, "little") + text + b"abcd"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("rank"), "keys"),
        (lambda d: d.update(extra=1), "keys"),
        (lambda d: d.update(format="lightning_delta/9"), "understands"),
        (lambda d: d.update(kind="diff"), "kind"),
        (lambda d: d.update(step=-1), "step"),
        (lambda d: d.update(step=10**12), "step"),
        (lambda d: d.update(step="7"), "step must be int"),
        (lambda d: d.update(rank=True), "rank must be int"),
        (lambda d: d.update(rank="0"), "rank must be int"),
        (lambda d: d.update(world_size=0), "rank 0 of 0"),
        (lambda d: d.update(run_id="a/b"), "run_id"),
        (lambda d: d.update(prev_step=0), "base with a prev_step"),
        (lambda d: d.update(kind="delta"), "prev_step"),
        (lambda d: d.update(created="now"), "created must be float"),
        (lambda d: d.update(probe=[1.0, "x"]), r"probe\[1\]"),
        (lambda d: d["tensors"][0].update(dtype="float32"), "dtype"),
        (lambda d: d["tensors"][0].update(dtype=[]), "dtype must be str"),
        (lambda d: d["tensors"][0].update(numel=7), "slice"),
        (lambda d: d["tensors"][0].update(start=1), "slice"),
        (lambda d: d["tensors"][0].update(shape=[0, 2**62]), "shape"),
        (lambda d: d["tensors"][0].update(shape=[0, 2**62, 2**62]), "shape"),
        (lambda d: d["tensors"][0].update(shape=[2, -3]), "shape"),
        (lambda d: d["tensors"][0].update(shape=[2**21, 2**20]), "over"),
        (lambda d: d["tensors"][0].update(payload=1), "next slice"),
        (lambda d: d["tensors"][0].update(at=2), "next slice"),
        (lambda d: d["tensors"].append({**d["tensors"][0], "name": "v", "dtype": "float16", "at": 6}), "mixes"),
        (lambda d: d["payloads"][0].update(numel=7), "holds 7 elements"),
        (
            lambda d: d["payloads"].append({**d["payloads"][0], "offset": 4, "length": 0, "numel": 0, "changed": 0}),
            "no slice",
        ),
        (lambda d: d["payloads"][0].update(numel=2**41), "payload entry"),
        (lambda d: d["payloads"][0].update(changed=7), "payload entry"),
        (lambda d: d["payloads"][0].update(checksum="xyz"), "checksum"),
        (lambda d: d["payloads"][0].pop("checksum"), "keys"),
        (lambda d: d["payloads"][0].update(length=5), "payload area"),
        (lambda d: d["payloads"][0].update(offset=1), "starts at"),
    ],
)
def test_strict_header_parsing(mutate, message):
    with pytest.raises(FormatError, match=message):
        fmt.decode_blob(_reencoded(mutate))


@pytest.mark.parametrize(
    "text, message",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels"),
        (b'{"a":' * 17 + b"1" + b"}" * 17, "nests 17 levels"),
        (b'{"size":' + b"9" * 5000 + b',"sha256":"0","format":"x"}', "does not fit 64 bits"),
        (b'{"size":9223372036854775808,"sha256":"0","format":"x"}', "does not fit 64 bits"),
        (b'{"size":1e400,"sha256":"0","format":"x"}', "not finite"),
        (b'{"size":NaN,"sha256":"0","format":"x"}', "NaN is not JSON"),
        (b'{"size":1,"size":2,"sha256":"0","format":"x"}', "repeats a key"),
        (b'{"size":1.0,"sha256":"' + b"0" * 64 + b'","format":"lightning_delta.commit/1"}', "size must be int"),
        (b"\xff\xfe", "malformed"),
        (b'"[[["', "must hold exactly the keys"),
        (b"{" * 3, "malformed"),
    ],
)
def test_hostile_json_is_a_format_error(text, message):
    with pytest.raises(FormatError, match=message):
        records.loads(text, fmt.CommitMarker, what="commit marker", max_bytes=1 << 20)


def test_json_objects_are_capped_before_they_are_parsed():
    with pytest.raises(FormatError, match="more than the 4096 allowed"):
        fmt.decode_commit(b" " * (fmt.MAX_MARKER_BYTES + 1))


def test_hostile_json_in_a_header_and_a_manifest():
    deep = b"[" * 50_000 + b"]" * 50_000
    blob = fmt.MAGIC + len(deep).to_bytes(8, "little") + deep
    with pytest.raises(FormatError, match="nests"):
        fmt.decode_blob(blob)
    for bad in [b'{"created":1e400}', b'{"format":"lightning_delta.run/1","run_id":"r","world_size":"2"}']:
        with pytest.raises(FormatError):
            fmt.decode_manifest(bad)
    with pytest.raises(FormatError, match="world_size"):
        fmt.decode_manifest(fmt.encode_manifest(fmt.RunManifest("r", 0, 1.0)))


def test_records_write_what_they_read():
    h = header(probe=(0.5, -1.25), kind=fmt.Kind.DELTA, prev_step=0)
    assert records.loads(records.dumps(h), fmt.PartHeader, what="x", max_bytes=1 << 20) == h


def test_foreign_and_truncated_objects():
    with pytest.raises(FormatError, match="magic"):
        fmt.decode_blob(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(FormatError, match="magic"):  # a format 2 part
        fmt.decode_blob(b"LDELTA\x00\x02" + fmt.encode_blob(header(), [b"abcd"])[8:])
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
    marker = fmt.decode_commit(fmt.encode_commit(blob))
    fmt.verify_blob(blob, marker, "x")
    with pytest.raises(ChecksumError):
        fmt.verify_blob(b"some blub", marker, "x")
    with pytest.raises(FormatError, match="truncated"):
        fmt.verify_blob(blob[:-1], marker, "x")
    for bad in [b"{", b"[]", b'{"format":"lightning_delta.commit/1","size":-1,"sha256":"00"}']:
        with pytest.raises(FormatError):
            fmt.decode_commit(bad)


def test_names():
    assert fmt.commit_path(7, 1, 2) == "steps/000000000/000000000007/rank-00001-of-00002.ldelta.commit"
    assert fmt.step_dir(123456) == "steps/000000123/000000123456"
    assert fmt.parse_part_name("rank-00001-of-00002.ldelta.commit") == (1, 2)
    assert fmt.parse_part_name("rank-00002-of-00002.ldelta.commit") is None
    assert fmt.parse_part_name("rank-00001-of-00002.ldelta") is None
    assert fmt.parse_block_name("000000001") == 1
    for stray in ["\u00b2", "5", "00000000\u00b2", "0000000001", "000000001.tmp"]:
        assert fmt.parse_block_name(stray) is None
    assert fmt.parse_step_name("000000001005", 1) == 1005
    assert fmt.parse_step_name("000000001005", 0) is None  # a step in another block's folder
    for stray in ["5", "\u00b2" * 12, "00000000000\uff15", "\uff10" * 11 + "\uff15"]:  # fullwidth digits
        assert fmt.parse_step_name(stray, 0) is None
