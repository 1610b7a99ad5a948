from __future__ import annotations

import functools
import math
import threading
from unittest import mock

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Verdict, bitwise_equal, verdict
from lightning_delta import bitpack, codec, compressors, decoder, wire
from lightning_delta.codec import CodecOptions, Compressor, Context, Mode, ValueCoding
from lightning_delta.errors import FormatError
from lightning_delta.format import DType

DTYPES = [torch.bfloat16, torch.float16]
ALL_COMPRESSORS = [
    CodecOptions(Compressor.ZSTD),
    CodecOptions(Compressor.LZ4),
    CodecOptions(Compressor.NONE),
]
CLASSED = CodecOptions(context=Context.EXPONENT)
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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs(), st.sampled_from(ALL_COMPRESSORS))
def test_decode_of_encode_is_bit_identical(pair, options):
    old, new = pair
    payload = codec.encode(old, new, options)
    assert bitwise_equal(codec.decode(old, payload), new)
    base = codec.encode(None, new, options)
    assert bitwise_equal(codec.decode(None, base, numel=new.numel(), dtype=new.dtype), new)
    reused = torch.full_like(new, 3.0)  # a previous step's buffer: every element is overwritten
    assert codec.decode(old, payload, out=reused) is reused and bitwise_equal(reused, new)
    reused.fill_(3.0)
    assert codec.decode(None, base, numel=new.numel(), dtype=new.dtype, out=reused) is reused
    assert bitwise_equal(reused, new)


