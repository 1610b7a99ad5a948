"""The CPU's one-pass walk of a SPARSE payload (`sparse_walk`), against torch's decoder: the same
changes land where the segment table says, the owned ones hash to the checksum's move, `check`
writes nothing, `undo` restores every bit, and a hostile payload is refused exactly when torch
refuses it, with what was written before the refusal taken back."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_delta import codec, elias_fano, sparse_walk, wire
from lightning_delta.checksum import checksum_update
from lightning_delta.codec import CodecOptions, Compressor, Mode
from lightning_delta.errors import FormatError

MASK64 = (1 << 64) - 1
UNCOMPRESSED = CodecOptions(Compressor.NONE)


def bits(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - 65536 if v >= 32768 else v for v in values], dtype=torch.int16)


@st.composite
def walks(draw):
    """A 2-D tensor's change (coded SPARSE), and a segment table over it: payload ranges held as
    runs of a parameter, as row-and-column blocks of one (the tensor-parallel slices of a
    row-parallel layer), or not at all; some owned."""
    rows, columns = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    n = rows * columns
    old = draw(st.lists(st.integers(0, 0xFFFF), min_size=n, max_size=n))
    density = draw(st.sampled_from([0.002, 0.02, 0.1, 0.3]))
    steps = draw(st.sampled_from([[1, -1], [1, -1, 2, -7, 300, 32767, -32768]]))
    new = [(v + draw(st.sampled_from(steps))) % 65536 if draw(st.floats(0, 1)) < density else v for v in old]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=5))) - {n})
    segments, sizes = [], [0, 0]
    for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
        kind, owned = draw(st.sampled_from(["run", "block", "gap"])), int(draw(st.booleans()))
        param = draw(st.integers(0, 1))
        if kind == "run":
            base = sizes[param] + draw(st.integers(0, 3))
            segments.append([lo, hi, param, base, 0, 0, 0, 0, 0, 0, 0, owned])
            sizes[param] = base + hi - lo
        elif kind == "block":
            column = draw(st.integers(0, columns - 1))
            width = draw(st.integers(1, columns - column))
            stride = width + draw(st.integers(0, 2))
            row = lo // columns
            held = (hi - 1) // columns - row + 1
            base = sizes[param]
            segments.append([lo, hi, param, base, lo, columns, row, held, column, width, stride, owned])
            sizes[param] = base + held * stride
    table = np.array(segments, dtype=np.int64).reshape(-1, len(sparse_walk.SEGMENT_FIELDS))
    return bits(old), bits(new), table, sizes


def place(table: np.ndarray, p: int) -> tuple[int, int, bool] | None:
    """(param, element, owned) holding payload position `p`, straight from the table's definition."""
    for lo, hi, param, base, first, columns, row, rows, column, width, stride, owned in table.tolist():
        if lo <= p < hi:
            if columns == 0:
                return param, base + p - lo, bool(owned)
            r, c = divmod(first + p - lo, columns)
            if row <= r < row + rows and column <= c < column + width:
                return param, base + (r - row) * stride + c - column, bool(owned)
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks(), st.integers(0, 2**16))
def test_a_walk_writes_the_change_where_the_table_says_and_undo_takes_it_back(case, seed):
    old, new, table, sizes = case
    packed = codec.parse(codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16)), old.numel())
    if packed.mode != Mode.SPARSE:
        return  # coded whole: not walked
    g = torch.Generator().manual_seed(seed)
    params = [torch.randint(-32768, 32768, (size,), generator=g, dtype=torch.int16) for size in sizes]
    expected = [p.clone() for p in params]
    index = (old != new).nonzero().view(-1)
    owned = []
    for p in index.tolist():
        held = place(table, p)
        if held is not None:
            param, at, mine = held
            expected[param][at] = expected[param][at] + (new[p] - old[p])  # int16 wraps, as a step does
            if mine:
                owned.append(p)
    mine = torch.tensor(owned, dtype=torch.int64)
    olds = torch.stack([params[place(table, p)[0]][place(table, p)[1]] for p in owned]) if owned else old[:0]
    moved = checksum_update(0, mine, olds, olds + (new[mine] - old[mine])) if owned else 0

    before = [p.clone() for p in params]
    walk = sparse_walk.Walk(packed, sparse_walk.Segments(table, packed.n), [p.numpy() for p in params])
    assert walk.check() == moved
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))  # a check writes nothing
    assert walk.apply() == moved
    assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))
    walk.undo()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


