from __future__ import annotations

import dataclasses
import hashlib
import json
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_delta import format as fmt
from lightning_delta import records
from lightning_delta.errors import ChainError, ChecksumError, FormatError

DIGEST = "ab" * 32


def header(**changes) -> fmt.PartHeader:
    base = dict(
        manifest=DIGEST,
        step=1,
        prev_step=None,
        kind=fmt.Kind.BASE,
        rank=0,
        world_size=1,
        created=1.5,
        probe=0,
    )
    return fmt.PartHeader(**{**base, **changes})


ENTRY = fmt.PayloadEntry(4, 6, 0xFF)


def blob_of(h: fmt.PartHeader, probe: tuple[float, ...] | None = None) -> bytes:
    return fmt.encode_blob(h, [ENTRY], [b"abcd"], probe)


def manifest(**changes) -> fmt.RunManifest:
    base = dict(
        run_id="run",
        world_size=2,
        created=1.5,
        tensors=(fmt.TensorSpec("b", "bfloat16", (3,)), fmt.TensorSpec("w", "bfloat16", (2, 3))),
        ranks=(
            ((fmt.SliceSpec(1, 0, 4),),),
            ((fmt.SliceSpec(1, 4, 2), fmt.SliceSpec(0, 0, 3)),),
        ),
    )
    return fmt.RunManifest(**{**base, **changes})


def test_blob_round_trip():
    h = header(probe=2)
    part = fmt.decode_blob(blob_of(h, (0.5, -1.25)))
    assert part.header == h and part.entries == (ENTRY,) and part.probe == (0.5, -1.25)
    assert [bytes(p) for p in part.payloads] == [b"abcd"]
    payloads = [b"abcd", b"efghij", b"", b"k"]  # back to back after the probe, each where its table says
    entries = [fmt.PayloadEntry(len(p), len(p), i) for i, p in enumerate(payloads)]
    part = fmt.decode_blob(fmt.encode_blob(h, entries, payloads, (0.5, -1.25)))
    assert part.entries == tuple(entries) and [bytes(p) for p in part.payloads] == payloads
    assert fmt.decode_blob(blob_of(header())).probe is None  # no probe, not an empty one


def test_the_head_bounds_are_exact():
    def prefix(size: int, count: int) -> bytes:
        return fmt.MAGIC + size.to_bytes(4, "little") + count.to_bytes(4, "little")

    entry = fmt.head_end(prefix(0, 1), 1 << 40) - fmt.PREFIX_BYTES
    assert fmt.head_end(prefix(0, 0), fmt.PREFIX_BYTES) == fmt.PREFIX_BYTES
    assert fmt.head_end(prefix(fmt.MAX_HEADER_BYTES, 0), 1 << 40) == fmt.PREFIX_BYTES + fmt.MAX_HEADER_BYTES
    assert fmt.head_end(prefix(0, fmt.MAX_PAYLOADS), 1 << 40) == fmt.PREFIX_BYTES + entry * fmt.MAX_PAYLOADS
    for short, size in [(prefix(0, 0)[:-1], 1 << 40), (prefix(0, 0), fmt.PREFIX_BYTES - 1)]:
        with pytest.raises(FormatError, match=rf"^part object truncated: {fmt.PREFIX_BYTES - 1} bytes$"):
            fmt.head_end(short, size)


GOLDEN_HEADER = (
    b'{"created":1.5,"format":"lightning_delta/5","kind":"base","manifest":"' + DIGEST.encode() + b'",'
    b'"prev_step":null,"probe":1,"rank":0,"step":1,"world_size":1}'
)
GOLDEN_MANIFEST = (
    b'{"created":1.5,"format":"lightning_delta.run/3","part_format":"lightning_delta/5",'
    b'"ranks":[[[{"numel":4,"start":0,"tensor":1}]],[[{"numel":2,"start":4,"tensor":1},'
    b'{"numel":3,"start":0,"tensor":0}]]],"run_id":"run","signature":null,"signer":null,'
    b'"tensors":[{"dtype":"bfloat16","name":"b","shape":[3]},{"dtype":"bfloat16","name":"w","shape":[2,3]}],'
    b'"world_size":2}'
)


def test_golden_bytes_pin_the_blob_marker_and_manifest():
    """A change to any of these bytes is a format change: bump the version and FORMAT.md."""
    h = header(probe=1)
    blob = blob_of(h, (-1.5,))
    prefix = b"LDELTA\x00\x05" + len(GOLDEN_HEADER).to_bytes(4, "little") + (1).to_bytes(4, "little")
    table = (4).to_bytes(8, "little") + (6).to_bytes(8, "little") + (0xFF).to_bytes(8, "little")
    probe = b"\x00\x00\xc0\xbf"  # -1.5 as a little-endian float32
    assert blob == prefix + GOLDEN_HEADER + table + probe + b"abcd"
    digest = hashlib.sha256(blob).hexdigest()
    marker = (
        f'{{"format":"lightning_delta.commit/3","kind":"base","prev_step":null,"sha256":"{digest}",'
        f'"signature":null,"size":{len(blob)}}}'
    )
    assert fmt.encode_commit(blob, h) == marker.encode()
    delta = header(kind=fmt.Kind.DELTA, prev_step=0)
    assert b'"kind":"delta","prev_step":0,' in fmt.encode_commit(blob, delta)
    assert fmt.encode_manifest(manifest()) == GOLDEN_MANIFEST
    run = fmt.decode_manifest(GOLDEN_MANIFEST)
    assert run.manifest == manifest() and run.sha256 == hashlib.sha256(GOLDEN_MANIFEST).hexdigest()
    assert run.payloads == (((4, torch.bfloat16),), ((5, torch.bfloat16),))


