from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lightning_delta.errors import FormatError
from lightning_delta.shards import assemble, clean_name, named_tensors, plan, split_replicated


@given(st.lists(st.integers(0, 50), max_size=12), st.integers(1, 5))
def test_replicated_split_is_a_disjoint_exact_cover(numels, world):
    seen = [[0] * n for n in numels]
    shares = []
    for rank in range(world):
        pieces = split_replicated(numels, world, rank)
        shares.append(sum(n for _, _, n in pieces))
        for i, start, n in pieces:
            for k in range(start, start + n):
                seen[i][k] += 1
    assert all(c == 1 for row in seen for c in row)  # every element exactly once
    assert max(shares) - min(shares) <= 1  # balanced to one element
    listed = {i for r in range(world) for i, _, _ in split_replicated(numels, world, r)}
    assert listed == set(range(len(numels)))  # even empty tensors are listed


def test_plan_and_assemble_round_trip_over_ranks():
    tensors = {"a": torch.arange(10.0), "b": torch.arange(7.0).view(7, 1), "c": torch.zeros(0)}
    pieces: dict[str, list] = {}
    for rank in range(3):
        for s in plan(tensors, rank, 3):
            flat = tensors[s.name].reshape(-1)[s.local_start : s.local_start + s.numel]
            pieces.setdefault(s.name, []).append((s.start, flat))
    for name, t in tensors.items():
        assert torch.equal(assemble(name, tuple(t.shape), t.dtype, pieces[name]), t)


def test_assemble_refuses_gaps_overlaps_and_short_covers():
    t = torch.arange(6.0)
    with pytest.raises(FormatError, match="gap or overlap"):
        assemble("x", (6,), t.dtype, [(0, t[:3]), (2, t[2:])])
    with pytest.raises(FormatError, match="cover"):
        assemble("x", (6,), t.dtype, [(0, t[:3])])


def test_names_drop_wrapper_segments_and_keep_persistent_float_buffers():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("kept", torch.ones(2))
            self.register_buffer("dropped", torch.ones(2), persistent=False)
            self.register_buffer("count", torch.zeros(1, dtype=torch.long))

    compiled = nn.Module()
    compiled._orig_mod = M()
    assert set(named_tensors(compiled)) == {"lin.weight", "lin.bias", "kept"}
    assert clean_name("a._checkpoint_wrapped_module.b._fsdp_wrapped_module.c") == "a.b.c"
    ddp_like = M()
    assert set(named_tensors(ddp_like)) == {"lin.weight", "lin.bias", "kept"}


def test_tied_weights_are_published_once():
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert list(named_tensors(model)) == ["emb.weight"]
