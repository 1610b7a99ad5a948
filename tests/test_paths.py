"""Path planning as pure functions: the cheapest parts to fetch, from markers alone."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_delta import ChainError
from lightning_delta.format import Kind
from lightning_delta.paths import PartRef, cheapest_path

BASE, DELTA = 680, 20  # bytes, about a base and a delta of the realistic sequence, per 1000 dense


def chain(steps: int, base_every: int, bridges: bool = True, missing: set[int] = frozenset()):
    """parts_at for one rank's chain published with the library's schedule."""
    parts: dict[int, list[PartRef]] = {}
    for step in range(1, steps + 1):
        if step in missing:
            continue
        if (step - 1) % base_every == 0:
            parts[step] = [PartRef(step, Kind.BASE, None, BASE)]
            if bridges and step > 1:
                parts[step].append(PartRef(step, Kind.DELTA, step - 1, DELTA, bridge=True))
        else:
            parts[step] = [PartRef(step, Kind.DELTA, step - 1, DELTA)]
    return lambda step: parts.get(step, [])


def steps_of(path: list[PartRef]) -> list[tuple[int, str]]:
    return [(p.step, "bridge" if p.bridge else p.kind.value) for p in path]


def test_an_in_sync_follower_takes_the_bridge_never_the_base():
    parts = chain(60, 25)
    assert steps_of(cheapest_path(26, 25, parts)) == [(26, "bridge")]
    assert steps_of(cheapest_path(27, 25, parts)) == [(27, "delta"), (26, "bridge")]
    assert cheapest_path(26, 26, parts) == []


def test_a_late_joiner_reads_the_newest_base_and_the_deltas_after_it():
    parts = chain(60, 25)
    assert steps_of(cheapest_path(28, None, parts)) == [(28, "delta"), (27, "delta"), (26, "base")]
    assert steps_of(cheapest_path(26, None, parts)) == [(26, "base")]


def test_a_far_behind_follower_takes_the_cheaper_of_deltas_and_a_base():
    parts = chain(60, 25)
    near = cheapest_path(30, 20, parts)  # 10 deltas (200) beat a base and 4 deltas (760)
    assert [p.step for p in near] == list(range(30, 20, -1)) and near[-1].bridge is False
    far = cheapest_path(59, 2, parts)  # 57 deltas (1140) lose to base 51 and 8 deltas (840)
    assert steps_of(far)[-1] == (51, "base") and len(far) == 9


def test_a_hole_is_crossed_through_a_base():
    parts = chain(60, 25, missing={24})  # a delta lost before the base at 26
    assert steps_of(cheapest_path(30, 20, parts)) == [
        (30, "delta"),
        (29, "delta"),
        (28, "delta"),
        (27, "delta"),
        (26, "base"),
    ]
    with pytest.raises(ChainError, match="step 29 is a delta against step 28"):  # no base after the hole
        cheapest_path(30, 20, chain(60, 25, missing={28}))


def test_without_bridges_a_base_step_is_read_whole():
    parts = chain(60, 25, bridges=False)
    assert steps_of(cheapest_path(26, 25, parts)) == [(26, "base")]


@st.composite
def chains(draw):
    """A rank's chain with arbitrary bases, bridges, sizes, skipped steps and holes."""
    n = draw(st.integers(1, 40))
    published = sorted(draw(st.sets(st.integers(1, 60), min_size=n, max_size=n)))
    parts: dict[int, list[PartRef]] = {}
    previous = None
    for step in published:
        size = draw(st.integers(1, 1000))
        if previous is None or draw(st.booleans()):
            parts[step] = [PartRef(step, Kind.BASE, None, size)]
            if previous is not None and draw(st.booleans()):
                parts[step].append(PartRef(step, Kind.DELTA, previous, draw(st.integers(1, 1000)), bridge=True))
        else:
            parts[step] = [PartRef(step, Kind.DELTA, previous, size)]
        previous = step
    holes = draw(st.sets(st.sampled_from(published)))
    for step in holes:
        del parts[step]
    target = draw(st.sampled_from(published))
    held = draw(st.none() | st.sampled_from(published))
    return parts, target, held


@settings(max_examples=500, deadline=None)
@given(chains())
def test_the_path_is_valid_and_no_dearer_than_any_path_the_rule_allows(case):
    parts, target, held = case
    parts_at = lambda step: parts.get(step, [])  # noqa: E731
    # Every path the rule allows: from `held`, or from a base on the line of deltas back from
    # `target` (for a reader that holds nothing on that line, only the newest such base).
    allowed, cost, at, passed = [], 0, target, held is None
    while True:
        if at == held:
            allowed.append(cost)
            break
        found = parts_at(at)
        base = [p for p in found if p.kind == Kind.BASE]
        delta = [p for p in found if p.kind == Kind.DELTA]
        passed = passed or (held is not None and at < held)
        if base:
            allowed.append(cost + base[0].size)
            if passed:
                break
        if not delta:
            break
        cost, at = cost + delta[0].size, delta[0].prev_step
    try:
        path = cheapest_path(target, held, parts_at)
    except ChainError:
        assert not allowed
        return
    assert allowed and sum(p.size for p in path) == min(allowed)
    at = target
    for i, part in enumerate(path):  # linked newest first, ending at a base or at what is held
        assert part.step == at and part in parts_at(at)
        if part.kind == Kind.BASE:
            assert i == len(path) - 1
        at = part.prev_step
    assert not path or path[-1].kind == Kind.BASE or at == held