def test_a_delta_parts_fixed_overhead_is_small():
    """#13's budget: at most 1 KB a part plus 64 bytes a payload, marker included."""
    for n in (1, 100):
        h = header(
            step=999_999_999_999,
            prev_step=999_999_999_998,
            kind=fmt.Kind.DELTA,
            rank=99_998,
            world_size=99_999,
            created=1_764_762_000.123456,
        )
        blob = fmt.encode_blob(h, [fmt.PayloadEntry(0, 12_345_678, 2**64 - 1)] * n, [b""] * n)
        marker = fmt.CommitMarker(10**12, "f" * 64, h.kind, h.prev_step, signature="e" * 128)  # signed
        overhead = len(blob) + len(records.dumps(marker))
        assert overhead <= 1024 + 64 * n, (n, overhead)


def _reencoded(mutate, entries: bytes | None = None) -> bytes:
    blob = blob_of(header())
    size = int.from_bytes(blob[8:12], "little")
    raw = json.loads(blob[16 : 16 + size])
    mutate(raw)
    text = json.dumps(raw).encode()
    table = blob[16 + size : 16 + size + 24] if entries is None else entries
    return (
        blob[:8] + len(text).to_bytes(4, "little") + (len(table) // 24).to_bytes(4, "little") + text + table + b"abcd"
    )


def _entry(length: int, changed: int, checksum: int = 0) -> bytes:
    return length.to_bytes(8, "little") + changed.to_bytes(8, "little") + checksum.to_bytes(8, "little")


@pytest.mark.parametrize(
    "mutate, entries, message",
    [
        (lambda d: d.pop("rank"), None, "keys"),
        (lambda d: d.update(extra=1), None, "keys"),
        (lambda d: d.update(format="lightning_delta/3"), None, "understands"),
        (lambda d: d.update(kind="diff"), None, "kind"),
        (lambda d: d.update(step=-1), None, "step"),
        (lambda d: d.update(step=10**12), None, "step"),
        (lambda d: d.update(step="7"), None, "step must be int"),
        (lambda d: d.update(rank=True), None, "rank must be int"),
        (lambda d: d.update(rank="0"), None, "rank must be int"),
        (lambda d: d.update(world_size=0), None, "rank 0 of 0"),
        (lambda d: d.update(manifest="a/b"), None, "manifest"),
        (lambda d: d.update(manifest=DIGEST.upper()), None, "manifest"),
        (lambda d: d.update(prev_step=0), None, "base with a prev_step"),
        (lambda d: d.update(kind="delta"), None, "prev_step"),
        (lambda d: d.update(kind="delta", prev_step=1), None, "prev_step"),
        (lambda d: d.update(created="now"), None, "created must be float"),
        (lambda d: d.update(probe=None), None, "probe must be int"),
        (lambda d: d.update(probe=-1), None, "probe of -1"),
        (lambda d: d.update(probe=1), None, "describes"),
        (lambda d: d.update(probe=2**24 + 1), None, "probe of"),
        (lambda d: d.update(payloads=[]), None, "keys"),
        (lambda d: None, _entry(4, 2**41), "changes"),
        (lambda d: None, _entry(2**45, 6), "payload of"),
        (lambda d: None, _entry(5, 6), "describes"),
        (lambda d: None, _entry(4, 6) * 2, "describes"),
        (lambda d: None, b"", "describes"),
    ],
)
def test_strict_header_parsing(mutate, entries, message):
    with pytest.raises(FormatError, match=message):
        fmt.decode_blob(_reencoded(mutate, entries))


def test_a_probe_that_is_not_finite_is_refused():
    blob = bytearray(blob_of(header(probe=1), (1.0,)))
    blob[-8:-4] = b"\x00\x00\xc0\x7f"  # NaN
    with pytest.raises(FormatError, match=r"^probe holds a value that is not finite$"):
        fmt.decode_blob(bytes(blob))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(format="lightning_delta.run/1"), "understands"),
        (dict(part_format="lightning_delta/3"), "parts of format"),
        (dict(world_size=0), "world_size"),
        (dict(world_size=3), "layouts of 2 ranks"),
        (dict(run_id=""), "run_id"),
        (dict(tensors=(fmt.TensorSpec("b", "bfloat16", (3,)), fmt.TensorSpec("b", "bfloat16", (2, 3)))), "repeats"),
        (dict(tensors=(fmt.TensorSpec("b", "float32", (3,)), fmt.TensorSpec("w", "bfloat16", (2, 3)))), "dtype"),
        (dict(tensors=(fmt.TensorSpec("b", "float16", (3,)), fmt.TensorSpec("w", "bfloat16", (2, 3)))), "mixes"),
        (dict(tensors=(fmt.TensorSpec("", "bfloat16", (3,)), fmt.TensorSpec("w", "bfloat16", (2, 3)))), "name"),
        (dict(tensors=(fmt.TensorSpec("b", "bfloat16", (3,)), fmt.TensorSpec("w", "bfloat16", (2, 2**62)))), "shape"),
        (
            dict(tensors=(fmt.TensorSpec("b", "bfloat16", (3,)), fmt.TensorSpec("w", "bfloat16", (2**21, 2**20)))),
            "over",
        ),
        (dict(tensors=(fmt.TensorSpec("b", "bfloat16", (3,)), fmt.TensorSpec("w", "bfloat16", (2, -3)))), "shape"),
        (
            dict(tensors=(fmt.TensorSpec("b", "bfloat16", (3,)), fmt.TensorSpec("w", "bfloat16", (2, 4)))),
            "cover 6 of 8",
        ),
        (
            dict(
                tensors=(
                    fmt.TensorSpec("b", "bfloat16", (3,)),
                    fmt.TensorSpec("w", "bfloat16", (6,)),
                    fmt.TensorSpec("x", "bfloat16", (0,)),
                )
            ),
            "no rank holds",
        ),
        (dict(ranks=(((fmt.SliceSpec(1, 0, 4),),), ((fmt.SliceSpec(1, 3, 3), fmt.SliceSpec(0, 0, 3)),))), "overlap"),
        (dict(ranks=(((fmt.SliceSpec(1, 0, 4),),), ((fmt.SliceSpec(1, 4, 3), fmt.SliceSpec(0, 0, 3)),))), "slice"),
        (dict(ranks=(((fmt.SliceSpec(2, 0, 4),),), ((fmt.SliceSpec(1, 4, 2), fmt.SliceSpec(0, 0, 3)),))), "tensor 2"),
        (
            dict(ranks=(((fmt.SliceSpec(1, 0, 4),), ()), ((fmt.SliceSpec(1, 4, 2), fmt.SliceSpec(0, 0, 3)),))),
            "no slice",
        ),
        (dict(ranks=(((fmt.SliceSpec(1, -1, 4),),), ((fmt.SliceSpec(1, 4, 2), fmt.SliceSpec(0, 0, 3)),))), "slice"),
    ],
)
def test_strict_manifest_parsing(changes, message):
    with pytest.raises(FormatError, match=message):
        fmt.decode_manifest(fmt.encode_manifest(manifest(**changes)))


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
        (
            b'{"size":1.0,"sha256":"'
            + b"0" * 64
            + b'","format":"lightning_delta.commit/3","kind":"base","prev_step":null,"signature":null}',
            "size must be int",
        ),
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
    deep = b"[" * 30_000 + b"]" * 30_000
    blob = fmt.MAGIC + len(deep).to_bytes(4, "little") + bytes(4) + deep
    with pytest.raises(FormatError, match="nests"):
        fmt.decode_blob(blob)
    for bad in [b'{"created":1e400}', b'{"format":"lightning_delta.run/2","run_id":"r","world_size":"2"}']:
        with pytest.raises(FormatError):
            fmt.decode_manifest(bad)