@st.composite
def structured_pairs(draw):
    """(old, new) where small weights change often and large ones rarely, as under Adam: the
    structure CLASSED payloads code (or, where it does not pay, the SPARSE fallback)."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 3000))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    small = torch.rand(n, generator=g) < draw(st.floats(0.0, 1.0))
    old = (torch.randn(n, generator=g) * torch.where(small, 1e-3, 1.0)).to(dtype)
    rate = torch.where(small, draw(st.floats(0.0, 1.0)), draw(st.floats(0.0, 0.05)))
    steps = torch.tensor(draw(st.lists(st.sampled_from([1, -1, 1, -1, 2, -5, 300, 32768]), min_size=1)))
    step = steps[torch.randint(len(steps), (n,), generator=g)].to(torch.int16)
    new = old.view(torch.int16) + step * (torch.rand(n, generator=g) < rate)
    return old, new.view(dtype)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs() | structured_pairs(), st.sampled_from(ALL_COMPRESSORS))
def test_exponent_context_decodes_bit_identically(pair, options):
    old, new = pair
    options = CodecOptions(options.compressor, context=Context.EXPONENT)
    decoded = codec.decode_change(old, codec.encode(old, new, options))
    assert bitwise_equal(decoded.new, new)
    if decoded.change is not None:
        expected = (old.view(torch.int16) != new.view(torch.int16)).nonzero().squeeze(1)
        assert torch.equal(decoded.change.index, expected)


def _adam_like(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fifth of the weights a thousand times smaller; they change at 30%, the rest at 1%."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand(n, generator=g) < 0.2
    old = (torch.randn(n, generator=g) * torch.where(small, 1e-3, 1.0)).to(torch.bfloat16)
    changed = torch.rand(n, generator=g) < torch.where(small, 0.3, 0.01)
    step = torch.where(torch.rand(n, generator=g) < 0.5, 1, -1).to(torch.int16)
    return old, (old.view(torch.int16) + step * changed).view(torch.bfloat16)


def test_exponent_context_codes_positions_per_class():
    old, new = _adam_like(200_000)
    change = codec.diff(old, new, exponents=True)
    assert codec.pack_delta(change, new).mode == Mode.CLASSED
    classed, plain = codec.encode(old, new, CLASSED), codec.encode(old, new, CodecOptions(context=Context.NONE))
    assert len(classed) < 0.85 * len(plain)
    assert bitwise_equal(codec.decode(old, classed), new)


def test_exponent_context_without_structure_stays_sparse():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(200_000, generator=g).to(torch.bfloat16)
    new = (old.view(torch.int16) + (torch.rand(200_000, generator=g) < 0.02)).view(torch.bfloat16)
    assert codec.pack_delta(codec.diff(old, new, exponents=True), new).mode == Mode.SPARSE
    assert codec.encode(old, new, CLASSED) == codec.encode(old, new, CodecOptions(context=Context.NONE))


def test_auto_context_classes_only_off_the_cpu():
    auto = CodecOptions()
    assert not auto.conditions(torch.device("cpu")) and auto.conditions(torch.device("cuda"))
    assert CLASSED.conditions(torch.device("cpu"))
    assert not CodecOptions(context=Context.NONE).conditions(torch.device("cuda"))


def test_classed_payload_against_another_tensor_is_refused():
    old, new = _adam_like(20_000)
    payload = codec.encode(old, new, CLASSED)
    other = old.clone()
    other.view(torch.int16)[old.view(torch.int16).abs().argmax()] = 0  # one element moves class
    with pytest.raises(FormatError, match="another tensor"):
        codec.decode(other, payload)


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
    with pytest.raises(ValueError, match=r"^decoding without `old` needs the expected `numel` and `dtype`$"):
        codec.decode(None, base, numel=1000)
    # `old` stated twice: it must agree with itself
    assert bitwise_equal(codec.decode(old, payload, numel=1000, dtype=torch.bfloat16), new)
    with pytest.raises(ValueError, match=r"^`old` is torch\.bfloat16 of 1000 elements, not torch\.float16 of 1000$"):
        codec.decode(old, payload, numel=1000, dtype=torch.float16)


def test_an_lz4_section_larger_than_its_block_format_holds_is_refused_before_decompressing():
    size = compressors._LZ4_MAX + 1
    expected = f"^an lz4 block holds at most {compressors._LZ4_MAX} bytes, this section {size}$"
    with pytest.raises(FormatError, match=expected):
        compressors._lz4_decompress(memoryview(b"\0"), size)


def test_a_zstd_frame_that_declares_another_size_is_refused_and_each_thread_decompresses_with_its_own():
    """The frame's own content size must not size the output (a flipped bit there would allocate
    gigabytes): one that disagrees with the section's is refused. zstd's decompressor objects must
    not be shared between threads: a new thread makes its own."""
    params = zstandard.ZstdCompressionParameters.from_level(
        1, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_content_size=True
    )
    frame = memoryview(zstandard.ZstdCompressor(compression_params=params).compress(b"\0" * 100))
    with pytest.raises(FormatError, match=r"^zstd frame declares 100 bytes, expected 50$"):
        compressors._zstd_decompress(frame, 50)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(compressors._zstd_decompress(frame, 100)))
    thread.start()
    thread.join()
    assert got == [b"\0" * 100]


@settings(max_examples=100, deadline=None)
@given(pairs())
def test_decoded_change_lists_exactly_the_changed_elements(pair):
    old, new = pair
    payload = codec.encode(old, new)
    decoded = codec.decode_change(old, payload)
    if codec.mode_of(payload) == Mode.RAW:  # shipped whole: no list of changes
        assert decoded.change is None
        return
    change, expected = decoded.change, (old.view(torch.int16) != new.view(torch.int16)).nonzero().squeeze(1)
    assert change is not None
    assert torch.equal(change.index, expected)
    assert torch.equal(change.old, old.view(torch.int16)[expected])
    assert torch.equal(change.new, new.view(torch.int16)[expected])
    assert (change.numel, change.dtype) == (old.numel(), old.dtype)


def test_a_sparse_payload_without_the_previous_tensor_is_refused_with_what_it_needs():
    old = torch.randn(1000).to(torch.bfloat16)
    payload = codec.encode(old, (old.view(torch.int16) + 1).view(torch.bfloat16))
    assert codec.mode_of(payload) == Mode.SPARSE
    with pytest.raises(FormatError, match=r"^a SPARSE tensor payload needs the previous tensor to decode against$"):
        codec.decode(None, payload, numel=1000, dtype=torch.bfloat16)


def test_a_classed_payload_without_the_previous_tensor_is_refused_with_what_it_needs():
    old = as_tensor([0x3F00 if i % 16 == 0 else 0x3F80 for i in range(256)], torch.bfloat16)
    new = old.clone()
    new.view(torch.int16)[::16] += 1
    payload = codec.encode(old, new, CLASSED)
    assert codec.mode_of(payload) == Mode.CLASSED
    with pytest.raises(ValueError, match=r"^a CLASSED payload needs the old tensor's exponents$"):
        codec.decode(None, payload, numel=256, dtype=torch.bfloat16)


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
        "00"
        "01"  # magic, SPARSE, SPLIT, l = floor(log2(5 / 2)) - 1 = 0, bfloat16
        "05"
        "02"
        "00"  # varints n=5, m=2 changed, k=0 larger than one
        "00"
        "00"  # no low bits
        "00"
        "01"
        "21"  # high bits (2 + 4 + 1 of them): set at 0+0 and 4+1 -> 0b0100001
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
    # CLASSED: 256 elements, every 16th 0.5 (exponent 0x7E), the rest 1.0 (0x7F); each 0.5 steps +1.
    old = as_tensor([0x3F00 if i % 16 == 0 else 0x3F80 for i in range(256)], torch.bfloat16)
    new = as_tensor([0x3F01 if i % 16 == 0 else 0x3F80 for i in range(256)], torch.bfloat16)
    classed = codec.encode(old, new, CodecOptions(Compressor.NONE, context=Context.EXPONENT))
    assert classed.hex() == (
        "4c444301020100"  # magic, CLASSED, SPLIT, l=0
        "01"  # bfloat16
        "80021000"  # varints n=256 (two bytes), m=16, k=0
        "01"  # one class with changes:
        "7e1010"  # exponent 0x7E: 16 members, 16 changed; l_c = 0, H_c = 16 + 15 + 1 = 32 bits
        "0000"  # no low bits
        "000455555555"  # high bits: rank j sets bit j + j
        "0002ffff"  # every change is +-1
        "0002ffff"  # all +1
        "0000"  # no magnitudes
    )


def test_sparse_payloads_with_no_change_or_one_in_a_last_bucket_of_its_own_are_these_bytes():
    """Golden bytes at the edges of Elias-Fano's lengths: no change has no low and no high bits; a
    change at n - 1 = 48 alone in the last bucket (l = 3, bucket 6) still ends that bucket with its
    zero bit, which makes the high bits 2 + 6 + 1 = 9 bits, two bytes."""
    none = torch.zeros(4, dtype=torch.bfloat16)
    assert codec.encode(none, none, CodecOptions(Compressor.NONE)).hex() == (
        "4c44430101010001"  # magic, SPARSE, SPLIT, l=0, bfloat16
        "040000"  # n=4, m=0, k=0
        "00000000000000000000"  # five empty sections
    )
    old = torch.zeros(49, dtype=torch.bfloat16)
    new = old.clone().view(torch.int16)
    new[[0, 48]] = 1
    payload = codec.encode(old, new.view(torch.bfloat16), CodecOptions(Compressor.NONE))
    assert payload.hex() == (
        "4c44430101010301"  # magic, SPARSE, SPLIT, l=3, bfloat16
        "310200"  # n=49, m=2, k=0
        "000100"  # low bits: 0 and 0
        "00028100"  # high bits: bucket 0 at bit 0, bucket 6 at bit 6 + 1; bit 8 ends bucket 6
        "000103"  # both +-1
        "000103"  # both +1
        "0000"  # no magnitudes
    )
    assert bitwise_equal(codec.decode(old, payload), new.view(torch.bfloat16))


def test_mode_of_reads_the_eight_header_bytes_and_never_raises():
    """The engine routes a step's payloads by `mode_of` before `parse` checks them: a damaged or
    foreign one must give None (never an exception), and the eight header bytes alone suffice."""
    old = torch.zeros(4, dtype=torch.bfloat16)
    payload = codec.encode(old, old, CodecOptions(Compressor.NONE))
    assert codec.mode_of(payload) == codec.mode_of(payload[:8]) == Mode.SPARSE
    for damaged in (payload[:7], b"XDC\x01" + payload[4:], _patched(payload, 4, b"\x07")):
        assert codec.mode_of(damaged) is None


@pytest.mark.parametrize("dtype, shift, mask", [(torch.bfloat16, 7, 0xFF), (torch.float16, 10, 0x1F)])
def test_exponent_bytes_are_each_elements_biased_exponent_whatever_its_sign(dtype, shift, mask):
    """The class a CLASSED delta codes an element in, for all 65,536 bit patterns."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32)
    expected = ((bits & 0xFFFF) >> shift) & mask
    assert torch.equal(codec.exponent_bytes(bits.to(torch.int16).view(dtype)), expected.to(torch.uint8))


def test_byte_view_is_the_bytes_it_is_given_none_included():
    assert codec.byte_view(b"").numel() == 0  # a stored section of no bytes
    assert codec.byte_view(memoryview(b"\x00\xff")).tolist() == [0, 255]


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