@st.composite
def hostile(draw):
    """A SPARSE payload whose sections are random bytes (the sizes its header implies), or a real
    one with bytes of its sections flipped."""
    n = draw(st.integers(1, 2000))
    if draw(st.booleans()):
        m = draw(st.integers(1, n))
        k = draw(st.integers(0, m))
        low_bits = elias_fano.low_bits(n, m)
        sizes = wire._section_sizes(Mode.SPARSE, n, m, k, low_bits, ())
        sections = tuple(torch.tensor(list(draw(st.binary(min_size=s, max_size=s))), dtype=torch.uint8) for s in sizes)
        return codec.Packed(Mode.SPARSE, codec.ValueCoding.SPLIT, low_bits, torch.bfloat16, n, m, k, sections)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    old = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int16)
    new = old.clone()
    new[torch.rand(n, generator=g) < draw(st.sampled_from([0.01, 0.05, 0.2]))] += draw(st.sampled_from([1, -1, 5]))
    packed = codec.parse(codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16)), n)
    if packed.mode != Mode.SPARSE:
        return packed
    sections = [s.clone() for s in packed.sections]
    for _ in range(draw(st.integers(1, 4))):
        which = draw(st.integers(0, len(sections) - 1))
        if sections[which].numel():
            sections[which][draw(st.integers(0, sections[which].numel() - 1))] ^= draw(st.integers(1, 255))
    return codec.Packed(
        packed.mode, packed.values, packed.low_bits, packed.dtype, n, packed.m, packed.k, tuple(sections)
    )