def test_records_write_what_they_read():
    h = header(probe=2, kind=fmt.Kind.DELTA, prev_step=0)
    assert records.loads(records.dumps(h), fmt.PartHeader, what="x", max_bytes=1 << 20) == h
    assert records.loads(records.dumps(manifest()), fmt.RunManifest, what="x", max_bytes=1 << 20) == manifest()


def test_foreign_and_truncated_objects():
    with pytest.raises(FormatError, match="magic"):
        fmt.decode_blob(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(FormatError, match="magic"):  # a format 4 part
        fmt.decode_blob(b"LDELTA\x00\x04" + blob_of(header())[8:])
    with pytest.raises(FormatError, match="truncated"):
        fmt.decode_blob(b"LDELTA")
    blob = blob_of(header())
    with pytest.raises(FormatError, match="does not fit"):
        fmt.decode_blob(blob[:20])
    with pytest.raises(FormatError, match=rf"^part is {len(blob) - 1} bytes; its header describes {len(blob)} "):
        fmt.decode_blob(blob[:-1])
    with pytest.raises(FormatError, match=r"^part header is malformed: "):
        fmt.decode_blob(fmt.MAGIC + (2).to_bytes(4, "little") + bytes(4) + b"{}")
    for size, count in [(fmt.MAX_HEADER_BYTES + 1, 1), (100, fmt.MAX_PAYLOADS + 1)]:
        huge = blob[:8] + size.to_bytes(4, "little") + count.to_bytes(4, "little") + blob[16:]
        with pytest.raises(FormatError, match="over the bounds"):
            fmt.decode_blob(huge)


def test_commit_marker_round_trip_and_verification():
    blob = b"some blob"
    marker = fmt.decode_commit(fmt.encode_commit(blob, header()))
    assert (marker.kind, marker.prev_step) == (fmt.Kind.BASE, None)
    fmt.verify_blob(blob, marker)
    with pytest.raises(ChecksumError, match=r"^SHA-256 of the object does not match its commit marker$"):
        fmt.verify_blob(b"some blub", marker)
    with pytest.raises(FormatError, match="truncated"):
        fmt.verify_blob(blob[:-1], marker)
    wrong_kind = fmt.encode_commit(blob, header()).replace(b'"kind":"base"', b'"kind":"delta"')
    for bad in [b"{", b"[]", b'{"format":"lightning_delta.commit/2","size":-1,"sha256":"00"}', wrong_kind]:
        with pytest.raises(FormatError):
            fmt.decode_commit(bad)


def test_names():
    assert fmt.commit_path(7, 1, 2) == "steps/000000000/000000000007/rank-00001-of-00002.ldelta.commit"
    assert fmt.step_dir(123456) == "steps/000000123/000000123456"
    assert (
        fmt.commit_path(7, 1, 2, bridge=True) == "steps/000000000/000000000007/rank-00001-of-00002.bridge.ldelta.commit"
    )
    assert fmt.parse_part_name("rank-00001-of-00002.ldelta.commit") == (1, 2, False)
    assert fmt.parse_part_name("rank-00001-of-00002.bridge.ldelta.commit") == (1, 2, True)
    assert fmt.parse_part_name("rank-00001-of-00002.base.ldelta.commit") is None
    assert fmt.parse_part_name("rank-00002-of-00002.ldelta.commit") is None
    assert fmt.parse_part_name("rank-00001-of-00002.ldelta") is None
    assert fmt.parse_block_name("000000001") == 1
    for stray in ["\u00b2", "5", "00000000\u00b2", "0000000001", "000000001.tmp"]:
        assert fmt.parse_block_name(stray) is None
    assert fmt.parse_step_name("000000001005", 1) == 1005
    assert fmt.parse_step_name("000000001005", 0) is None  # a step in another block's folder
    for stray in ["5", "\u00b2" * 12, "00000000000\uff15", "\uff10" * 11 + "\uff15"]:  # fullwidth digits
        assert fmt.parse_step_name(stray, 0) is None


def test_an_unterminated_string_is_refused_in_memory_bounded_by_its_size():
    """The fuzzer's find: the bracket-depth scan's string pattern backtracked, holding over 100
    bytes a character (480 MiB for this 4 MiB manifest)."""
    import tracemalloc

    text = b'{"run_id": "' + bytes(4 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="malformed"):
            fmt.decode_manifest(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(text), peak


def _reference_depth(data: bytes) -> int:
    """Byte by byte: a quote toggles strings unless an odd run of backslashes comes right before it."""
    deepest = level = slashes = 0
    inside = False
    for byte in data:
        if byte == ord('"') and slashes % 2 == 0:
            inside = not inside
        elif not inside and byte in b"[{":
            level += 1
            deepest = max(deepest, level)
        elif not inside and byte in b"]}":
            level -= 1
        slashes = slashes + 1 if byte == ord("\\") else 0
    return deepest


@given(
    st.lists(st.sampled_from([b'"', b"\\", b"\\\\", b"a", b"[", b"]", b"{", b"}", b"\xff"]), max_size=60),
    st.integers(1, 9),
)
def test_the_nesting_scan_counts_brackets_outside_strings_across_chunks(pieces, scan):
    text = b"".join(pieces)
    saved, records._SCAN = records._SCAN, scan  # chunk borders anywhere: in a run of backslashes, a string
    try:
        assert records._depth(text) == _reference_depth(text)
    finally:
        records._SCAN = saved


def test_the_nesting_scan_of_escaped_quotes_ends():
    """Both regular expressions tried for strings took quadratic time on this (40 KB: 2.5 s, so
    this 8 MiB would take about a day); the alarm turns such a hang into a failure."""
    import signal

    def hung(*_):
        raise AssertionError("the nesting scan did not end within 300 s")

    text = b'["' + b'\\"' * (4 << 20)  # unterminated: every quote escaped
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(300)
    try:
        assert records._depth(text) == 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


SEED = bytes(range(32))  # the golden key's seed: Ed25519 signatures are deterministic
GOLDEN_SIGNER = "ed25519:03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
GOLDEN_SIGNED_MANIFEST = (
    b'{"created":1.5,"format":"lightning_delta.run/3","part_format":"lightning_delta/5",'
    b'"ranks":[[[{"numel":2,"start":0,"tensor":0}]]],"run_id":"run","signature":"d67cfcbbecf769f0a64d9765c87bc5bd'
    b"37fe790df132f9feb8d1abf5322c09523ba61d4ceb26a97e634228c8de6d021593b84d5e2ca5f7a7be074c2d6f2da80b"
    b'","signer":"' + GOLDEN_SIGNER.encode() + b'","tensors":[{"dtype":"bfloat16","name":"w","shape":[2]}],'
    b'"world_size":1}'
)
GOLDEN_MANIFEST_DIGEST = "584c270f795f3d7587e64dcf19944278e830da473f900231aa70f79ae9dcc0a1"
GOLDEN_PART_STATEMENT = (
    b'{"format":"lightning_delta.part-signature/1","kind":"delta","manifest":"'
    + GOLDEN_MANIFEST_DIGEST.encode()
    + b'",'
    b'"prev_step":4,"rank":0,"run_id":"run","sha256":"' + b"ab" * 32 + b'","size":244,"step":5,"world_size":1}'
)
GOLDEN_PART_SIGNATURE = (
    "3e063c1a30e0823fffc5bd28b7bb06b4125cb4171029691d50e033e4d9a8a1c9"
    "2e56e40e3437de652e99e055b911ff1949b81342658fd277e85fa3fb0198190a"
)
GOLDEN_HEARTBEAT_STATEMENT = (
    b'{"format":"lightning_delta.heartbeat/1","manifest":"' + GOLDEN_MANIFEST_DIGEST.encode() + b'",'
    b'"run_id":"run","signature":null,"step":5,"time":1700000000.25}'
)
GOLDEN_HEARTBEAT_SIGNATURE = (
    "18ae0d906405449d359b02ec2101876dd5b6ea1f864a7b59473032563106eaa5"
    "572e019a49979de76793f96d423817e0e44d7e4cd93a497f02dbcd5bd2c9600e"
)


def test_golden_bytes_pin_what_is_signed():
    """docs/FORMAT.md section 10: the signed bytes of a manifest, a marker and a heartbeat, and
    their signatures by a fixed key.  A change here is a format change."""
    import dataclasses

    from lightning_delta.signing import PublicKey, SigningKey

    key = SigningKey.from_seed(SEED)
    assert key.public.text == GOLDEN_SIGNER
    unsigned = fmt.RunManifest(
        "run", 1, 1.5, (fmt.TensorSpec("w", "bfloat16", (2,)),), (((fmt.SliceSpec(0, 0, 2),),),), signer=GOLDEN_SIGNER
    )
    signed_bytes = fmt.run_signed_bytes(unsigned)
    signature = GOLDEN_SIGNED_MANIFEST.split(b'"signature":"')[1][:128].decode()
    assert signed_bytes == GOLDEN_SIGNED_MANIFEST.replace(signature.encode(), b"", 1).replace(b'""', b"null", 1)
    assert key.sign(signed_bytes) == signature
    manifest = dataclasses.replace(unsigned, signature=signature)
    assert fmt.encode_manifest(manifest) == GOLDEN_SIGNED_MANIFEST
    run = fmt.decode_manifest(GOLDEN_SIGNED_MANIFEST)
    assert run.manifest == manifest and run.sha256 == GOLDEN_MANIFEST_DIGEST
    marker = fmt.CommitMarker(244, "ab" * 32, fmt.Kind.DELTA, 4, signature=GOLDEN_PART_SIGNATURE)
    statement = fmt.part_signed_bytes("run", run.sha256, fmt.PartPlace(5, 0, 1, False), marker)
    assert statement == GOLDEN_PART_STATEMENT and key.sign(statement) == GOLDEN_PART_SIGNATURE
    assert b'"kind":"bridge"' in fmt.part_signed_bytes("run", run.sha256, fmt.PartPlace(5, 0, 1, True), marker)
    beat = fmt.Heartbeat("run", run.sha256, 5, 1_700_000_000.25)
    assert fmt.heartbeat_signed_bytes(beat) == GOLDEN_HEARTBEAT_STATEMENT
    assert key.sign(GOLDEN_HEARTBEAT_STATEMENT) == GOLDEN_HEARTBEAT_SIGNATURE
    public = PublicKey(GOLDEN_SIGNER)
    assert public.verify(GOLDEN_PART_SIGNATURE, GOLDEN_PART_STATEMENT)
    assert not public.verify(GOLDEN_PART_SIGNATURE, GOLDEN_PART_STATEMENT.replace(b'"step":5', b'"step":6'))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"signer": "ed25519:" + "0" * 63}, "signer is not"),
        ({"signer": "ed25519:" + "A" * 64}, "signer is not"),
        ({"signature": "0" * 127}, "malformed signature"),
        ({"signature": "0" * 256}, "malformed signature"),
        ({"signature": None}, "a signer without a signature"),
        ({"signer": None}, "a signer without a signature"),
        ({"format": "lightning_delta.run/2"}, "a signature in a version 2 manifest"),
    ],
)
def test_signature_fields_are_bounded(change, message):
    raw = json.loads(GOLDEN_SIGNED_MANIFEST)
    raw.update(change)
    with pytest.raises(FormatError, match=message):
        fmt.decode_manifest(json.dumps(raw, separators=(",", ":"), sort_keys=True).encode())
    marker = {"format": "lightning_delta.commit/3", "kind": "base", "prev_step": None, "sha256": "0" * 64, "size": 1}
    for bad in ("0" * 127, "0" * 129, "G" * 128, 7, ""):
        with pytest.raises(FormatError):
            fmt.decode_commit(json.dumps({**marker, "signature": bad}).encode())
    v2 = {**marker, "format": "lightning_delta.commit/2"}
    with pytest.raises(FormatError):
        fmt.decode_commit(json.dumps({**v2, "signature": "0" * 128}).encode())
    assert fmt.decode_commit(json.dumps(v2).encode()).signature is None