HOSTILE = [*ALL_COMPRESSORS, CLASSED]


def _hostile_sample(options: CodecOptions) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    old, new = _adam_like(5000, seed=1) if options.context == Context.EXPONENT else _sample()
    payload = codec.encode(old, new, options)
    assert codec.parse(payload, old.numel()).mode == (Mode.CLASSED if options is CLASSED else Mode.SPARSE)
    return old, new, payload


def _hostile_id(options: CodecOptions) -> str:
    return "CLASSED" if options is CLASSED else options.compressor.name


@pytest.mark.parametrize("options", HOSTILE, ids=_hostile_id)
def test_every_truncation_is_a_format_error(options):
    old, _, payload = _hostile_sample(options)
    for cut in range(len(payload)):
        with pytest.raises(FormatError):
            codec.decode(old, payload[:cut])
    with pytest.raises(FormatError, match="trailing"):
        codec.decode(old, payload + b"\0")


@pytest.mark.parametrize("options", HOSTILE, ids=_hostile_id)
def test_flipped_bytes_are_refused_or_caught_by_the_checksum(options):
    """A flipped byte gives FormatError, the same tensor, or one of the right size whose values
    the trainer's checksum tells apart: never a crash, an out-of-bounds write, or wrong values
    under the right checksum."""
    old, new, payload = _hostile_sample(options)
    payload = bytearray(payload)
    seen = []
    for pos in range(len(payload)):
        for mask in (0x01, 0x80):
            payload[pos] ^= mask
            seen.append(verdict(functools.partial(codec.decode, old, bytes(payload)), new))
            payload[pos] ^= mask
    assert Verdict.REFUSED in seen


def _pieces(payload: bytes, old: torch.Tensor, chunk: int | None) -> codec.Steps | FormatError:
    """Every piece of `payload` in chunks of `chunk` changes, joined; or the FormatError met."""
    try:
        pieces = list(
            codec.iter_steps(
                payload,
                numel=old.numel(),
                dtype=old.dtype,
                device=old.device,
                exponents=lambda: codec.exponent_bytes(old),
                chunk=chunk,
            )
        )
    except FormatError as err:
        return err
    if pieces[0].whole is not None:
        return pieces[0]
    assert all(p.index is not None and p.step is not None and p.index.numel() for p in pieces[1:])
    return codec.Steps(torch.cat([p.index for p in pieces]), torch.cat([p.step for p in pieces]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs() | structured_pairs(), st.sampled_from([CodecOptions(), CLASSED]), st.sampled_from([1, 8, 9, 64, 1000]))
def test_a_payload_decodes_the_same_in_chunks_of_any_size(pair, options, chunk):
    """What bounds a follower's memory by the chunk, not the tensor: the changes of a SPARSE
    payload in ascending runs of at most `chunk` (8 bits of the unary high bits per byte), which
    join to what one piece decodes; a RAW or CLASSED payload is one piece."""
    old, new = pair
    payload = codec.encode(old, new, options)
    whole, pieces = _pieces(payload, old, None), _pieces(payload, old, chunk)
    assert isinstance(whole, codec.Steps) and isinstance(pieces, codec.Steps)
    if whole.whole is not None:
        assert pieces.whole is not None and bitwise_equal(pieces.whole, whole.whole)
        return
    assert torch.equal(pieces.index, whole.index) and torch.equal(pieces.step, whole.step)
    rebuilt = old.view(torch.int16).clone()
    rebuilt[pieces.index] += pieces.step
    assert bitwise_equal(rebuilt.view(new.dtype), new)


def _structure(payload: bytes) -> set[int]:
    """The positions of a SPARSE or CLASSED payload's fields: its header, class table and each
    section's compressor and stored length (the rest is the sections' stored bytes)."""
    view = memoryview(payload)
    pos = 8
    for _ in range(3):  # n, m, k
        _, pos = wire._read_varint(view, pos)
    if view[4] == Mode.CLASSED:
        count, pos = wire._read_varint(view, pos)
        for _ in range(count):  # an exponent byte, its members and its changes
            _, pos = wire._read_varint(view, pos + 1)
            _, pos = wire._read_varint(view, pos)
    fields = set(range(pos))
    while pos < len(view):
        start, (stored, end) = pos, wire._read_varint(view, pos + 1)
        fields |= set(range(start, end))
        pos = end + stored
    return fields


def _check_chunks_refuse(payload: bytes, old: torch.Tensor, chunks: tuple[int, ...]) -> None:
    whole = _pieces(payload, old, None)
    for chunk in chunks:
        pieces = _pieces(payload, old, chunk)
        assert isinstance(pieces, FormatError) == isinstance(whole, FormatError), chunk
        if isinstance(whole, codec.Steps) and isinstance(pieces, codec.Steps) and whole.whole is None:
            assert torch.equal(pieces.index, whole.index) and torch.equal(pieces.step, whole.step)


@pytest.mark.parametrize("options", HOSTILE, ids=_hostile_id)
def test_chunks_refuse_exactly_the_damaged_payloads_one_piece_refuses(options):
    """Every byte of a payload flipped: decoded in chunks of 8 or 64 changes, it is refused exactly
    when one piece is (by the time the last chunk is due), and otherwise decodes the same.  Each
    field (header, class table, a section's compressor and length) with three masks; each byte of
    a section's stored bits with one of them in turn, so that every section meets all three (the
    bytes of a bit stream are alike; the next test flips any bit at random)."""
    old, _, payload = _hostile_sample(options)
    fields, damaged = _structure(payload), bytearray(payload)
    for pos in range(len(payload)):
        for mask in (0x01, 0x10, 0x80) if pos in fields else ((0x01, 0x10, 0x80)[pos % 3],):
            damaged[pos] ^= mask
            _check_chunks_refuse(bytes(damaged), old, (8, 64))
            damaged[pos] ^= mask


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(HOSTILE), st.data(), st.integers(0, 7), st.sampled_from([1, 8, 9, 64, 1000]))
def test_chunks_refuse_what_one_piece_refuses_with_any_bit_flipped(options, data, bit, chunk):
    """Any one bit of a payload flipped (the test above flips three of each field's and one of
    each stored byte's), in chunks of any size: refused exactly when one piece is."""
    old, _, payload = _hostile_sample(options)
    pos = data.draw(st.integers(0, len(payload) - 1))
    damaged = bytearray(payload)
    damaged[pos] ^= 1 << bit
    _check_chunks_refuse(bytes(damaged), old, (chunk,))


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
        (
            lambda p: p[:8] + b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01" + p[10:],
            "^tensor payload has a section length longer than 9 bytes$",
        ),
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
    bomb = compressors._zstd_compress(memoryview(b"\0" * (64 << 20)), 3)
    header = b"LDC\x01" + bytes([0, 0, 0, 1]) + wire._varint(5000) * 2 + b"\x00"
    payload = header + b"\x01" + wire._varint(len(bomb)) + bomb + b"\x00" + wire._varint(5000) + b"\0" * 5000
    with pytest.raises(FormatError, match="decompress"):
        codec.decode(old, payload)


