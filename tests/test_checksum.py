from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_delta.checksum as mod
from lightning_delta.checksum import checksum, checksum_at, checksum_update, format_checksum, parse_checksum

M64 = (1 << 64) - 1
PATHS = ["torch", "compiled"]
"""The two CPU passes: torch's chunks (small tensors, and every GPU tensor) and the compiled one."""


@contextlib.contextmanager
def hashed_by(path: str) -> Iterator[None]:
    """Every CPU checksum in the block through `path`, whatever its size (not a fixture: hypothesis
    runs a test's examples inside one call)."""
    before = mod._COMPILED_FROM
    mod._COMPILED_FROM = 0 if path == "compiled" else 1 << 62
    try:
        yield
    finally:
        mod._COMPILED_FROM = before


def reference(bits: list[int]) -> int:
    """docs/FORMAT.md's definition, in plain Python integers."""

    def signed(x: int) -> int:
        x &= M64
        return x - (1 << 64) if x >> 63 else x

    total = 0
    for i, u in enumerate(bits):
        x = signed(i * 65536 + (u & 0xFFFF))
        x = signed(x * 0x9E3779B97F4A7C15)
        x = signed(x ^ (x >> 32))
        x = signed(x * 0xBF58476D1CE4E5B9)
        x = signed(x ^ (x >> 29))
        total += x
    return total & M64


def int16(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - 65536 if b >= 32768 else b for b in bits], dtype=torch.int16)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), max_size=200))
def test_each_pass_matches_the_reference_definition(path, bits):
    with hashed_by(path):
        assert checksum(int16(bits)) == reference(bits)
        assert checksum(int16([b for b in bits for _ in "ab"])[::2]) == reference(bits)  # a strided view


def test_known_value_pins_the_definition():
    assert format_checksum(checksum(int16([0x3F80, 0x0000, 0xFFFF]))) == format_checksum(reference([0x3F80, 0, 0xFFFF]))
    assert checksum(int16([])) == 0


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=300), st.data())
def test_incremental_update_equals_full_recompute(path, bits, data):
    old = int16(bits)
    new = old.clone()
    idx = sorted(set(data.draw(st.lists(st.integers(0, len(bits) - 1), max_size=len(bits)))))
    new[idx] = int16(data.draw(st.lists(st.integers(0, 0xFFFF), min_size=len(idx), max_size=len(idx))))
    index = torch.tensor(idx, dtype=torch.int64)
    with hashed_by(path):
        assert (
            checksum_update(checksum(old), index, old[index], new[index])
            == checksum(new)
            == reference([b & 0xFFFF for b in new.tolist()])
        )


def test_position_and_value_sensitivity():
    a = int16([1, 2, 3, 4])
    assert checksum(a) != checksum(int16([2, 1, 3, 4]))  # swapped elements
    assert checksum(a) != checksum(int16([1, 2, 3, 5]))  # one bit
    assert checksum(a) != checksum(int16([1, 2, 3]))  # truncated


def test_chunked_sums_match_the_reference(monkeypatch):
    import lightning_delta.checksum as mod

    monkeypatch.setattr(mod, "_CHUNK", 1000)  # ten full chunks and a short one
    bits = torch.randint(-32768, 32767, (10_007,), dtype=torch.int16)
    assert checksum(bits) == reference([b & 0xFFFF for b in bits.tolist()])
    index = torch.arange(3, 10_007, 3)  # 3335 changes: an update spans chunks too
    new = bits.clone()
    new[index] += 1
    assert checksum_update(checksum(bits), index, bits[index], new[index]) == checksum(new)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), max_size=120), st.data())
def test_the_shares_of_a_payloads_pieces_sum_to_its_checksum(path, bits, data):
    """What a payload of several slices (and a worker holding some of its elements) relies on:
    each piece hashed at its offset, or at its positions, adds up to the whole's checksum."""
    cut = data.draw(st.integers(0, len(bits)))
    whole, head, tail = int16(bits), int16(bits[:cut]), int16(bits[cut:])
    with hashed_by(path):
        assert (checksum(head) + checksum(tail, cut)) & M64 == checksum(whole) == reference(bits)
        at = torch.arange(cut, len(bits), dtype=torch.int64)
        assert (checksum(head) + checksum_at(tail, at)) & M64 == checksum(whole)
        assert (checksum(head) + checksum_at(tail.flip(0), at.flip(0))) & M64 == checksum(whole)  # any order


def test_a_large_cpu_tensor_is_hashed_by_the_compiled_pass(monkeypatch):
    """A bf16 parameter (grad on) of the threshold's size goes through the compiled pass, one
    element under it through torch's, and both give the definition's value."""
    calls = []
    kernel = mod._kernel()
    monkeypatch.setattr(mod, "_kernel", lambda: lambda *args: (calls.append(1), kernel(*args))[1])
    n = mod._COMPILED_FROM
    bits = torch.randint(-32768, 32767, (n,), dtype=torch.int16)
    param = torch.nn.Parameter(bits.view(torch.bfloat16).clone())
    expected = reference([b & 0xFFFF for b in bits.tolist()])
    assert checksum(param.view(-1)) == expected and calls == [1]
    assert checksum(bits[1:], 1) == (expected - reference([bits[0].item() & 0xFFFF])) & M64 and calls == [1]


def test_only_1d_16_bit_tensors_are_hashed():
    for bad in [torch.zeros(2, 3, dtype=torch.int16), torch.zeros(4, dtype=torch.int32)]:
        with pytest.raises(ValueError, match=r"expected a 1-D 16-bit tensor, got torch\.int(16|32) of shape \(\d"):
            checksum(bad)


def test_hex_spelling_round_trips():
    assert parse_checksum(format_checksum(2**64 - 1)) == 2**64 - 1
    for bad in ["", "1234", "0123456789ABCDEF", "0123456789abcdeg", "XX0123456789abcd"]:
        with pytest.raises(ValueError, match="not a 16-digit hex checksum"):
            parse_checksum(bad)


@pytest.mark.parametrize("path", PATHS)
def test_positions_of_any_integer_dtype_key_the_definition_and_a_short_index_is_refused(path):
    """Keys are int64 whatever the index's dtype (an int32 index once wrapped i * 2**16 past
    32,767); an index of another length than the values, or positions past 2**47, are refused
    (the compiled pass would read past the index, or wrap)."""
    bits = torch.randint(-32768, 32767, (40_000,), dtype=torch.int16)
    expected = reference([b & 0xFFFF for b in bits.tolist()])
    with hashed_by(path):
        assert checksum_at(bits, torch.arange(40_000, dtype=torch.int32)) == expected
        new = bits.clone()
        new[39_999] += 1
        at = torch.tensor([39_999], dtype=torch.int32)
        assert checksum_update(expected, at, bits[at.long()], new[at.long()]) == checksum(new)
        with pytest.raises(
            ValueError, match=r"^40000 elements need 40000 positions, got an index of shape \(39999,\)$"
        ):
            checksum_at(bits, torch.arange(39_999))
        with pytest.raises(ValueError, match=r"outside the checksum's 0\.\.2\*\*47"):
            checksum(bits, (1 << 47) - 40_000)
        last = checksum(bits[:1], (1 << 47) - 2)  # the last position there is
    with hashed_by("torch" if path == "compiled" else "compiled"):
        assert checksum(bits[:1], (1 << 47) - 2) == last
