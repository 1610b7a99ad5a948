"""The CPU's one-pass walk of a RAW payload (`whole_walk`), against torch's decoder and checksum:
every element lands where the segment table says and nowhere else, and the owned ones hash to
their share of the payload's checksum (so the shares of a group's workers sum to the checksum)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_delta import codec, sparse_walk, whole_walk
from lightning_delta.checksum import checksum, checksum_at
from lightning_delta.codec import CodecOptions, Compressor, Mode
from test_sparse_walk import place, walks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks(), st.sampled_from([torch.bfloat16, torch.float16]), st.booleans(), st.integers(0, 2**16))
def test_a_whole_walk_writes_every_held_element_where_the_table_says_and_hashes_the_owned(case, dtype, squeezed, seed):
    _, new, table, sizes = case
    options = CodecOptions() if squeezed else CodecOptions(Compressor.NONE)
    packed = codec.parse(codec.serialize(codec.pack_full(new.view(dtype)), options), new.numel())
    assert packed.mode == Mode.RAW
    g = torch.Generator().manual_seed(seed)
    params = [torch.randint(-32768, 32768, (size,), generator=g, dtype=torch.int16) for size in sizes]
    expected = [p.clone() for p in params]
    owned = []
    for p in range(new.numel()):
        held = place(table, p)
        if held is not None:
            param, at, mine = held
            expected[param][at] = new[p]
            if mine:
                owned.append(p)
    index = torch.tensor(owned, dtype=torch.int64)
    share = checksum_at(new[index], index) if owned else 0

    walk = whole_walk.WholeWalk(packed, sparse_walk.Segments(table, packed.n), [p.numpy() for p in params])
    assert walk.apply() == share
    assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))


def test_the_shares_of_disjoint_owners_sum_to_the_payloads_checksum():
    """Two workers holding the two column halves of a row-parallel layer, each owning its own."""
    rows, columns = 64, 48
    new = torch.randn(rows, columns).to(torch.bfloat16).view(-1)
    packed = codec.parse(codec.encode(None, new), new.numel())
    total = 0
    for half in range(2):
        column, width = half * columns // 2, columns // 2
        table = np.array([[0, new.numel(), 0, 0, 0, columns, 0, rows, column, width, width, 1]], dtype=np.int64)
        out = np.zeros(rows * width, dtype=np.int16)
        total += whole_walk.WholeWalk(packed, sparse_walk.Segments(table, packed.n), [out]).apply()
        assert torch.equal(
            torch.from_numpy(out).view(rows, width),
            new.view(torch.int16).view(rows, columns)[:, column : column + width],
        )
    assert total % 2**64 == checksum(new.view(torch.int16))


def test_only_a_raw_payload_is_walked_whole():
    old = torch.randn(1000).to(torch.bfloat16)
    new = old.clone()
    new.view(torch.int16)[::50] += 1
    packed = codec.parse(codec.encode(old, new), 1000)
    table = np.array([[0, 1000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)
    with pytest.raises(ValueError, match="only RAW"):
        whole_walk.WholeWalk(packed, sparse_walk.Segments(table, 1000), [np.zeros(1000, dtype=np.int16)])


def _peer_walked(case, seed: int):
    """A RAW payload of `case`'s tensor, a peer's table over it, the peer's parameters walked by it
    (random, from `seed`), an untouched copy of them to scatter into, and the walk's hash share."""
    _, new, table, sizes = case
    packed = codec.parse(codec.serialize(codec.pack_full(new.view(torch.bfloat16))), new.numel())
    g = torch.Generator().manual_seed(seed)
    params = [torch.randint(-32768, 32768, (size,), generator=g, dtype=torch.int16) for size in sizes]
    walked, scattered = [p.clone().numpy() for p in params], [p.clone().numpy() for p in params]
    peer = sparse_walk.Segments(table, packed.n)
    return packed, peer, walked, scattered, whole_walk.WholeWalk(packed, peer, walked).apply()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks(), walks(), st.integers(0, 2**16))
def test_elements_gathered_for_a_peer_and_scattered_there_write_and_hash_as_its_own_walk(case, other, seed):
    """The reader of a part walks its own table and gathers a peer's (any table over the payload);
    the peer's scatter writes its parameters and hashes its owned share as its own walk would."""
    packed, peer, walked, scattered, share = _peer_walked(case, seed)

    _, _, own, own_sizes = other  # the reader's own table: of another tensor's shape, cut to this payload
    own = own[own[:, 1] <= packed.n] if own.size else own
    reader = whole_walk.WholeWalk(
        packed, sparse_walk.Segments(own, packed.n), [np.zeros(s, dtype=np.int16) for s in own_sizes]
    )
    sent = reader.gather(peer)
    assert len(sent) == whole_walk.count(peer)
    assert whole_walk.Scattered(sent, peer, scattered).apply() == share
    assert all(np.array_equal(a, b) for a, b in zip(walked, scattered, strict=True))