@pytest.mark.parametrize(
    "dtype, at, value",
    [
        (torch.bfloat16, 9, b"\x3f"),  # m != n
        (torch.bfloat16, 10, b"\x01"),  # k
        (torch.float16, 5, bytes([ValueCoding.EXPONENT])),  # the exponent coding is bfloat16's alone
        (torch.bfloat16, 6, b"\x01"),  # low bits
    ],
)
def test_a_raw_header_with_any_one_field_inconsistent_is_refused(dtype, at, value):
    g = torch.Generator().manual_seed(0)
    old, new = (torch.randn(64, generator=g).to(dtype) for _ in range(2))
    payload = codec.encode(old, new, CodecOptions(Compressor.NONE))
    assert codec.mode_of(payload) == Mode.RAW and payload[8:11] == b"\x40\x40\x00"  # n, m, k
    with pytest.raises(FormatError, match=r"^RAW tensor payload with inconsistent header fields$"):
        codec.decode(old, _patched(payload, at, value))


def test_a_truncated_header_an_unknown_compressor_and_too_many_elements_are_refused_with_what_is_wrong():
    g = torch.Generator().manual_seed(0)
    old, new = (torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(2))
    payload = codec.encode(old, new, CodecOptions(Compressor.NONE))
    with pytest.raises(FormatError, match=r"^tensor payload truncated: 5 bytes, header needs 8$"):
        codec.decode(old, payload[:5])
    with pytest.raises(FormatError, match=r"^tensor payload truncated inside a section length$"):
        codec.decode(old, payload[:8] + b"\x80")
    with pytest.raises(FormatError, match=r"^unknown compressor code 9 in tensor payload$"):
        codec.decode(old, _patched(payload, 11, b"\x09"))  # the first section's compressor
    limit = 1 << 40
    with pytest.raises(FormatError, match=f"^a tensor payload holds at most {limit} elements, {limit + 1} expected$"):
        codec.parse(payload, limit + 1)


def test_varints_must_be_minimal():
    old, new = _sample()
    payload = codec.encode(old, new)
    assert payload[10:12] == b"\x50\x50"  # m = k = 80: every change in _sample() is +3
    with pytest.raises(FormatError, match=r"^tensor payload has a non-minimal section length$"):
        codec.decode(old, payload[:11] + b"\xd0\x00" + payload[12:])  # k = 80 spelt in two bytes


def _sections(payload: bytes) -> list[tuple[int, int]]:
    """Where each section of a SPARSE or RAW payload stored uncompressed starts, and its length."""

    def varint(pos: int) -> tuple[int, int]:
        value, shift = 0, 0
        while payload[pos] & 0x80:
            value, shift, pos = value | (payload[pos] & 0x7F) << shift, shift + 7, pos + 1
        return value | payload[pos] << shift, pos + 1

    pos, found = varint(varint(varint(8)[1])[1])[1], []
    while pos < len(payload):
        assert payload[pos] == Compressor.NONE
        size, pos = varint(pos + 1)
        found.append((pos, size))
        pos += size
    return found


def _two_changes(n: int, at: list[int]) -> tuple[torch.Tensor, bytes]:
    old = torch.zeros(n, dtype=torch.bfloat16)
    new = old.clone().view(torch.int16)
    new[at] = 1
    return old, codec.encode(old, new.view(torch.bfloat16), CodecOptions(Compressor.NONE))


def test_damaged_sparse_payloads_are_refused_with_what_is_wrong():
    old, payload = _two_changes(64, [3, 8])
    (low, _), (high, _), (unit, _), _, (magnitude, _) = _sections(payload)
    cases = {
        "^tensor payload truncated: section of 5 bytes runs past the end$": _patched(payload, magnitude - 1, b"\x05"),
        "^tensor payload has 2 trailing bytes$": payload + b"\0\0",
        "^Elias-Fano high bits hold more than the 2 entries the header says$": _patched(payload, high, b"\x07"),
        # the second change flagged larger than one, where the header counts none
        "^tensor payload flags more changes larger than one than its header's 0$": _patched(payload, unit, b"\x01"),
        # the header counts one change larger than one (its magnitude stored), the flags none
        "^tensor payload flags more changes larger than one than its header's 1$": _patched(payload, 10, b"\x01")[
            : magnitude - 1
        ]
        + b"\x02\0\0",
    }
    assert payload[low] == 3 | 8 << 4 and payload[high] == 0b011 and payload[10] == 0  # k
    for message, damaged in cases.items():
        with pytest.raises(FormatError, match=message):
            codec.decode(old, damaged)
    # n = 50, two changes: 3 low bits, so a position's bucket and low bits can name 50 to 55
    old, payload = _two_changes(50, [3, 49])
    (low, _), *_ = _sections(payload)
    assert payload[low] == 3 | 1 << 3
    for beyond in (50, 55):
        with pytest.raises(FormatError, match=r"^changed positions are out of range or not strictly increasing$"):
            codec.decode(old, _patched(payload, low, bytes([3 | (beyond & 7) << 3])))


def test_a_change_larger_than_one_flagged_early_is_refused_in_the_piece_that_holds_it():
    """Decoded in chunks, the first piece already holds more large changes than the header's."""
    old, new = _adam_like(5000)
    payload = codec.encode(old, new, CodecOptions(Compressor.NONE))
    assert codec.parse(payload, 5000).k == 0
    _, _, (unit, _), _, _ = _sections(payload)
    assert payload[unit] & 1
    damaged = _patched(payload, unit, bytes([payload[unit] & 0xFE]))
    for chunk in (None, 1, 8):
        pieces = _pieces(damaged, old, chunk)
        assert isinstance(pieces, FormatError)
        assert str(pieces) == "tensor payload flags more changes larger than one than its header's 0"