# ----------------------------------------------------------------------------- every rule at its bound
# #39's format.py survivors: each record's rules accepted at their bound, refused one past it, with
# the whole message a user reads (a rule whose bound or message moved would pass a looser test).

SIGNATURE = "0123456789abcdef" * 8
SIGNER = "ed25519:" + "0123456789abcdef" * 4


def _refuses(record, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        record.check()


def test_a_commit_markers_rules_are_exact():
    base = fmt.CommitMarker(0, "0" * 64, fmt.Kind.BASE, None)
    delta = dataclasses.replace(base, kind=fmt.Kind.DELTA, prev_step=0)
    for good in [
        base,
        dataclasses.replace(base, size=fmt.MAX_OBJECT_BYTES, sha256="f" * 64, signature=SIGNATURE),
        dataclasses.replace(base, format="lightning_delta.commit/2"),
        delta,
        dataclasses.replace(delta, prev_step=fmt.MAX_STEP),
    ]:
        good.check()
    v2 = "lightning_delta.commit/2"
    for bad, message in [
        (
            dataclasses.replace(base, format="lightning_delta.commit/4"),
            f"format 'lightning_delta.commit/4', expected 'lightning_delta.commit/3' (or '{v2}')",
        ),
        (dataclasses.replace(base, format=v2, signature=SIGNATURE), "a signature in a version 2 marker"),
        (dataclasses.replace(base, signature=SIGNATURE[:-1]), "malformed signature"),
        (dataclasses.replace(base, signature=SIGNATURE.upper()), "malformed signature"),
        (dataclasses.replace(base, size=-1), "size -1"),
        (dataclasses.replace(base, size=fmt.MAX_OBJECT_BYTES + 1), f"size {fmt.MAX_OBJECT_BYTES + 1}"),
        (dataclasses.replace(base, sha256="0" * 63), "sha256 is not 64 lower-case hex digits"),
        (dataclasses.replace(base, prev_step=0), "a base with prev_step"),
        (dataclasses.replace(delta, prev_step=None), "a delta with prev_step"),
        (dataclasses.replace(delta, prev_step=-1), "prev_step -1"),
        (dataclasses.replace(delta, prev_step=fmt.MAX_STEP + 1), f"prev_step {fmt.MAX_STEP + 1}"),
    ]:
        _refuses(bad, message)


MARKER_V2 = {"format": "lightning_delta.commit/2", "kind": "delta", "prev_step": 3, "sha256": "0" * 64, "size": 9}
MARKER_KEYS = "['format', 'kind', 'prev_step', 'sha256', 'signature', 'size']"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**MARKER_V2, "format": "lightning_delta.commit/3", "signature": None, "size": -1}, "size -1"),
        ({**MARKER_V2, "size": -1}, "size -1"),  # a version 2 marker's own error, not the keys it lacks
        (
            {**MARKER_V2, "format": "lightning_delta.commit/3"},
            "format 'lightning_delta.commit/3' without the key 'signature' (version 2's keys, "
            "'lightning_delta.commit/2'): a 'lightning_delta.commit/3' marker holds it, null if unsigned",
        ),
        ({**MARKER_V2, "signature": SIGNATURE}, "a signature in a version 2 marker"),
        ({"size": 9}, f"CommitMarker must hold exactly the keys {MARKER_KEYS}, got ['size']"),
    ],
)
def test_a_commit_markers_error_is_the_one_of_the_version_it_has_the_keys_of(raw, message):
    with pytest.raises(FormatError, match=f"^commit marker is malformed: {re.escape(message)}$"):
        fmt.decode_commit(json.dumps(raw).encode())