def test_a_peer_table_over_another_payload_size_is_refused_before_a_gather():
    packed = codec.parse(codec.encode(None, torch.randn(10).to(torch.bfloat16)), 10)
    table = np.array([[0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)
    walk = whole_walk.WholeWalk(packed, sparse_walk.Segments(table, 10), [np.zeros(10, dtype=np.int16)])
    other = sparse_walk.Segments(np.array([[0, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 11)
    with pytest.raises(ValueError, match=r"^the segment table is for payloads of 11 positions, not 10$"):
        walk.gather(other)


def test_elements_of_another_count_are_refused():
    table = np.array([[0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)
    segments = sparse_walk.Segments(table, 10)
    with pytest.raises(ValueError, match="9 int16 elements sent, the segment table holds 10"):
        whole_walk.Scattered(np.zeros(9, dtype=np.int16), segments, [np.zeros(10, dtype=np.int16)])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks(), st.integers(1, 40), st.integers(0, 2**16))
def test_elements_sent_in_pieces_write_and_hash_as_the_whole_transfer(case, piece, seed):
    """A transfer cut into pieces of any size (`scatter`'s bounded buffers): each piece gathered at
    the reader and written at its receiver alone; the pieces' shares sum to the whole walk's, and
    every element lands as the whole walk puts it."""
    packed, peer, walked, scattered, share = _peer_walked(case, seed)

    reader = whole_walk.WholeWalk(packed, sparse_walk.Segments(np.empty((0, 12), dtype=np.int64), packed.n), [])
    held, total = whole_walk.count(peer), 0
    for start in range(0, held, piece):
        out = reader.gather(peer, start, np.empty(min(piece, held - start), dtype=np.int16))
        assert np.array_equal(out, reader.gather(peer)[start : start + piece])
        total += whole_walk.Scattered(out, peer, scattered, start).apply()
    assert total % 2**64 == share
    assert all(np.array_equal(a, b) for a, b in zip(walked, scattered, strict=True))


def test_a_piece_past_the_tables_elements_is_refused():
    table = np.array([[0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)
    segments = sparse_walk.Segments(table, 10)
    with pytest.raises(ValueError, match="4 int16 elements sent from the 7-th, the segment table holds 10"):
        whole_walk.Scattered(np.zeros(4, dtype=np.int16), segments, [np.zeros(10, dtype=np.int16)], 7)
    whole_walk.Scattered(np.zeros(3, dtype=np.int16), segments, [np.zeros(10, dtype=np.int16)], 7)  # the last piece


def test_a_gather_from_the_start_th_without_a_buffer_is_the_rest_of_the_whole_gather():
    """`gather(segments, start)` with no `out` returns the elements from the `start`-th on, as many
    as are left (#39: a buffer of `count + start` elements survived)."""
    packed = codec.parse(codec.encode(None, torch.randn(10).to(torch.bfloat16)), 10)
    segments = sparse_walk.Segments(np.array([[0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 10)
    walk = whole_walk.WholeWalk(packed, segments, [np.zeros(10, dtype=np.int16)])
    assert np.array_equal(walk.gather(segments, 3), walk.gather(segments)[3:])


def test_elements_of_another_type_are_refused():
    """Only int16 elements are written: a buffer of another type, of the right count, is refused (#39:
    with the type check joined to the piece's bounds by `and`, it was written)."""
    segments = sparse_walk.Segments(np.array([[0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 10)
    with pytest.raises(ValueError, match=r"^10 int32 elements sent, the segment table holds 10$"):
        whole_walk.Scattered(np.zeros(10, dtype=np.int32), segments, [np.zeros(10, dtype=np.int16)])


def test_compile_compiles_the_kernel_the_walks_call():
    """`compile` (called as a follower starts) compiles the one kernel every walk, gather, scatter
    and count then calls, so a base step never compiles it (#39: arguments of another type compiled
    a second one, and the walks' own in the first base step)."""
    whole_walk.compile()
    packed = codec.parse(codec.encode(None, torch.randn(10).to(torch.bfloat16)), 10)
    segments = sparse_walk.Segments(np.array([[0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 10)
    params = [np.zeros(10, dtype=np.int16)]
    walk = whole_walk.WholeWalk(packed, segments, params)
    walk.apply()
    whole_walk.Scattered(walk.gather(segments), segments, params).apply()
    assert len(whole_walk._kernel().signatures) == 1


def test_a_walk_refuses_a_table_or_planes_of_another_payload_size():
    """A walk trusts its table and planes: a table for payloads of another size, or planes shorter
    than the payload (`codec.parse` sizes them: a guard against a change there), are refused before
    any element is read (#39: without the size given to `check_fits`, a table of 11 positions read
    a 10-element payload's planes past their end)."""
    packed = codec.parse(codec.encode(None, torch.randn(10).to(torch.bfloat16)), 10)
    longer = sparse_walk.Segments(np.array([[0, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 11)
    with pytest.raises(ValueError, match=r"^the segment table is for payloads of 11 positions, not 10$"):
        whole_walk.WholeWalk(packed, longer, [np.zeros(11, dtype=np.int16)])
    segments = sparse_walk.Segments(np.array([[0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64), 10)
    first, second = packed.sections
    for cut in [(first[:9], second), (first, second[:9])]:
        said = rf"^a RAW payload of 10 elements has planes of {len(cut[0])} and {len(cut[1])}$"
        with pytest.raises(ValueError, match=said):
            whole_walk.WholeWalk(dataclasses.replace(packed, sections=cut), segments, [np.zeros(10, dtype=np.int16)])
