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


def test_damaged_signed_stores_with_their_key_give_exact_weights_or_a_delta_error():
    """Signed chains loaded with the trainer's key, under the same damage plus signature-field
    mutations: never a step that is not the trainer's."""
    counts = fuzz.fuzz_store(120, seed=2, signed=True)
    assert not any(counts[f] for f in fuzz.FAILURES), counts
    assert counts["refused"] > 30 and counts["exact"] > 30, counts


def test_a_mirror_restarted_on_its_damaged_copy_writes_and_serves_only_the_trainers_steps():
    """#39: a restarted mirror reads its own destination (its newest base's markers, `cutoff`, and
    the manifest); damaged there, it writes only the trainer's objects, completes no step without
    the one before it, and every step it lists loads exactly or raises a `DeltaError`."""
    counts = fuzz.fuzz_mirror(14, seed=2)
    assert not any(counts[f] for f in fuzz.FAILURES), counts
    assert counts["refused"] > 4 and counts["exact"] > 2 and counts["held"] > 0, counts


def test_the_signature_mutator_is_refused_with_keys(tmp_path):
    """Each signature-field mutation of a signed chain is refused by a trusting loader (or leaves
    the object as it was: a donor's signature may be the victim's own)."""
    import random
    from pathlib import Path

    from lightning_delta import DeltaError, DeltaLoader, LoaderSettings
    from lightning_delta.signing import keygen

    keygen(tmp_path / "key")
    pristine = tmp_path / "pristine"
    truth = fuzz.build_chain(str(pristine), 0, str(tmp_path / "key"))
    rng, refused = random.Random(3), 0
    for trial in range(40):
        root = tmp_path / f"t{trial}"
        fuzz.shutil.copytree(pristine, root)
        markers = [p for p in fuzz._objects(root) if p.name.endswith(".commit") and "000000000008" in str(p)]
        markers += [root / "run.json"]
        before = {p: p.read_bytes() for p in markers}
        fuzz.mutate_signature(rng, markers)
        changed = [p for p in markers if p.read_bytes() != before[p]]
        loader = DeltaLoader(str(root), LoaderSettings(trusted_keys=(str(Path(tmp_path, "key.pub")),)))
        try:
            _, state = loader.state_dict(8)
        except DeltaError:
            refused += 1
            continue
        assert not changed, changed  # a mutated signature never loads
        assert all(fuzz.torch.equal(state[k], v) for k, v in truth[8].items())
    assert refused > 20


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