def test_a_version_2_marker_reads_as_an_unsigned_marker_of_its_format():
    marker = fmt.decode_commit(json.dumps(MARKER_V2).encode())
    assert marker == fmt.CommitMarker(9, "0" * 64, fmt.Kind.DELTA, 3, "lightning_delta.commit/2", None)
    signed = fmt.CommitMarker(9, "0" * 64, fmt.Kind.DELTA, 3, signature=SIGNATURE)
    assert fmt.decode_commit(records.dumps(signed)) == signed


def test_a_part_headers_rules_are_exact():
    delta = header(kind=fmt.Kind.DELTA, step=5, prev_step=4)
    for good in [
        header(step=0),
        header(step=fmt.MAX_STEP, rank=fmt.MAX_WORLD_SIZE - 1, world_size=fmt.MAX_WORLD_SIZE, probe=fmt.MAX_PROBE),
        delta,
        dataclasses.replace(delta, prev_step=0),
    ]:
        good.check()
    for bad, message in [
        (header(format="lightning_delta/4"), "format 'lightning_delta/4'; this reader understands 'lightning_delta/5'"),
        (header(manifest=DIGEST[:-1]), "manifest is not 64 lower-case hex digits"),
        (header(step=-1), "step -1"),
        (header(step=fmt.MAX_STEP + 1), f"step {fmt.MAX_STEP + 1}"),
        (header(rank=-1), "rank -1 of 1"),
        (header(rank=1), "rank 1 of 1"),
        (header(world_size=fmt.MAX_WORLD_SIZE + 1), f"rank 0 of {fmt.MAX_WORLD_SIZE + 1}"),
        (header(prev_step=0), "a base with a prev_step"),
        (dataclasses.replace(delta, prev_step=None), "prev_step None"),
        (dataclasses.replace(delta, prev_step=5), "prev_step 5"),
        (dataclasses.replace(delta, prev_step=-1), "prev_step -1"),
        (header(probe=-1), "probe of -1 values"),
        (header(probe=fmt.MAX_PROBE + 1), f"probe of {fmt.MAX_PROBE + 1} values"),
    ]:
        _refuses(bad, message)