def test_a_position_named_twice_is_refused_within_a_piece_and_across_two():
    """n = 64, one low bit: nine changes at 0-7 and 40 (high bits 0, 1, 3, 4, 6, 7 | 9, 10 | 28).
    Named twice in one piece (low bits 3, 3), or with the seventh change moved to bit 8 as 5 again:
    the first of the second byte's piece (chunks of one change are one byte) repeats the last."""
    old, payload = _two_changes(64, [0, 1, 2, 3, 4, 5, 6, 7, 40])
    (low, _), (high, _), *_ = _sections(payload)
    assert payload[low : low + 2] == b"\xaa\x00" and payload[high : high + 2] == b"\xdb\x06"
    across = _patched(_patched(payload, low, b"\xea"), high + 1, b"\x05")
    old_two, two = _two_changes(64, [3, 8])
    (low_two, _), *_ = _sections(two)
    within = _patched(two, low_two, bytes([3 | 3 << 4]))
    for against, damaged in ((old, across), (old_two, within)):
        for chunk in (None, 1):
            pieces = _pieces(damaged, against, chunk)
            assert isinstance(pieces, FormatError)
            assert str(pieces) == "changed positions are out of range or not strictly increasing"


@pytest.mark.parametrize("step, refused", [(32767, False), (32768, True), (-32768, False), (-32769, True)])
def test_a_step_of_more_than_16_bits_is_refused(step, refused):
    old, new = _sample()  # every change +3: stored as a magnitude of 3 - 2
    payload = codec.encode(old, new, CodecOptions(Compressor.NONE))
    _, _, _, (sign, _), (magnitude, size) = _sections(payload)
    k = size // 2
    assert payload[magnitude] == 1 and payload[sign] & 1
    stored = abs(step) - 2
    damaged = bytearray(payload)
    damaged[magnitude], damaged[magnitude + k] = stored & 0xFF, stored >> 8
    damaged[sign] = payload[sign] & 0xFE | (step > 0)
    if refused:
        with pytest.raises(FormatError, match=r"^a tensor payload holds a change larger than 16 bits$"):
            codec.decode(old, bytes(damaged))
        return
    got = codec.decode(old, bytes(damaged)).view(torch.int16)
    first = int((new.view(torch.int16) != old.view(torch.int16)).nonzero()[0])
    assert int(got[first]) == (int(old.view(torch.int16)[first]) + step + 32768) % 65536 - 32768


@pytest.mark.parametrize("chunk", [16, 64])
def test_a_sparse_payload_in_chunks_comes_in_pieces_of_about_the_chunk(chunk):
    """What bounds a follower's memory: at most five times `chunk` changes a piece, and no more
    pieces than twice `m / chunk`, over a run of unchanged elements (empty spans) too."""
    g = torch.Generator().manual_seed(chunk)
    old = torch.randn(1 << 16, generator=g).to(torch.bfloat16)
    for at in (torch.randperm(1 << 16, generator=g)[:1024], torch.cat([torch.arange(500), torch.arange(65036, 65536)])):
        new = old.clone().view(torch.int16)
        new[at] += 1
        payload = codec.encode(old, new.view(torch.bfloat16), CodecOptions(Compressor.NONE))
        pieces = list(
            codec.iter_steps(
                payload, numel=old.numel(), dtype=old.dtype, device=old.device, exponents=None, chunk=chunk
            )
        )
        m = at.numel()
        assert m / (5 * chunk) <= len(pieces) <= 2 * m / chunk
        assert all(p.index is not None and 0 < p.index.numel() <= 5 * chunk for p in pieces)
        assert torch.equal(torch.cat([p.index for p in pieces if p.index is not None]), at.sort().values)


def test_classed_exponents_must_be_one_uint8_byte_an_element():
    old, payload = _classed_table_patch(bytes.fromhex("7e1010"))
    with pytest.raises(ValueError, match=r"^exponents must be 256 uint8 values, got torch.int16 \(256,\)$"):
        list(
            codec.iter_steps(
                payload,
                numel=256,
                dtype=torch.bfloat16,
                device=old.device,
                exponents=lambda: codec.exponent_bytes(old).to(torch.int16),
            )
        )


@pytest.mark.parametrize(
    "high, message",
    [
        ("57555555", "^Elias-Fano high bits hold 17 entries, header says 16$"),  # one bit more
        ("55555595", "^changed positions are out of their class or not strictly increasing in it$"),  # rank 16
        ("53555555", "^changed positions are out of their class or not strictly increasing in it$"),  # 0, 0
        ("4d555555", "^changed positions are out of their class or not strictly increasing in it$"),  # 0, 1, 1
    ],
)
def test_damaged_classed_high_bits_are_refused_with_what_is_wrong(high, message):
    """The golden payload's high bits (rank j at bit 2j) with one bit added or moved."""
    old, payload = _classed_table_patch(bytes.fromhex("7e1010"))
    at = payload.index(bytes.fromhex("55555555"))
    with pytest.raises(FormatError, match=message):
        codec.decode(old, _patched(payload, at, bytes.fromhex(high)))


def test_positions_must_strictly_increase():
    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone().view(torch.int16)
    new[[3, 8]] = 1
    payload = bytearray(codec.encode(old, new.view(torch.bfloat16), CodecOptions(Compressor.NONE)))
    # n=64, m=2: l=4; low bits 3 and 8 packed as 3 | 8 << 4; both in bucket 0: high bits 0b011.
    low_at = 11 + 2  # after the 8-byte header, three 1-byte varints and the section's 2-byte prefix
    assert payload[low_at] == 3 | 8 << 4
    payload[low_at] = 8 | 3 << 4  # positions 8, 3
    with pytest.raises(FormatError, match="strictly increasing"):
        codec.decode(old, bytes(payload))


def test_high_bits_must_hold_every_change_the_header_counts():
    """One piece or in chunks: a set high bit cleared is one change fewer than the header's."""
    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone().view(torch.int16)
    new[[3, 8]] = 1
    payload = bytearray(codec.encode(old, new.view(torch.bfloat16), CodecOptions(Compressor.NONE)))
    high_at = 11 + 2 + 1 + 2  # the header, the 1-byte low section with its prefix, the high one's prefix
    assert payload[high_at] == 0b011
    payload[high_at] = 0b001
    for chunk in (None, 1):
        assert isinstance(_pieces(bytes(payload), old, chunk), FormatError)
    with pytest.raises(FormatError, match="hold 1 entries, header says 2"):
        codec.decode(old, bytes(payload))


