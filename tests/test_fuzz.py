"""A bounded, seeded slice of `scripts/fuzz.py` (docs/RELIABILITY.md has the long runs)."""

from __future__ import annotations

import pytest

import fuzz
from lightning_delta import FormatError


def test_codec_payloads_never_decode_wrong_escape_bomb_or_hang():
    counts = fuzz.fuzz_codec(20_000, seed=1)
    assert not any(counts[f] for f in fuzz.FAILURES), counts
    assert counts["refused"] > 10_000 and counts["caught"] > 0 and counts["exact"] > 0, counts


def test_damaged_stores_give_exact_weights_or_a_delta_error():
    counts = fuzz.fuzz_store(200, seed=1)
    assert not any(counts[f] for f in fuzz.FAILURES), counts
    assert counts["refused"] > 50 and counts["exact"] > 50, counts


def _raise(error: BaseException):
    raise error


@pytest.mark.parametrize(
    "run, outcome",
    [
        (lambda: _raise(FormatError("x")), "refused"),
        (lambda: _raise(KeyError("x")), "other"),
        (lambda: _raise(MemoryError()), "other"),
        (lambda: bytearray(256 << 20) and "exact", "bomb"),
        (lambda: fuzz.time.sleep(5) or "exact", "hang"),
        (lambda: "wrong", "wrong"),
    ],
)
def test_the_judge_tells_every_outcome_apart(run, outcome):
    """The slice above can only fail if the harness sees failures: each kind, on purpose."""
    limit = 0.5 if outcome == "hang" else 600  # a 5 s sleep passes 0.5 s however busy the machine
    assert fuzz._judge(run, expected_bytes=1 << 20, limit=limit)[0] == outcome