def test_a_payload_entrys_rules_are_exact():
    fmt.PayloadEntry(fmt.MAX_OBJECT_BYTES, fmt.MAX_ELEMENTS, 2**64 - 1).check()
    _refuses(fmt.PayloadEntry(fmt.MAX_OBJECT_BYTES + 1, 0, 0), f"payload of {fmt.MAX_OBJECT_BYTES + 1} bytes")
    _refuses(fmt.PayloadEntry(0, fmt.MAX_ELEMENTS + 1, 0), f"payload with {fmt.MAX_ELEMENTS + 1} changes")


def test_a_tensor_specs_rules_are_exact():
    for good in [
        fmt.TensorSpec("n" * 1024, "float16", (fmt.MAX_ELEMENTS,)),
        fmt.TensorSpec("w", "bfloat16", (0, fmt.MAX_ELEMENTS)),
        fmt.TensorSpec("w", "bfloat16", (2**20, 2**20)),
    ]:
        good.check()
    for bad, message in [
        (fmt.TensorSpec("", "bfloat16", (1,)), "tensor name of 0 characters"),
        (fmt.TensorSpec("n" * 1025, "bfloat16", (1,)), "tensor name of 1025 characters"),
        (fmt.TensorSpec("w", "int16", (1,)), "tensor 'w': dtype 'int16'"),
        (fmt.TensorSpec("w", "bfloat16", (2, -1)), "tensor 'w': shape (2, -1)"),
        (fmt.TensorSpec("w", "bfloat16", (fmt.MAX_ELEMENTS + 1,)), f"tensor 'w': shape ({fmt.MAX_ELEMENTS + 1},)"),
        (
            fmt.TensorSpec("w", "bfloat16", (2**20, 2**20 + 1)),
            f"tensor 'w': shape (1048576, 1048577) over {fmt.MAX_ELEMENTS} elements",
        ),
    ]:
        _refuses(bad, message)