def _classed_table_patch(entries: bytes, count: int | None = None) -> tuple[torch.Tensor, bytes]:
    """The golden CLASSED payload's 16 changes of exponent 0x7E with another class table."""
    old = as_tensor([0x3F00 if i % 16 == 0 else 0x3F80 for i in range(256)], torch.bfloat16)
    header = bytes.fromhex("4c4443010201000180021000")
    table = wire._varint(len(entries) // 3 if count is None else count) + entries
    return old, header + table + bytes.fromhex("00000004555555550002ffff0002ffff0000")


@pytest.mark.parametrize(
    "entries, count, message",
    [
        (bytes.fromhex("7e1010"), 0, "^CLASSED tensor payload lists 0 exponent classes, at most 256 exist$"),
        (bytes.fromhex("7e1010"), 257, "^CLASSED tensor payload lists 257 exponent classes, at most 256 exist$"),
        (bytes.fromhex("7e1011"), None, "17 changes among 16"),
        (bytes.fromhex("7e1000"), None, "^CLASSED tensor payload: exponent 126 has 0 changes among 16$"),
        (bytes.fromhex("7e100f"), None, "15 changes, the header"),  # sums must match m
        (bytes.fromhex("7e08087e0808"), None, "out of order"),
        (bytes.fromhex("7f08087e0808"), None, "out of order"),
        (bytes.fromhex("7e820210"), None, "258 elements"),  # more members than n
        # more members than n over two classes, each within it
        (
            bytes.fromhex("7e10087ff80108"),
            None,
            "^CLASSED tensor payload: its classes hold 264 elements and 16 changes, the header 256 and 16$",
        ),
        (
            bytes.fromhex("7f1010"),  # the old tensor has no 16 of 0x7F
            None,
            "^CLASSED tensor payload was made against another tensor: its exponent classes differ$",
        ),
        (bytes.fromhex("7e10"), 1, "CLASSED|truncated"),  # the entry runs into the sections
    ],
)
def test_hostile_class_tables_are_refused(entries, count, message):
    old, payload = _classed_table_patch(entries, count)
    with pytest.raises(FormatError, match=message):
        codec.decode(old, payload)


def _classed(n: str, m: int, k: int, table: str, sections: list[str]) -> bytes:
    """A bfloat16 CLASSED payload written field by field (docs/FORMAT.md): `n` as its varint's
    hex, `m`, `k` and the class count below 128, every section stored as it is."""
    header = bytes.fromhex("4c44430102010001" + n) + bytes([m, k, len(bytes.fromhex(table)) // 3])
    stored = b"".join(bytes([0, len(bytes.fromhex(s))]) + bytes.fromhex(s) for s in sections)
    return header + bytes.fromhex(table) + stored


GOLDEN_OLD = [0x3F00 if i % 16 == 0 else 0x3F80 for i in range(256)]
"""The golden CLASSED payload's tensor: every 16th element 0.5 (exponent 0x7E), the rest 1.0."""


@pytest.mark.parametrize(
    "old, payload, steps",
    [
        # one change: the 6th 0.5 (rank 5 of 16: 3 low bits, 101; high bit 0 of 3), +1
        (GOLDEN_OLD, _classed("8002", 1, 0, "7e1001", ["05", "01", "01", "01", ""]), {80: 1}),
        # every element changed (m == n), each +1
        (
            [0x3F00] * 16,
            _classed("10", 16, 0, "7e1010", ["", "55555555", "ffff", "ffff", ""]),
            dict.fromkeys(range(16), 1),
        ),
        # every step large (k == m): each 0.5 +2, its magnitude 2 - 2 = 0 in two byte planes
        (
            GOLDEN_OLD,
            _classed("8002", 16, 16, "7e1010", ["", "55555555", "0000", "ffff", "00" * 32]),
            dict.fromkeys(range(0, 256, 16), 2),
        ),
    ],
    ids=["one-change", "every-element", "every-step-large"],
)
def test_classed_payloads_at_the_bounds_of_their_header_decode(old, payload, steps):
    """A CLASSED header's counts at their edges (one change, all changed, all large) are valid."""
    old = as_tensor(old, torch.bfloat16)
    new = old.clone().view(torch.int16)
    for at, step in steps.items():
        new[at] += step
    packed = codec.parse(payload, old.numel())
    assert packed.mode == Mode.CLASSED and (packed.m, packed.k) == (len(steps), sum(abs(s) > 1 for s in steps.values()))
    assert bitwise_equal(codec.decode(old, payload), new.view(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_classed_payload_may_hold_every_exponent_class_the_top_one_included(dtype):
    """64 elements of each exponent all changed (the top one: infinities and NaNs), among 65,536
    unchanged ones of one exponent: positions coded per class win, with a class table of every
    exponent up to the dtype's top."""
    shift, top = {torch.bfloat16: (7, 0xFF), torch.float16: (10, 0x1F)}[dtype]
    one = 0x3F80 if dtype == torch.bfloat16 else 0x3C00
    bits = [e << shift | 0x10 for e in range(top + 1) for _ in range(64)] + [one] * 65536
    order = torch.randperm(len(bits), generator=torch.Generator().manual_seed(0))
    old = as_tensor(bits, dtype)[order]
    new = old.clone().view(torch.int16)
    new[(order < 64 * (top + 1)).nonzero().squeeze(1)] += 1
    payload = codec.encode(old, new.view(dtype), CodecOptions(Compressor.NONE, context=Context.EXPONENT))
    packed = codec.parse(payload, old.numel())
    assert packed.mode == Mode.CLASSED and [c[0] for c in packed.classes] == list(range(top + 1))
    assert bitwise_equal(codec.decode(old, payload), new.view(dtype))
    for chunk in (None, 8):
        pieces = _pieces(payload, old, chunk)
        assert isinstance(pieces, codec.Steps) and pieces.index is not None
        assert torch.equal(pieces.index.sort().values, (order < 64 * (top + 1)).nonzero().squeeze(1))


def test_a_sparse_header_with_more_large_steps_than_changes_is_refused():
    old, new = _sample()
    payload = codec.encode(old, new)
    assert payload[10:12] == b"\x50\x50"  # m = k = 80
    with pytest.raises(
        FormatError, match=r"^SPARSE tensor payload with inconsistent header \(n=5000, m=80, k=81, l=4\)$"
    ):
        codec.decode(old, _patched(payload, 11, b"\x51"))


def test_a_payload_cut_before_a_section_or_storing_one_of_another_size_is_refused_with_what_is_wrong():
    g = torch.Generator().manual_seed(0)
    old, new = (torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(2))
    payload = codec.encode(old, new, CodecOptions(Compressor.NONE))
    assert codec.mode_of(payload) == Mode.RAW and payload[11:13] == b"\x00\x40"  # stored, 64 bytes
    with pytest.raises(FormatError, match=r"^tensor payload truncated before a section$"):
        codec.decode(old, payload[:11])
    with pytest.raises(FormatError, match=r"^tensor payload truncated before a section$"):
        codec.decode(old, payload[: 13 + 64])  # the first section whole, the second missing
    shorter = payload[:12] + b"\x3f" + payload[13 : 13 + 63] + payload[13 + 64 :]
    with pytest.raises(FormatError, match=r"^NONE section holds 63 bytes, expected 64$"):
        codec.decode(old, shorter)


@pytest.mark.parametrize("numel, width", [(4096, 9), (1 << 16, 13)])
def test_a_few_changes_in_a_large_tensor_decode_with_low_bits_wider_than_a_byte(numel, width):
    """Elias-Fano's low bits are floor(log2(n / m)) - 1 wide: past 8 (three changes among 4,096
    elements and more) the decoder unpacks them bit by bit, not a byte's worth at a time."""
    old = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(torch.bfloat16)
    new = old.clone()
    at = torch.tensor([3, numel // 3, numel - 1])
    new.view(torch.int16)[at] += 1
    payload = codec.encode(old, new, CodecOptions(Compressor.NONE))
    packed = codec.parse(payload, numel)
    assert packed.mode == Mode.SPARSE and packed.low_bits == width and packed.classes == ()
    assert bitwise_equal(codec.decode(old, payload), new)
    for chunk in (None, 1):
        pieces = _pieces(payload, old, chunk)
        assert isinstance(pieces, codec.Steps) and torch.equal(pieces.index, at)


@pytest.mark.parametrize(
    "at, value, fields",
    [
        (5, b"\x00", "n=256, m=16, k=0, l=0"),  # not the SPLIT coding of the changes' steps
        (6, b"\x01", "n=256, m=16, k=0, l=1"),  # low bits (each class has its own)
        (10, b"\x00", "n=256, m=0, k=0, l=0"),  # no change
        (11, b"\x11", "n=256, m=16, k=17, l=0"),  # more large steps than changes
    ],
)
def test_a_classed_header_with_any_one_field_inconsistent_is_refused(at, value, fields):
    old, payload = _classed_table_patch(bytes.fromhex("7e1010"))
    with pytest.raises(FormatError, match=rf"^CLASSED tensor payload with inconsistent header \({fields}\)$"):
        codec.decode(old, _patched(payload, at, value))


def test_a_payload_that_ends_inside_its_class_table_is_refused():
    old, payload = _classed_table_patch(bytes.fromhex("7e0808"), 2)
    with pytest.raises(FormatError, match=r"^tensor payload truncated inside its class table$"):
        codec.decode(old, payload[: payload.index(bytes.fromhex("7e0808")) + 3])


def test_classed_high_bits_must_stay_in_their_class():
    old = as_tensor([0x3F00 if i % 16 == 0 else 0x3F80 for i in range(1024)], torch.bfloat16)
    new = old.clone().view(torch.int16)
    new[::16] += 1  # every 0.5 changes, and two of the 1.0s
    new[[5, 700]] -= 1
    payload = codec.encode(old, new.view(torch.bfloat16), CodecOptions(Compressor.NONE, context=Context.EXPONENT))
    packed = codec.parse(payload, 1024)
    assert packed.mode == Mode.CLASSED and len(packed.classes) == 2
    assert bitwise_equal(codec.decode(old, payload), new.view(torch.bfloat16))
    high = bytearray(packed.sections[1].numpy().tobytes())
    at = payload.index(bytes(high))
    refusals = set()

    def try_decode(broken: bytearray) -> None:
        try:
            got = codec.decode(old, bytes(broken))
            assert got.shape == old.shape
        except FormatError as err:
            refusals.add(str(err))

    bits = [(byte, bit) for byte in range(len(high)) for bit in range(8)]
    for byte, bit in bits:  # one flip: the count of set bits no longer matches the header
        broken = bytearray(payload)
        broken[at + byte] ^= 1 << bit
        try_decode(broken)
    # A set bit moved elsewhere keeps the count: only the per-class bounds can refuse it.
    is_set = [bool(high[byte] >> bit & 1) for byte, bit in bits]
    for i, (byte, bit) in enumerate(bits):
        for j, (to_byte, to_bit) in enumerate(bits):
            if is_set[i] and not is_set[j] and (i + j) % 4 == 0:
                broken = bytearray(payload)
                broken[at + byte] ^= 1 << bit
                broken[at + to_byte] ^= 1 << to_bit
                try_decode(broken)
    assert "Elias-Fano high bits set outside their exponent class" in refusals


def test_a_size_its_payload_cannot_hold_is_refused_before_allocating():
    """A RAW header that declares 2**40 elements, with a few stored bytes behind it: a zstd section
    expands at most 2**15 times, so it is refused before anything of that size is allocated."""
    numel = 2**40
    header = wire._HEADER.pack(codec.MAGIC, codec.Mode.RAW, codec.ValueCoding.EXPONENT, 0, DType.bfloat16.code)
    section = bytes([codec.Compressor.ZSTD]) + wire._varint(8) + bytes(8)
    payload = header + wire._varint(numel) * 2 + wire._varint(0) + section * 2
    with pytest.raises(FormatError, match="cannot hold"):
        codec.decode(None, payload, numel=numel, dtype=torch.bfloat16)


@given(st.lists(st.booleans(), max_size=300), st.integers(1, 3))
def test_positions_of_a_mask_are_torchs_nonzero(bits, stride):
    mask = torch.tensor(bits, dtype=torch.bool)[::stride]  # strided views too
    got = codec.positions_of(mask)
    assert got.dtype == torch.int64 and torch.equal(got, mask.nonzero().squeeze(1))


@given(st.binary(max_size=64), st.integers(0, 600), st.integers(0, 8))
def test_bits_pack_and_unpack_least_significant_first(data, count, skip):
    """The CPU's numpy (un)packing, of a slice as the decoder passes, against the definition: bit k
    of byte j is element 8j + k; no more elements than the bytes hold; `_count` counts them."""
    raw = torch.tensor(list(bytes(skip) + data), dtype=torch.uint8)[skip:]
    bits = bitpack.unpack_bits(raw, count)
    expected = [bool(byte >> k & 1) for byte in data for k in range(8)][:count]
    assert bits.dtype == torch.bool and bits.tolist() == expected
    assert bitpack.popcount(bits) == sum(expected)
    rebuilt = [sum(bit << k for k, bit in enumerate(expected[j : j + 8])) for j in range(0, len(expected), 8)]
    assert bitpack.pack_bits(bits).tolist() == rebuilt


def test_a_diff_read_again_at_the_changed_positions_is_the_diff_and_refuses_values_of_another_shape():
    """`diff_at` (the trainer's accelerator path: the new values read again only where they
    changed) gives `diff`'s change, and refuses a reader that gives other than one int16 value per
    changed position, which would pack a change that does not rebuild."""
    torch.manual_seed(3)
    old = torch.randn(1000, dtype=torch.bfloat16)
    new = old.clone()
    new[torch.randperm(1000)[:37]] += 1
    changed = old.view(torch.int16) != new.view(torch.int16)
    count = int(changed.sum())
    at = codec.diff_at(old, changed, count, lambda index: new.view(torch.int16)[index], exponents=True)
    want = codec.diff(old, new, exponents=True)
    for got, expected in zip(
        (at.index, at.old, at.new, at.exponents), (want.index, want.old, want.new, want.exponents), strict=True
    ):
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="new_at gave"):
        codec.diff_at(old, changed, count, lambda index: new[index])  # bf16, not its bits
    with pytest.raises(ValueError, match="new_at gave"):
        codec.diff_at(old, changed, count, lambda index: new.view(torch.int16)[index][1:])


def test_an_output_this_machine_cannot_allocate_is_a_format_error_that_names_it():
    """A header may declare up to `MAX_ELEMENTS` elements: where the decoder's output buffer cannot
    be allocated, the caller gets a `FormatError` saying so (not torch's `RuntimeError`), and a
    follower keeps the step it holds.  2**62 bf16 elements: the allocator refuses at once."""
    message = r"^cannot allocate 4611686018427387904 elements of torch\.bfloat16 on cpu$"
    with pytest.raises(FormatError, match=message):
        decoder._empty(2**62, torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16])
def test_every_diff_finds_exactly_the_changed_elements_at_any_length_and_alignment(dtype):
    """A delta's checksum is folded from the change `diff` finds, so a changed element it missed
    would ship other weights with a matching checksum: `diff`, `diff_counted` and `diff_at` each
    give exactly the positions whose bits differ, their old and new bits, the tensor's size and
    dtype, and the old exponent bytes only where asked (a float dtype), for every length (the
    fast path compares four elements per word, the last one to three apart) and for views whose
    old or new side starts off a word (the element-by-element path; an offset of 5 is off a word
    too).  Kills the mutants of `diff`'s word test, its element-by-element path and the defaults
    (the eleventh pass in docs/RELIABILITY.md)."""
    gen = torch.Generator().manual_seed(7)
    for numel in [1, 2, 3, 4, 5, 7, 8, 9, 13, 64]:
        for at_old, at_new in [(0, 0), (1, 1), (1, 0), (0, 1), (2, 0), (0, 3), (3, 2), (5, 0), (0, 5), (4, 8)]:
            old_bits = torch.randint(-(2**15), 2**15, (numel + at_old,), dtype=torch.int16, generator=gen)[at_old:]
            new_bits = torch.empty(numel + at_new, dtype=torch.int16)[at_new:]
            flip = torch.rand(numel, generator=gen) < 0.4
            new_bits.copy_(torch.where(flip, old_bits ^ 0x0101, old_bits))
            old, new = old_bits.view(dtype), new_bits.view(dtype)
            index = torch.nonzero(flip).squeeze(1)
            count = len(index)
            for exponents in (False, True):
                classes = codec.exponent_bytes(old) if exponents and dtype != torch.int16 else None
                asked = {"exponents": True} if exponents else {}  # without it, the default: none
                for change in (
                    codec.diff(old, new, **asked),
                    codec.diff_counted(old, new, flip, count, **asked),
                    codec.diff_at(old, flip, count, lambda i, bits=new_bits: bits[i], **asked),
                ):
                    case = (numel, at_old, at_new, exponents)
                    assert torch.equal(change.index, index), case
                    assert torch.equal(change.old, old_bits[index]) and torch.equal(change.new, new_bits[index]), case
                    assert (change.numel, change.dtype) == (numel, dtype), case
                    assert (change.exponents is None) == (classes is None), case
                    assert classes is None or torch.equal(change.exponents, classes), case


@pytest.mark.parametrize("compiled", [False, True])
@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(bit_patterns, max_size=300), st.booleans())
def test_a_raw_payload_decodes_bit_exactly_by_either_pass(compiled, dtype, bits, strided):
    """A RAW payload (both value codings: bf16's exponent planes, other dtypes' byte planes), decoded
    by torch's passes and by the compiled one (large CPU tensors), into a fresh tensor or an `out`
    (strided: the compiled pass only; torch's views a float16 `out` as byte pairs), is the tensor it
    was made from."""
    new = as_tensor(bits, dtype)
    payload = codec.encode(None, new)
    out = torch.zeros(2 * len(bits), dtype=dtype)[:: 2 if compiled else 1][: len(bits)] if strided else None
    with mock.patch.object(decoder, "_COMPILED_FROM", 0 if compiled else 1 << 62):
        got = codec.decode(None, payload, numel=len(bits), dtype=dtype, out=out)
    assert bitwise_equal(got, new)
    if strided:
        assert got.data_ptr() == out.data_ptr() and bitwise_equal(out, new)


@pytest.mark.parametrize("compiled", [False, True])
def test_an_out_of_another_shape_is_refused_before_anything_is_written(compiled):
    """The compiled pass writes `out` unchecked: one longer than the payload, or 2-D, is refused
    (review rrd52: it was written past the planes, or one value a row)."""
    payload = codec.encode(None, torch.randn(64).to(torch.bfloat16))
    cpu = torch.device("cpu")
    for out in (torch.zeros(65, dtype=torch.bfloat16), torch.zeros(64, 1, dtype=torch.bfloat16)):
        with (
            mock.patch.object(decoder, "_COMPILED_FROM", 0 if compiled else 1 << 62),
            pytest.raises(ValueError, match=r"^out must have shape \(64,\), got \((65,|64, 1)\)$"),
        ):
            decoder.decode_steps(payload, numel=64, dtype=torch.bfloat16, device=cpu, exponents=None, out=out)
        assert not out.any()
