from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import bitwise_equal
from lightning_delta import codec
from lightning_delta.codec import CodecOptions, Compressor, Mode
from lightning_delta.errors import FormatError

DTYPES = [torch.bfloat16, torch.float16]
ALL_COMPRESSORS = [
    CodecOptions(Compressor.ZSTD),
    CodecOptions(Compressor.LZ4),
    CodecOptions(Compressor.NONE),
]
SPECIAL = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x807F, 0x7F7F, 0x3F80]
"""bf16 +0, -0, +inf, -inf, quiet NaN, signalling NaN payload, all-ones NaN, subnormals, max, 1.0."""


def as_tensor(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([b - 65536 if b >= 32768 else b for b in bits], dtype=torch.int16).view(dtype)


bit_patterns = st.integers(0, 0xFFFF) | st.sampled_from(SPECIAL)


@st.composite
def pairs(draw):
    """(old, new): random, adversarial, all-changed, none-changed, +-1-only and sparse pairs."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 300))
    old = draw(st.lists(bit_patterns, min_size=n, max_size=n))
    how = draw(st.sampled_from(["random", "same", "ulp", "sparse", "wrap"]))
    if how == "random":
        new = draw(st.lists(bit_patterns, min_size=n, max_size=n))
    elif how == "same":
        new = list(old)
    elif how == "wrap":  # differences that wrap around 2**16 in both directions
        new = [(b + draw(st.sampled_from([1, -1, 32768, 32767, -32768]))) % 65536 for b in old]
    else:
        p = draw(st.floats(0.0, 1.0))
        steps = [1, -1] if how == "ulp" else [1, -1, 2, -7, 300, 32768]
        new = [(b + draw(st.sampled_from(steps))) % 65536 if draw(st.floats(0, 1)) < p else b for b in old]
    return as_tensor(old, dtype), as_tensor(new, dtype)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs(), st.sampled_from(ALL_COMPRESSORS))
def test_decode_of_encode_is_bit_identical(pair, options):
    old, new = pair
    payload = codec.encode(old, new, options)
    assert bitwise_equal(codec.decode(old, payload), new)
    base = codec.encode(None, new, options)
    assert bitwise_equal(codec.decode(None, base, numel=new.numel(), dtype=new.dtype), new)
    reused = torch.full_like(new, 3.0)  # a previous step's buffer: every element is overwritten
    assert bitwise_equal(codec.decode(old, payload, out=reused), new)
    assert bitwise_equal(codec.decode(None, base, numel=new.numel(), dtype=new.dtype, out=reused.fill_(3.0)), new)


def test_decode_into_out_refuses_old_itself_and_another_dtype():
    old = torch.randn(1000).to(torch.bfloat16)
    new = (old.view(torch.int16) + 1).view(torch.bfloat16)
    payload = codec.encode(old, new)
    with pytest.raises(ValueError, match="other than"):
        codec.decode(old, payload, out=old)
    with pytest.raises(ValueError, match="1000 elements"):
        codec.decode(old, payload, out=torch.empty(999, dtype=torch.bfloat16))
    base = codec.encode(None, new)
    with pytest.raises(ValueError, match="bfloat16 tensor of 1000 elements"):
        codec.decode(None, base, numel=1000, dtype=torch.bfloat16, out=torch.empty(1000, dtype=torch.float16))
    with pytest.raises(FormatError, match=r"expected torch\.float16"):
        codec.decode(None, base, numel=1000, dtype=torch.float16)


@settings(max_examples=100, deadline=None)
@given(pairs())
def test_decoded_change_lists_exactly_the_changed_elements(pair):
    old, new = pair
    decoded = codec.decode_change(old, codec.encode(old, new))
    if decoded.change is not None:
        expected = (old.view(torch.int16) != new.view(torch.int16)).nonzero().squeeze(1)
        assert torch.equal(decoded.change.index, expected)


def test_nothing_changed_is_a_tiny_payload():
    old = torch.randn(100_000).to(torch.bfloat16)
    payload = codec.encode(old, old.clone())
    assert len(payload) < 64
    assert bitwise_equal(codec.decode(old, payload), old)


def test_one_ulp_changes_cost_about_their_entropy():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(1_000_000, generator=g).to(torch.bfloat16)
    mask = torch.rand(1_000_000, generator=g) < 0.01
    step = torch.where(torch.rand(1_000_000, generator=g) < 0.5, 1, -1).to(torch.int16)
    new = (old.view(torch.int16) + step * mask).view(torch.bfloat16)
    packed = codec.pack_delta(codec.diff(old, new), new)
    assert packed.mode == Mode.SPARSE and packed.k == 0
    m, n = int(mask.sum()), old.numel()
    p = m / n
    bound_bits = -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p)) + m  # mask + one sign bit
    assert len(codec.encode(old, new)) * 8 < 1.10 * bound_bits


def test_dense_change_falls_back_to_raw():
    old = torch.randn(1000).to(torch.bfloat16)
    new = torch.randn(1000).to(torch.bfloat16)  # a re-initialised tensor: nothing to gain from a diff
    assert codec.pack_delta(codec.diff(old, new), new).mode == Mode.RAW
    assert bitwise_equal(codec.decode(old, codec.encode(old, new)), new)


def test_golden_bytes_pin_the_format():
    """A format change must break this test and bump the version (docs/FORMAT.md)."""
    old = as_tensor([0x3F80, 0x4000, 0x0000, 0x8000, 0x7FC0], torch.bfloat16)
    new = as_tensor([0x3F81, 0x4000, 0x0000, 0x8000, 0x7FBF], torch.bfloat16)
    payload = codec.encode(old, new, CodecOptions(Compressor.NONE))
    assert payload.hex() == (
        "4c444301"
        "01"
        "01"
        "01"
        "01"  # magic, SPARSE, SPLIT, l=1, bfloat16
        "05"
        "02"
        "00"  # varints n=5, m=2 changed, k=0 larger than one
        "00"
        "01"
        "00"  # low bits of positions 0 and 4: 0, 0
        "00"
        "01"
        "09"  # high bits (5 of them): set at 0+0 and 2+1 -> 0b01001
        "00"
        "01"
        "03"  # both changes are +-1
        "00"
        "01"
        "01"  # signs: +1, -1
        "00"
        "00"  # no magnitudes
    )
    base = codec.encode(None, as_tensor([0x3F80, 0xC001], torch.bfloat16), CodecOptions(Compressor.NONE))
    assert base.hex() == (
        "4c44430100020001020200"  # magic, RAW, EXPONENT, l=0, bfloat16; n=2, m=2, k=0
        "00027f80"  # exponent bytes: 0x7F, 0x80
        "00020081"  # sign and mantissa bytes: +0x00, -0x01
    )
    half = codec.encode(None, as_tensor([0x3C00, 0xC001], torch.float16), CodecOptions(Compressor.NONE))
    assert half.hex() == "4c444301000000020202000002000100023cc0"  # float16: low, then high byte plane


def test_api_refuses_wrong_inputs():
    a = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(a.view(2, 2), a.view(2, 2))
    with pytest.raises(ValueError, match="match"):
        codec.encode(a, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        codec.encode(None, torch.zeros(4))
    with pytest.raises(ValueError, match="numel` and `dtype"):
        codec.decode(None, codec.encode(None, a), numel=4)


# ----------------------------------------------------------------------------- hostile payloads


def _sample():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(5000, generator=g).to(torch.bfloat16)
    new = old.clone().view(torch.int16)
    new[torch.randperm(5000, generator=g)[:80]] += 3
    return old, new.view(torch.bfloat16)


@pytest.mark.parametrize("options", ALL_COMPRESSORS, ids=lambda o: o.compressor.name)
def test_every_truncation_is_a_format_error(options):
    old, new = _sample()
    payload = codec.encode(old, new, options)
    for cut in range(len(payload)):
        with pytest.raises(FormatError):
            codec.decode(old, payload[:cut])
    with pytest.raises(FormatError, match="trailing"):
        codec.decode(old, payload + b"\0")


@pytest.mark.parametrize("options", ALL_COMPRESSORS, ids=lambda o: o.compressor.name)
def test_flipped_bytes_raise_or_decode_within_bounds(options):
    """A flipped byte gives FormatError or some tensor of the right size, never a crash or an
    out-of-bounds write; the value checksum (tested in test_chain) catches the wrong values."""
    old, new = _sample()
    payload = bytearray(codec.encode(old, new, options))
    for pos in range(len(payload)):
        for mask in (0x01, 0x80):
            payload[pos] ^= mask
            try:
                out = codec.decode(old, bytes(payload))
                assert out.shape == new.shape and out.dtype == new.dtype
            except FormatError:
                pass
            payload[pos] ^= mask


def _patched(payload: bytes, pos: int, value: bytes) -> bytes:
    return payload[:pos] + value + payload[pos + len(value) :]


@pytest.mark.parametrize(
    "patch, message",
    [
        (lambda p: _patched(p, 0, b"XXXX"), "magic"),
        (lambda p: _patched(p, 4, b"\x07"), "unknown"),
        (lambda p: _patched(p, 5, b"\x00"), "inconsistent"),
        (lambda p: _patched(p, 6, b"\x09"), "inconsistent"),
        (lambda p: _patched(p, 7, b"\x09"), "unknown"),
        (lambda p: p[:8] + b"\x87\x27" + p[10:], "elements"),  # n = 4999
        (lambda p: p[:8] + b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01" + p[10:], "longer than 9"),
        (lambda p: p[:10] + b"\xf0\x2e" + p[11:], "inconsistent"),  # m = 6000 > n
    ],
)
def test_hostile_headers_are_refused_before_allocation(patch, message):
    old, new = _sample()
    payload = codec.encode(old, new)
    assert payload[8:10] == b"\x88\x27"  # n = 5000 as a varint
    with pytest.raises(FormatError, match=message):
        codec.decode(old, patch(payload))


def test_decompression_bomb_is_bounded():
    """A section that inflates past its implied size is refused, not materialised."""
    old, _ = _sample()
    bomb = codec._zstd_compress(memoryview(b"\0" * (64 << 20)), 3)
    header = b"LDC\x01" + bytes([0, 0, 0, 1]) + codec._varint(5000) * 2 + b"\x00"
    payload = header + b"\x01" + codec._varint(len(bomb)) + bomb + b"\x00" + codec._varint(5000) + b"\0" * 5000
    with pytest.raises(FormatError, match="decompress"):
        codec.decode(old, payload)


def test_varints_must_be_minimal():
    old, new = _sample()
    payload = codec.encode(old, new)
    assert payload[10:12] == b"\x50\x50"  # m = k = 80: every change in _sample() is +3
    with pytest.raises(FormatError, match="non-minimal"):
        codec.decode(old, payload[:11] + b"\xd0\x00" + payload[12:])  # k = 80 spelt in two bytes


def test_positions_must_strictly_increase():
    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone().view(torch.int16)
    new[[3, 8]] = 1
    payload = bytearray(codec.encode(old, new.view(torch.bfloat16), CodecOptions(Compressor.NONE)))
    # n=64, m=2: l=5; low bits 3 and 8 packed as 3 | 8 << 5; both in bucket 0: high bits 0b011.
    low_at = 11 + 2  # after the 8-byte header, three 1-byte varints and the section's 2-byte prefix
    assert payload[low_at : low_at + 2] == (3 | 8 << 5).to_bytes(2, "little")
    payload[low_at : low_at + 2] = (8 | 3 << 5).to_bytes(2, "little")  # positions 8, 3
    with pytest.raises(FormatError, match="strictly increasing"):
        codec.decode(old, bytes(payload))