def test_a_run_manifests_rules_are_exact():
    wide = fmt.RunManifest(
        "r" * 128,
        fmt.MAX_WORLD_SIZE,
        1.5,
        (fmt.TensorSpec("w", "bfloat16", (fmt.MAX_ELEMENTS,)),),
        (((fmt.SliceSpec(0, 0, fmt.MAX_ELEMENTS),),),) + ((),) * (fmt.MAX_WORLD_SIZE - 1),
    )
    # a rank holding every element allowed; a slice of no elements anywhere in a tensor
    zero = ((fmt.SliceSpec(1, 0, 4), fmt.SliceSpec(1, 5, 0)),)
    for good in [
        wide,
        manifest(world_size=2, ranks=(zero, manifest().ranks[1])),
        manifest(format="lightning_delta.run/2"),
    ]:
        good.check()
    held = manifest().ranks[1]
    over = (fmt.TensorSpec("a", "bfloat16", (fmt.MAX_ELEMENTS,)), fmt.TensorSpec("b", "bfloat16", (1,)))
    for bad, message in [
        (
            manifest(format="lightning_delta.run/4"),
            "format 'lightning_delta.run/4'; this reader understands 'lightning_delta.run/3' and "
            "'lightning_delta.run/2'",
        ),
        (manifest(part_format="lightning_delta/4"), "parts of format 'lightning_delta/4', not 'lightning_delta/5'"),
        (manifest(run_id="r" * 129), f"run_id {'r' * 40!r}"),
        (manifest(run_id="a/b"), "run_id 'a/b'"),
        (manifest(world_size=0, ranks=()), "world_size 0"),
        (manifest(world_size=fmt.MAX_WORLD_SIZE + 1), f"world_size {fmt.MAX_WORLD_SIZE + 1}"),
        (manifest(world_size=1), "layouts of 2 ranks for 1"),
        (
            manifest(tensors=(fmt.TensorSpec("b", "bfloat16", (3,)), fmt.TensorSpec("b", "bfloat16", (6,)))),
            "a tensor name repeats",
        ),
        (manifest(ranks=(((fmt.SliceSpec(1, 0, 4),), ()), held)), "rank 0 payload 1 holds no slice"),
        (manifest(ranks=(((fmt.SliceSpec(-1, 0, 4),),), held)), "rank 0 payload 0: tensor -1"),
        (manifest(ranks=(((fmt.SliceSpec(2, 0, 4),),), held)), "rank 0 payload 0: tensor 2"),
        (manifest(ranks=(((fmt.SliceSpec(1, -1, 4),),), held)), "rank 0: slice [-1, +4) of 'w' (2, 3)"),
        (manifest(ranks=(((fmt.SliceSpec(1, 0, -1),),), held)), "rank 0: slice [0, +-1) of 'w' (2, 3)"),
        (manifest(ranks=(((fmt.SliceSpec(1, 0, 7),),), held)), "rank 0: slice [0, +7) of 'w' (2, 3)"),
        (
            manifest(tensors=(fmt.TensorSpec("b", "float16", (3,)), fmt.TensorSpec("w", "bfloat16", (2, 3)))),
            "rank 1 payload 0 mixes dtypes",
        ),
        (
            manifest(
                world_size=1, tensors=over, ranks=(((fmt.SliceSpec(0, 0, fmt.MAX_ELEMENTS), fmt.SliceSpec(1, 0, 1)),),)
            ),
            f"rank 0 holds {fmt.MAX_ELEMENTS + 1} elements, over {fmt.MAX_ELEMENTS}",
        ),
        (
            manifest(tensors=(*manifest().tensors, fmt.TensorSpec("x", "bfloat16", (0,)))),
            "no rank holds tensor 'x'",
        ),
        (manifest(ranks=(((fmt.SliceSpec(1, 0, 3),),), held)), "'w': slices leave a gap or overlap at element 3"),
        (
            manifest(ranks=(((fmt.SliceSpec(1, 0, 5),),), ((fmt.SliceSpec(0, 0, 3),),))),
            "'w': slices cover 5 of 6 elements",
        ),
    ]:
        _refuses(bad, message)


@pytest.mark.parametrize(
    "signer, signature, may_sign, message",
    [
        (SIGNER, None, True, "a signer without a signature, or a signature without one"),
        (None, SIGNATURE, True, "a signer without a signature, or a signature without one"),
        (SIGNER, SIGNATURE, False, "a signature in a version 2 manifest"),
        (SIGNER[:-1], SIGNATURE, True, "signer is not 'ed25519:' and 64 hex digits"),
        (SIGNER, SIGNATURE[:-1], True, "malformed signature"),
    ],
)
def test_a_signed_manifests_fields_are_exact(signer, signature, may_sign, message):
    fmt._check_signed(SIGNER, SIGNATURE, True)
    fmt._check_signed(None, None, False)
    _refuses(
        manifest(signer=signer, signature=signature, format=fmt.RUN_FORMAT if may_sign else "lightning_delta.run/2"),
        message,
    )


def test_a_version_2_manifest_reads_as_an_unsigned_manifest_and_keeps_its_errors():
    raw = json.loads(fmt.encode_manifest(manifest()))
    del raw["signer"], raw["signature"]
    v2 = {**raw, "format": "lightning_delta.run/2"}
    data = json.dumps(v2).encode()
    run = fmt.decode_manifest(data)
    assert run.manifest == manifest(format="lightning_delta.run/2") and run.sha256 == hashlib.sha256(data).hexdigest()
    assert run.numel(0) == 4 and run.numel(1) == 5
    for bad, message in [
        ({**v2, "world_size": 3}, "layouts of 2 ranks for 3"),  # its own error, not the keys it lacks
        (
            raw,
            "format 'lightning_delta.run/3' without the keys 'signer' and 'signature' (version 2's keys, "
            "'lightning_delta.run/2'): a 'lightning_delta.run/3' manifest holds both, null if unsigned",
        ),
        ({"run_id": "r"}, "RunManifest must hold exactly the keys"),
    ]:
        with pytest.raises(FormatError, match=f"^run manifest is malformed: {re.escape(message)}"):
            fmt.decode_manifest(json.dumps(bad).encode())