WALK_REFUSALS = "^(" + "|".join(re.escape(m) for m in sparse_walk.MESSAGES.values()) + ")$"


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile())
def test_a_hostile_payload_is_refused_where_torch_refuses_it_and_leaves_nothing_written(packed):
    if packed.mode != Mode.SPARSE:
        return
    payload = codec.serialize(packed, UNCOMPRESSED)
    try:
        steps = codec.decode_steps(
            payload, numel=packed.n, dtype=torch.bfloat16, device=torch.device("cpu"), exponents=None
        )
    except FormatError:
        steps = None
    held = torch.randint(-32768, 32768, (packed.n,), dtype=torch.int16)
    before = held.clone()
    whole = np.array([[0, packed.n, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)
    walk = sparse_walk.Walk(codec.parse(payload, packed.n), sparse_walk.Segments(whole, packed.n), [held.numpy()])
    if steps is None:
        with pytest.raises(FormatError, match=WALK_REFUSALS):  # one of the walk's own messages, whole
            walk.apply()
        walk.undo()
        assert torch.equal(held, before)
    else:
        walk.apply()
        assert steps.index is not None and steps.step is not None
        before[steps.index] += steps.step
        assert torch.equal(held, before)


def test_a_segment_table_that_names_elements_outside_its_parameters_is_refused():
    """Each refusal says why, in its own words (#39: a message dropped survived)."""
    packed = codec.parse(
        codec.encode(bits([0] * 64).view(torch.bfloat16), bits([1] + [0] * 63).view(torch.bfloat16)), 64
    )
    param = np.zeros(64, dtype=np.int16)
    run = [0, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    outside = "segment (0, 64) names elements outside parameter 0"
    names, past = "the segment table names {} elements of its parameters, which hold [64]", "segment ({}, {}) overlaps"
    past += " another or runs past the payload's 64 positions"
    for bad, said in (
        ([[0, 64, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1]], names.format([65])),
        (
            [[0, 40, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], [30, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]],
            past.format(30, 64),
        ),
        ([[0, 65, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], past.format(0, 65)),
        ([[0, 64, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1]], names.format([0, 64])),
        ([[0, 64, 0, 0, 0, 8, 0, 8, 4, 8, 8, 1]], outside),  # columns 4..11 of 8
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
            sparse_walk.Walk(packed, sparse_walk.Segments(np.array(bad, dtype=np.int64), 64), [param])
    for rows in (np.array([run], dtype=np.int32), np.array(run, dtype=np.int64), np.array([run[:-1]], dtype=np.int64)):
        said = f"a segment table is int64 of 12 columns, got {rows.dtype} {rows.shape}"
        with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
            sparse_walk.Segments(rows, 64)
    with pytest.raises(ValueError, match=r"^the segment table is for payloads of 65 positions, not 64$"):
        sparse_walk.Walk(packed, sparse_walk.Segments(np.array([run], dtype=np.int64), 65), [param])
    sparse_walk.Walk(packed, sparse_walk.Segments(np.array([run], dtype=np.int64), 64), [param]).apply()
    assert param[0] == 1 and not param[1:].any()


def test_a_segment_table_is_checked_at_its_bounds():
    """Each check of a segment table at its edge: the last element a segment may name is taken (and
    counted in `needs`, the elements each parameter must hold), the next one refused."""
    outside = "segment ({}, {}) names elements outside parameter {}"

    def needs(*rows: list[int]) -> list[int]:
        return sparse_walk.Segments(np.array(rows, dtype=np.int64).reshape(-1, 12), 64).needs

    def refused(said: str, *rows: list[int]) -> None:
        with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
            needs(*rows)

    assert needs() == []
    assert needs([0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], [32, 64, 1, 3, 0, 0, 0, 0, 0, 0, 0, 0]) == [32, 35]
    assert needs([10, 20, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1]) == [0, 10]
    # a block: rows 1..2 of an 8-column tensor's columns 5..7, at a stride of 4 from element 2
    assert needs([8, 24, 0, 2, 8, 8, 1, 2, 5, 3, 4, 1]) == [2 + 4 + 3]
    assert needs([8, 24, 0, 0, 8, 8, 1, 2, 0, 8, 8, 1]) == [16]  # every column, width = stride
    assert needs([0, 1, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1]) == [1]
    assert needs([0, 10, 0, 20, 0, 0, 0, 0, 0, 0, 0, 1], [10, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]) == [30]  # the largest
    assert needs([8, 24, 0, 0, 8, 8, 1, 0, 0, 8, 8, 1]) == [0]  # a block of no rows names nothing
    refused(outside.format(5, 5, 0), [5, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])
    refused("segment (-1, 5) overlaps another or runs past the payload's 64 positions", [-1, 5, *[0] * 9, 1])
    refused(outside.format(0, 5, -1), [0, 5, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1])
    refused(outside.format(0, 5, 0), [0, 5, 0, -1, 0, 0, 0, 0, 0, 0, 0, 1])
    for first, column, width, stride in ((-1, 0, 8, 8), (0, -1, 8, 8), (0, 1, 8, 8), (0, 0, 0, 8), (0, 0, 8, 7)):
        refused(outside.format(8, 24, 0), [8, 24, 0, 0, first, 8, 1, 2, column, width, stride, 1])


def test_a_walk_says_what_it_wrote_and_undoes_only_that():
    """`wrote` names the parameters the last `apply` wrote into (not `check`'s, not an unheld
    parameter's); `undo` before any `apply` writes nothing; `check` refuses a malformed payload as
    `apply` does, writing nothing; a table that holds nothing walks with no parameters; a payload of
    another mode is refused."""
    old = bits(list(range(64)))
    new = old.clone()
    new[[3, 5]] += 1
    packed = codec.parse(codec.encode(old.view(torch.bfloat16), new.view(torch.bfloat16)), 64)
    assert packed.mode == Mode.SPARSE
    table = np.array([[0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], [32, 64, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)
    params = [old[:32].numpy().copy(), old[32:].numpy().copy()]
    walk = sparse_walk.Walk(packed, sparse_walk.Segments(table, 64), params)
    walk.undo()
    assert walk.applied == 0 and np.array_equal(np.concatenate(params), old.numpy())
    walk.check()
    assert not walk.wrote(0) and not walk.wrote(1)
    walk.apply()
    assert walk.applied == 2 and walk.wrote(0) and not walk.wrote(1)
    assert np.array_equal(np.concatenate(params), new.numpy())
    walk.undo()
    assert walk.applied == 0 and np.array_equal(np.concatenate(params), old.numpy())
    high = tuple(torch.zeros_like(s) if i == 1 else s for i, s in enumerate(packed.sections))  # no high bits
    short = codec.Packed(packed.mode, packed.values, packed.low_bits, packed.dtype, 64, packed.m, packed.k, high)
    with pytest.raises(FormatError, match=f"^{sparse_walk.MESSAGES[sparse_walk.Status.SHORT]}$"):
        sparse_walk.Walk(short, sparse_walk.Segments(table, 64), params).check()
    assert np.array_equal(np.concatenate(params), old.numpy())
    nothing = sparse_walk.Walk(packed, sparse_walk.Segments(np.empty((0, 12), dtype=np.int64), 64), [])
    assert nothing.check() == nothing.apply() == 0 and nothing.applied == 2  # decoded, held by no one here
    raw = codec.parse(codec.encode(None, new.view(torch.bfloat16)), 64)
    with pytest.raises(ValueError, match=f"^only SPARSE payloads are walked, not {raw.mode.name}$"):
        sparse_walk.Walk(raw, sparse_walk.Segments(table, 64), params)


def test_compile_compiles_the_kernel_the_walks_call():
    """`compile` (called as a follower starts) compiles the one kernel every walk's apply, check and
    undo then calls, so a step never compiles it (#39: an empty float64 parameter compiled another)."""
    sparse_walk.compile()
    old = torch.randn(1000).to(torch.bfloat16)
    new = old.clone()
    new.view(torch.int16)[::50] += 1
    packed = codec.parse(codec.encode(old, new), 1000)
    assert packed.mode == Mode.SPARSE
    table = np.array([[0, 1000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=np.int64)
    walk = sparse_walk.Walk(packed, sparse_walk.Segments(table, 1000), [old.view(torch.int16).numpy().copy()])
    walk.check()
    walk.apply()
    walk.undo()
    assert len(sparse_walk._kernel().signatures) == 1