def test_only_a_signed_manifest_or_heartbeat_must_be_canonical():
    unsigned = fmt.encode_manifest(manifest())
    spaced = json.dumps(json.loads(unsigned)).encode()
    assert spaced != unsigned and fmt.decode_manifest(spaced).sha256 == hashlib.sha256(spaced).hexdigest()
    assert fmt.decode_manifest(GOLDEN_SIGNED_MANIFEST).manifest.signature is not None
    with pytest.raises(
        FormatError, match=r"^a signed run manifest must be stored in its canonical encoding \(section 10\)$"
    ):
        fmt.decode_manifest(json.dumps(json.loads(GOLDEN_SIGNED_MANIFEST)).encode())
    beat = fmt.Heartbeat("run", DIGEST, 5, 1.5)
    assert fmt.decode_heartbeat(json.dumps(json.loads(records.dumps(beat))).encode()) == beat
    signed = dataclasses.replace(beat, signature=SIGNATURE)
    assert fmt.decode_heartbeat(records.dumps(signed)) == signed
    with pytest.raises(
        FormatError, match=r"^a signed heartbeat must be stored in its canonical encoding \(section 10\)$"
    ):
        fmt.decode_heartbeat(json.dumps(json.loads(records.dumps(signed))).encode())
    with pytest.raises(FormatError, match=r"^heartbeat is malformed: step -1$"):
        fmt.decode_heartbeat(records.dumps(dataclasses.replace(beat, step=-1)))
    with pytest.raises(FormatError, match=rf"^heartbeat is {fmt.MAX_MARKER_BYTES + 1} bytes, more than the "):
        fmt.decode_heartbeat(records.dumps(beat).ljust(fmt.MAX_MARKER_BYTES + 1))
    fmt.decode_heartbeat(records.dumps(beat).ljust(fmt.MAX_MARKER_BYTES))


def test_a_heartbeats_rules_are_exact():
    beat = fmt.Heartbeat("r" * 128, DIGEST, None, 1.5)
    for good in [
        beat,
        dataclasses.replace(beat, step=0),
        dataclasses.replace(beat, step=fmt.MAX_STEP, signature=SIGNATURE),
    ]:
        good.check()
    for bad, message in [
        (
            dataclasses.replace(beat, format="lightning_delta.heartbeat/2"),
            "format 'lightning_delta.heartbeat/2', expected 'lightning_delta.heartbeat/1'",
        ),
        (dataclasses.replace(beat, run_id="r" * 129), f"run_id {'r' * 40!r}"),
        (dataclasses.replace(beat, run_id=""), "run_id ''"),
        (dataclasses.replace(beat, manifest=DIGEST.upper()), "manifest is not 64 lower-case hex digits"),
        (dataclasses.replace(beat, step=-1), "step -1"),
        (dataclasses.replace(beat, step=fmt.MAX_STEP + 1), f"step {fmt.MAX_STEP + 1}"),
        (dataclasses.replace(beat, signature=SIGNATURE + "0"), "malformed signature"),
    ]:
        _refuses(bad, message)


def test_what_is_signed_leaves_the_signature_out():
    signed = manifest(signer=SIGNER, signature=SIGNATURE)
    assert fmt.run_signed_bytes(signed) == records.dumps(manifest(signer=SIGNER))
    beat = fmt.Heartbeat("run", DIGEST, 5, 1.5)
    assert fmt.heartbeat_signed_bytes(dataclasses.replace(beat, signature=SIGNATURE)) == records.dumps(beat)


def test_small_helpers_say_what_they_refuse():
    assert fmt.check_run_id("r" * 128) == "r" * 128
    with pytest.raises(ValueError, match=r"^run_id must be 1-128 letters, digits, '\.', '_' or '-', got 'a/b'$"):
        fmt.check_run_id("a/b")
    assert fmt.DType.of("float16") is fmt.DType.float16 and fmt.DType.of(torch.int16) is fmt.DType.int16
    with pytest.raises(
        ValueError, match=r"^torch\.float32 is not a 16-bit type of this format \(bfloat16, float16, int16\)$"
    ):
        fmt.DType.of(torch.float32)
    assert [fmt.DType.from_code(c) for c in (1, 2, 3)] == list(fmt.DType)
    with pytest.raises(ValueError, match=r"^dtype code 4$"):
        fmt.DType.from_code(4)
    assert fmt.parse_part_name("rank-99998-of-99999.ldelta.commit") == (99_998, 99_999, False)
    assert fmt.parse_part_name("rank-00000-of-00000.ldelta.commit") is None


def test_a_blob_is_encoded_only_as_its_header_and_table_describe():
    one = header(probe=1)
    assert fmt.decode_blob(fmt.encode_blob(one, [ENTRY], [b"abcd"], (2.0,))).probe == (2.0,)
    assert fmt.decode_blob(fmt.encode_blob(header(), [ENTRY], [b"abcd"], ())).probe is None
    for h, payloads, probe in [(one, [b"abcd"], None), (one, [b"abcd"], (1.0, 2.0)), (header(), [b"abc"], None)]:
        with pytest.raises(ValueError, match=r"^the header and table do not describe the probe and payloads given$"):
            fmt.encode_blob(h, [ENTRY], payloads, probe)


def test_a_foreign_part_names_both_runs_abbreviated():
    run = fmt.decode_manifest(fmt.encode_manifest(manifest()))
    blob = fmt.encode_blob(header(step=3, world_size=2), [fmt.PayloadEntry(0, 0, 7)], [b""])
    foreign = rf"^is a part of another run \(its manifest {DIGEST[:12]}\.\.\., the prefix's {run.sha256[:12]}\.\.\., "
    with pytest.raises(ChainError, match=foreign + r"run run\): a foreign part$"):
        fmt.parse_part(blob, fmt.PartRef(3, fmt.Kind.BASE, None, len(blob)), 0, run)
