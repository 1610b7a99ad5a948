"""Signed chains: with trusted keys, a reader loads only what the trainer's key signed, bound to
its run, step, rank and kind; without keys, every chain loads as before."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch

import jobs
from conftest import assert_state
from lightning_delta import (
    ChecksumError,
    DeltaLoader,
    DeltaPublisher,
    FollowSettings,
    FormatError,
    LoaderSettings,
    PublishError,
    PublisherSettings,
    SignatureError,
    StaleChainError,
    Store,
    records,
)
from lightning_delta import claim as claim_module
from lightning_delta import format as fmt
from lightning_delta.signing import PublicKey, SigningKey, Trust, keygen


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    """Paths of private keys: the trainer's, the attacker's, and a rotated trainer key."""
    folder = tmp_path_factory.mktemp("keys")
    paths = {name: str(folder / name) for name in ("trainer", "attacker", "next")}
    for path in paths.values():
        keygen(path)
    return paths


def weights() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(300, dtype=torch.bfloat16), "b": torch.zeros(6, 5, dtype=torch.bfloat16)}


def publish(
    url: str,
    steps: list[int],
    key: str | None = None,
    run_id: str | None = None,
    value: float | None = None,
    base_every: int = 3,
) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    """Publish `steps` of a two-tensor model (each step changes a few values, or sets every value to
    `value`); returns the run id and the true state of each step."""
    tensors, truth = weights(), {}
    with DeltaPublisher(url, tensors, PublisherSettings(base_every=base_every, signing_key=key), run_id=run_id) as pub:
        for step in steps:
            if value is None:
                tensors["a"][step % 300] = float(step)
                tensors["b"][step % 6, step % 5] = -float(step)
            else:
                for t in tensors.values():
                    t.fill_(value)
            pub.publish(step)
            truth[step] = {k: v.clone() for k, v in tensors.items()}
        run = pub.run_id
    return run, truth


def trusting(*names: str, keys: dict[str, str], **settings) -> LoaderSettings:
    return LoaderSettings(trusted_keys=tuple(keys[n] + ".pub" for n in names), **settings)


def copy_step(source: str, target: str, step: int) -> None:
    """Copy a step's objects (blobs and markers) from one prefix into another, as a writer would."""
    shutil.copytree(Path(source) / fmt.step_dir(step), Path(target) / fmt.step_dir(step), dirs_exist_ok=True)


def forge(tmp_path: Path, real: str, run_id: str, step: int, key: str | None) -> None:
    """The issue's recipe: copy the run's manifest elsewhere, publish a step there under the run's
    id with tooling that skips the signer check (unsigned, or signed by `key`), copy it back in."""
    elsewhere = str(tmp_path / "elsewhere")
    os.makedirs(elsewhere)
    shutil.copy(Path(real) / fmt.RUN_MANIFEST, elsewhere)
    mp = pytest.MonkeyPatch()
    mp.setattr(claim_module, "_make_run", lambda store, run_id, *_: (run_id, store.run().sha256))
    try:
        publish(elsewhere, [step], key, run_id=run_id, value=7.0)
    finally:
        mp.undo()
    copy_step(elsewhere, real, step)


# ----------------------------------------------------------------------------- the attacks


@pytest.mark.parametrize("forger", [None, "attacker", "trainer-unsigned-run"])
def test_the_forgery_recipe_is_refused_with_keys(tmp_path, keys, forger):
    """Without keys a fresh loader loads the forged step (the issue); with them, `SignatureError`.

    Unsigned run: a chain published without a key is refused outright by a trusting reader."""
    real = str(tmp_path / "real")
    signed = forger != "trainer-unsigned-run"
    run_id, truth = publish(real, [1, 2], keys["trainer"] if signed else None)
    forge(tmp_path, real, run_id, 3, keys["attacker"] if forger == "attacker" else None)
    step, state = DeltaLoader(real).state_dict(3)  # what the issue found
    assert step == 3 and all(bool((t == 7.0).all()) for t in state.values())
    trusted = DeltaLoader(real, trusting("trainer", keys=keys))
    with pytest.raises(SignatureError):
        trusted.state_dict(3)
    if signed:
        step, state = trusted.state_dict(2)  # the trainer's own steps still load
        assert_state(state, truth[2])


@pytest.mark.parametrize("attacker_key", [None, "attacker"])
def test_a_prefix_taken_over_whole_is_refused_by_a_fresh_loader(tmp_path, keys, attacker_key):
    """run.json and every step replaced by a consistent chain published elsewhere with the run's id."""
    real, other = str(tmp_path / "real"), str(tmp_path / "other")
    run_id, _ = publish(real, [1, 2], keys["trainer"])
    publish(other, [1, 2, 3], keys[attacker_key] if attacker_key else None, run_id=run_id, value=7.0)
    shutil.rmtree(real)
    shutil.copytree(other, real)
    assert DeltaLoader(real).state_dict()[0] == 3  # unchecked: the attacker's weights
    with pytest.raises(SignatureError, match="not signed" if attacker_key is None else "not among"):
        DeltaLoader(real, trusting("trainer", keys=keys)).state_dict()


@pytest.fixture
def signed_chain(tmp_path, keys) -> tuple[str, str, dict[int, dict[str, torch.Tensor]]]:
    """A signed chain of steps 1..5 (bases at 1 and 4, a bridge at 4)."""
    url = str(tmp_path / "chain")
    run_id, truth = publish(url, [1, 2, 3, 4, 5], keys["trainer"])
    return url, run_id, truth


def _read(url: str, key: str) -> bytes:
    return (Path(url) / key).read_bytes()


def _write(url: str, key: str, data: bytes) -> None:
    (Path(url) / key).write_bytes(data)


def _marker(url: str, step: int, bridge: bool = False) -> fmt.CommitMarker:
    return fmt.decode_commit(_read(url, fmt.commit_path(step, 0, 1, bridge=bridge)))


def _put_marker(url: str, step: int, marker: fmt.CommitMarker, bridge: bool = False) -> None:
    _write(url, fmt.commit_path(step, 0, 1, bridge=bridge), records.dumps(marker))


def _move_part(url: str, source: int, target: int, *, source_bridge: bool = False, target_bridge: bool = False):
    for path in (fmt.blob_path, fmt.commit_path):
        _write(url, path(target, 0, 1, bridge=target_bridge), _read(url, path(source, 0, 1, bridge=source_bridge)))


def _swap_step(url: str) -> int:
    """Step 3's place holds step 2's signed part (both deltas)."""
    _move_part(url, 2, 3)
    return 3


def _bridge_as_part(url: str) -> int:
    """Step 4's base replaced by its own signed bridge (a delta posing as the step's part)."""
    _move_part(url, 4, 4, source_bridge=True)
    return 4


def _base_as_delta(url: str) -> int:
    """Step 4's base relabelled as a delta from step 3, its signature kept."""
    _put_marker(url, 4, dataclasses.replace(_marker(url, 4), kind=fmt.Kind.DELTA, prev_step=3))
    return 4


def _delta_as_base(url: str) -> int:
    _put_marker(url, 5, dataclasses.replace(_marker(url, 5), kind=fmt.Kind.BASE, prev_step=None))
    return 5


def _blob_and_marker_replaced(url: str) -> int:
    """Step 5's blob replaced by step 2's bytes (another valid blob), the marker's size and SHA-256
    updated to it and its signature kept."""
    blob = _read(url, fmt.blob_path(2, 0, 1))
    _write(url, fmt.blob_path(5, 0, 1), blob)
    marker = _marker(url, 2)
    _put_marker(url, 5, dataclasses.replace(_marker(url, 5), size=marker.size, sha256=marker.sha256))
    return 5


def _signature(change) -> object:
    def mutate(url: str) -> int:
        marker = _marker(url, 5)
        assert marker.signature is not None
        _put_marker(url, 5, dataclasses.replace(marker, signature=change(marker.signature)))
        return 5

    return mutate


def _another_signatures(url: str) -> int:
    """Step 5's marker carries step 2's (valid) signature."""
    _put_marker(url, 5, dataclasses.replace(_marker(url, 5), signature=_marker(url, 2).signature))
    return 5


def _unsigned(url: str) -> int:
    _put_marker(url, 5, dataclasses.replace(_marker(url, 5), signature=None))
    return 5


def _version_2_marker(url: str) -> int:
    """An unsigned marker of the previous format version, which readers without keys still take."""
    marker = _marker(url, 5)
    raw = records.dumps(dataclasses.replace(marker, format="lightning_delta.commit/2", signature=None))
    _write(url, fmt.commit_path(5, 0, 1), raw.replace(b',"signature":null', b""))
    return 5


BOUND = {
    "another step's part": (_swap_step, SignatureError),
    "a bridge posing as its step's part": (_bridge_as_part, SignatureError),
    "a base relabelled as a delta": (_base_as_delta, SignatureError),
    "a delta relabelled as a base": (_delta_as_base, SignatureError),
    "a blob and its marker replaced": (_blob_and_marker_replaced, SignatureError),
    "a signature altered": (_signature(lambda s: s[:-1] + ("0" if s[-1] != "0" else "1")), SignatureError),
    "a signature flipped in its first half": (
        _signature(lambda s: ("f" if s[0] != "f" else "e") + s[1:]),
        SignatureError,
    ),
    "a signature truncated": (_signature(lambda s: s[:64]), (FormatError, SignatureError)),
    "a signature duplicated": (_signature(lambda s: s + s), (FormatError, SignatureError)),
    "another marker's signature": (_another_signatures, SignatureError),
    "no signature": (_unsigned, SignatureError),
    "a version 2 marker": (_version_2_marker, SignatureError),
}


@pytest.mark.parametrize("name", BOUND)
def test_each_bound_field_swapped_is_refused(signed_chain, keys, name):
    url, _, truth = signed_chain
    mutate, error = BOUND[name]
    step = mutate(url)
    with pytest.raises(error):
        DeltaLoader(url, trusting("trainer", keys=keys)).state_dict(step)
    loader = DeltaLoader(url, trusting("trainer", keys=keys))
    for intact in (s for s in (1, 2, 3) if s < step):
        assert_state(loader.state_dict(intact)[1], truth[intact])


def test_a_replaced_blob_under_a_signed_marker_is_refused_before_decoding(signed_chain, keys, monkeypatch):
    url, _, _ = signed_chain
    planted = bytearray(_read(url, fmt.blob_path(5, 0, 1)))
    planted[-1] ^= 0x01  # same size, another digest than the signed one
    _write(url, fmt.blob_path(5, 0, 1), bytes(planted))
    decoded, decode = [], fmt.decode_blob
    monkeypatch.setattr(fmt, "decode_blob", lambda blob: decoded.append(bytes(blob)) or decode(blob))
    with pytest.raises(ChecksumError):
        DeltaLoader(url, trusting("trainer", keys=keys)).state_dict(5)
    assert decoded and bytes(planted) not in decoded  # step 4's base was decoded, the planted blob never


def test_another_runs_signed_part_is_refused(tmp_path, signed_chain, keys):
    """A second run signed by the same key: its parts carry valid signatures, for another run."""
    url, _, _ = signed_chain
    other = str(tmp_path / "other")
    publish(other, [1, 2, 3, 4, 5, 6], keys["trainer"], value=7.0)
    copy_step(other, url, 6)
    with pytest.raises(SignatureError, match="does not bind"):
        DeltaLoader(url, trusting("trainer", keys=keys)).state_dict(6)


def test_the_manifest_altered_or_resigned_is_refused(signed_chain, keys):
    url, _, _ = signed_chain
    manifest = fmt.decode_manifest(_read(url, fmt.RUN_MANIFEST)).manifest
    altered = dataclasses.replace(manifest, created=manifest.created + 1)
    _write(url, fmt.RUN_MANIFEST, records.dumps(altered))
    with pytest.raises(SignatureError, match="does not match"):
        DeltaLoader(url, trusting("trainer", keys=keys)).steps()
    attacker = SigningKey.load(keys["attacker"])
    resigned = dataclasses.replace(manifest, signer=attacker.public.text)
    resigned = dataclasses.replace(resigned, signature=attacker.sign(fmt.run_signed_bytes(resigned)))
    _write(url, fmt.RUN_MANIFEST, records.dumps(resigned))
    with pytest.raises(SignatureError, match="not among"):
        DeltaLoader(url, trusting("trainer", keys=keys)).steps()
    # a signed manifest re-encoded (same meaning, other bytes) is not the canonical one
    _write(url, fmt.RUN_MANIFEST, records.dumps(manifest).replace(b",", b", ", 1))
    with pytest.raises(FormatError, match="canonical"):
        DeltaLoader(url).steps()


# ----------------------------------------------------------------------------- followers


def test_a_follower_never_writes_a_refused_step(tmp_path, keys):
    """A follower at step 2 meets the forged step 3: its module stays at step 2, it skips step 3,
    then takes the trainer's step 4."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, value in weights().items():
                setattr(self, name, torch.nn.Parameter(value, requires_grad=False))

    real = str(tmp_path / "real")
    tensors, truth, module = weights(), {}, Model()
    with DeltaPublisher(real, tensors, PublisherSettings(base_every=10, signing_key=keys["trainer"])) as pub:
        for step in (1, 2):
            tensors["a"][step] = float(step)
            pub.publish(step)
            truth[step] = {k: v.clone() for k, v in tensors.items()}
        pub.flush()
        loader = DeltaLoader(real, trusting("trainer", keys=keys))
        follower = loader.follow(FollowSettings(poll_seconds=0.05, timeout=60, jump=False))
        first = next(follower)
        while first.step != 2:
            first = next(follower)
        first.apply_to(module)
        forge(tmp_path, real, pub.run_id, 3, keys["attacker"])
        tensors["a"][4] = 4.0
        pub.publish(4)
        pub.flush()
        truth[4] = {k: v.clone() for k, v in tensors.items()}
        taken = next(follower)
        assert taken.step == 4 and 3 in taken.skipped
        assert_state(dict(module.named_parameters()), truth[2])  # nothing of step 3 was written
        taken.apply_to(module)
        follower.close()
    assert_state(dict(module.named_parameters()), truth[4])


def test_unsigned_chains_load_unchanged_without_keys(tmp_path):
    url = str(tmp_path / "chain")
    _, truth = publish(url, [1, 2, 3, 4])
    marker = _marker(url, 2)
    assert marker.signature is None and fmt.decode_manifest(_read(url, fmt.RUN_MANIFEST)).manifest.signer is None
    loader = DeltaLoader(url)
    for step in (1, 2, 3, 4):
        assert_state(loader.state_dict(step)[1], truth[step])
    assert not (Path(url) / fmt.HEARTBEAT).exists()


def test_a_version_2_chain_still_loads_unsigned(tmp_path):
    """Chains written before signatures (run/2, commit/2) load as they did."""
    url = str(tmp_path / "chain")
    _, truth = publish(url, [1, 2, 3, 4])
    manifest = fmt.decode_manifest(_read(url, fmt.RUN_MANIFEST)).manifest
    old = records.dumps(dataclasses.replace(manifest, format="lightning_delta.run/2"))
    old = old.replace(b',"signature":null', b"").replace(b',"signer":null', b"")
    assert b"signature" not in old and b"signer" not in old
    _write(url, fmt.RUN_MANIFEST, old)
    digest = fmt.decode_manifest(old).sha256
    for step in (1, 2, 3, 4):  # re-point the parts at the re-written manifest, markers as version 2
        for bridge in (False, True):
            path = Path(url) / fmt.blob_path(step, 0, 1, bridge=bridge)
            if not path.exists():
                continue
            blob = path.read_bytes()
            part = fmt.decode_blob(blob)
            header = dataclasses.replace(part.header, manifest=digest)
            blob = fmt.encode_blob(header, list(part.entries), [bytes(p) for p in part.payloads], part.probe)
            path.write_bytes(blob)
            marker = fmt.encode_commit(blob, header).replace(b"commit/3", b"commit/2")
            marker = marker.replace(b',"signature":null', b"")
            (Path(url) / fmt.commit_path(step, 0, 1, bridge=bridge)).write_bytes(marker)
    assert fmt.decode_commit(marker).format == "lightning_delta.commit/2"
    loader = DeltaLoader(url)
    for step in (1, 2, 3, 4):
        assert_state(loader.state_dict(step)[1], truth[step])
    with pytest.raises(SignatureError, match="not signed"):
        DeltaLoader(url, LoaderSettings(trusted_keys=(SigningKey.generate().public.text,))).steps()


# ----------------------------------------------------------------------------- keys


def test_keygen_writes_a_private_key_0600_and_its_public_key(tmp_path):
    path = tmp_path / "key"
    key = keygen(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert SigningKey.load(path).public == key.public == PublicKey.load(str(path) + ".pub")
    assert PublicKey.load(key.public.text) == key.public
    assert b"PRIVATE KEY" in path.read_bytes() and key.public.text.encode() not in path.read_bytes()
    with pytest.raises(FileExistsError):
        keygen(path)  # never overwrites a key
    for bad in ("ed25519:12", str(tmp_path / "missing.pub")):
        with pytest.raises(ValueError):
            PublicKey.load(bad)
    with pytest.raises(ValueError, match="not an unencrypted PEM"):
        SigningKey.load(str(path) + ".pub")


def test_the_private_key_is_never_written_to_the_chain(signed_chain, keys):
    url, _, _ = signed_chain
    secret = SigningKey.load(keys["trainer"])
    raw = secret._key.private_bytes_raw()
    for name in (raw.hex().encode(), raw, secret.pem()):
        for path in Path(url).rglob("*"):
            if path.is_file():
                assert name not in path.read_bytes(), path


def test_rotation_several_trusted_keys_and_the_manifest_names_the_signer(tmp_path, keys):
    """Runs signed by the old and the new key both load with both trusted; each names its signer;
    a resumed run keeps its signer."""
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    run_id, old_truth = publish(old, [1, 2], keys["trainer"])
    _, new_truth = publish(new, [1, 2], keys["next"])
    settings = trusting("trainer", "next", keys=keys)
    for url, truth, name in ((old, old_truth, "trainer"), (new, new_truth, "next")):
        loader = DeltaLoader(url, settings)
        assert loader.store.run().manifest.signer == SigningKey.load(keys[name]).public.text
        assert_state(loader.state_dict(2)[1], truth[2])
    with pytest.raises(SignatureError, match="not among"):
        DeltaLoader(new, trusting("trainer", keys=keys)).steps()  # the old key alone: not the new run
    with pytest.raises(PublishError, match="keeps its signer"):
        publish(old, [3], keys["next"], run_id=run_id)
    with pytest.raises(PublishError, match="keeps its signer"):
        publish(old, [3], None, run_id=run_id)
    _, resumed = publish(old, [3], keys["trainer"], run_id=run_id)
    assert_state(DeltaLoader(old, settings).state_dict(3)[1], resumed[3])


def test_trust_takes_paths_and_text_and_refuses_junk(keys):
    text = PublicKey.load(keys["trainer"] + ".pub").text
    trust = Trust.of([keys["trainer"] + ".pub", text])
    assert trust is not None and len(trust.keys) == 1
    assert Trust.of([]) is None
    with pytest.raises(ValueError, match="cannot read key"):
        DeltaLoader("memory://x", LoaderSettings(trusted_keys=("nonsense",)))


# ----------------------------------------------------------------------------- the heartbeat


def test_the_heartbeat_is_signed_and_bound_to_its_run(signed_chain, keys, tmp_path):
    url, run_id, _ = signed_chain
    store = Store(url, trust=Trust.of([keys["trainer"] + ".pub"]))
    beat = store.heartbeat()
    assert beat is not None and beat.step == 5 and beat.run_id == run_id and beat.signature
    other = str(tmp_path / "other")
    publish(other, [1, 2, 3, 4, 5, 6, 7], keys["trainer"])
    shutil.copy(Path(other) / fmt.HEARTBEAT, Path(url) / fmt.HEARTBEAT)  # a newer heartbeat of another run
    with pytest.raises(SignatureError, match="another run"):
        Store(url, trust=Trust.of([keys["trainer"] + ".pub"])).heartbeat()
    forged = dataclasses.replace(beat, time=beat.time + 3600)
    _write(url, fmt.HEARTBEAT, records.dumps(forged))
    with pytest.raises(SignatureError, match="does not match"):
        Store(url, trust=Trust.of([keys["trainer"] + ".pub"])).heartbeat()


def test_a_withheld_step_is_detected_by_max_heartbeat_age(tmp_path, keys, caplog):
    """A mirror frozen at step 2 (the trainer went on to step 4): once its heartbeat is older than
    `max_heartbeat_age`, a follower warns, and with `refuse_stale` raises; the trainer's own store
    (fresh heartbeat) passes."""
    real, mirror = str(tmp_path / "real"), str(tmp_path / "mirror")
    tensors = weights()
    settings = PublisherSettings(base_every=10, signing_key=keys["trainer"], heartbeat_seconds=3600)
    with DeltaPublisher(real, tensors, settings) as pub:
        for step in (1, 2):
            tensors["a"][step] = float(step)
            pub.publish(step)
        pub.flush()
        # The mirror stops copying here (the heartbeat, which rank 0 may be rewriting now, comes below).
        shutil.copytree(
            real, mirror, ignore=lambda d, names: [n for n in names if d == real and n != "run.json" and n != "steps"]
        )
        for step in (3, 4):
            pub.publish(step)
    run = Store(mirror).run()
    # The trainer's heartbeat of step 2, from two minutes ago: the newest the frozen mirror holds.
    frozen = fmt.Heartbeat(run.run_id, run.sha256, 2, time.time() - 120)
    Store(mirror).beat(frozen, SigningKey.load(keys["trainer"]))
    strict = trusting("trainer", keys=keys, max_heartbeat_age=60.0, refuse_stale=True)
    assert DeltaLoader(real, strict).state_dict()[0] == 4  # the trainer's store: fresh (written at close)
    with pytest.raises(StaleChainError, match="withholding"):
        DeltaLoader(mirror, strict).state_dict()
    follower = DeltaLoader(mirror, strict).follow(FollowSettings(poll_seconds=0.05))
    with pytest.raises(StaleChainError):
        next(follower)
    lenient = DeltaLoader(mirror, trusting("trainer", keys=keys, max_heartbeat_age=60.0))
    with caplog.at_level(logging.WARNING, logger="lightning_delta.loader"):
        assert lenient.state_dict()[0] == 2
    assert "withholding" in caplog.text
    unchecked = DeltaLoader(mirror, trusting("trainer", keys=keys))
    assert unchecked.state_dict()[0] == 2  # without max_heartbeat_age: "no new step yet"


def test_a_chain_without_a_heartbeat_is_stale(tmp_path):
    url = str(tmp_path / "chain")
    publish(url, [1])
    with pytest.raises(StaleChainError, match="no heartbeat"):
        DeltaLoader(url, LoaderSettings(max_heartbeat_age=60.0, refuse_stale=True)).state_dict()


def test_signed_bytes_are_bound_exactly():
    """Every field a marker's signature binds changes the signed bytes."""
    place = fmt.PartPlace(7, 1, 2, False)
    marker = fmt.CommitMarker(100, "ab" * 32, fmt.Kind.DELTA, 6)
    base = fmt.part_signed_bytes("run", "cd" * 32, place, marker)
    changed = [
        fmt.part_signed_bytes("run2", "cd" * 32, place, marker),
        fmt.part_signed_bytes("run", "ce" * 32, place, marker),
        fmt.part_signed_bytes("run", "cd" * 32, place._replace(step=8), marker),
        fmt.part_signed_bytes("run", "cd" * 32, place._replace(rank=0), marker),
        fmt.part_signed_bytes("run", "cd" * 32, place._replace(world_size=3), marker),
        fmt.part_signed_bytes("run", "cd" * 32, place._replace(bridge=True), marker),
        fmt.part_signed_bytes("run", "cd" * 32, place, dataclasses.replace(marker, prev_step=5)),
        fmt.part_signed_bytes("run", "cd" * 32, place, dataclasses.replace(marker, size=101)),
        fmt.part_signed_bytes("run", "cd" * 32, place, dataclasses.replace(marker, sha256="ac" * 32)),
        fmt.part_signed_bytes("run", "cd" * 32, place, dataclasses.replace(marker, kind=fmt.Kind.BASE, prev_step=None)),
    ]
    assert len({base, *changed}) == len(changed) + 1


# ----------------------------------------------------------------------------- the command line


def test_cli_keygen_and_trust(tmp_path, capsys, keys):
    from lightning_delta.cli import main

    key = str(tmp_path / "cli-key")
    assert main(["keygen", key]) == 0
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600 and PublicKey.load(key + ".pub")
    assert main(["keygen", key]) == 2  # never overwrites a key
    real = str(tmp_path / "real")
    run_id, _ = publish(real, [1, 2], key)
    capsys.readouterr()
    assert main(["inspect", real]) == 0
    assert f"signed by {PublicKey.load(key + '.pub').text} (not checked" in capsys.readouterr().out
    assert main(["verify", real, "--trust", key + ".pub"]) == 0
    assert main(["verify", real, "--trust", keys["attacker"] + ".pub", "--trust", keys["next"] + ".pub"]) == 2
    assert "SignatureError" in capsys.readouterr().err
    forge(tmp_path, real, run_id, 3, keys["attacker"])
    assert main(["verify", real]) == 0  # without keys the forgery is not seen
    capsys.readouterr()
    assert main(["verify", real, "--trust", key + ".pub", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(p["step"], p["error"]) for p in report["problems"]] == [(3, "SignatureError")]
    assert main(["inspect", real, "--trust", key + ".pub"]) == 0
    out = capsys.readouterr().out
    assert "checked against --trust" in out and "DAMAGED: SignatureError" in out
    assert main(["inspect", real, "--trust", key + ".pub", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["signer"], report["signer_checked"]) == (PublicKey.load(key + ".pub").text, True)
    assert "SignatureError" in report["steps"][2]["damaged"]
    out_file = str(tmp_path / "w.safetensors")
    assert main(["materialize", real, "--step", "3", out_file, "--trust", key + ".pub"]) == 2
    assert not os.path.exists(out_file)
    assert main(["materialize", real, "--step", "2", out_file, "--trust", key + ".pub"]) == 0
    unsigned = str(tmp_path / "unsigned")
    publish(unsigned, [1])
    capsys.readouterr()
    assert main(["inspect", unsigned]) == 0 and "unsigned" in capsys.readouterr().out
    assert main(["verify", unsigned, "--trust", key + ".pub"]) == 2


# ----------------------------------------------------------------------------- a multi-rank run


@pytest.mark.slow
def test_a_two_rank_fsdp2_run_signs_every_ranks_parts(tmp_path, keys):
    """Every rank signs its own parts: a trusting loader rebuilds every step bit for bit, every
    marker of both ranks carries a signature that binds it, and rank 0's part at rank 1's place
    (or the two swapped) is refused."""
    from safetensors.torch import load_file

    from conftest import ROOT, torchrun

    store, truth = tmp_path / "store", tmp_path / "truth"
    steps = 6
    job = ROOT / "tests" / "dist_job.py"
    torchrun(job, str(store), str(truth), "--strategy", "fsdp2", "--steps", str(steps), "--base-every", "3",
             "--signing-key", keys["trainer"])  # fmt: skip
    settings = trusting("trainer", keys=keys)
    loader = DeltaLoader(str(store), settings)
    assert loader.steps() == list(range(1, steps + 1))
    trust = Trust.of(settings.trusted_keys)
    assert trust is not None
    run = loader.store.run()
    for step in loader.steps():
        assert_state(loader.state_dict(step)[1], load_file(truth / f"step-{step:06d}.safetensors"))
        for rank in (0, 1):
            for ref in loader.store.part_refs(step, rank, 2):
                marker = loader.store.read_marker(step, rank, 2, bridge=ref.bridge)
                assert marker.signature is not None
                trust.check_part(run, marker, fmt.PartPlace(step, rank, 2, ref.bridge), "here")
    for path in (fmt.blob_path, fmt.commit_path):  # ranks 0 and 1 of step 5 swapped
        zero, one = store / path(5, 0, 2), store / path(5, 1, 2)
        data = zero.read_bytes()
        zero.write_bytes(one.read_bytes())
        one.write_bytes(data)
    with pytest.raises(SignatureError, match="does not bind"):
        DeltaLoader(str(store), settings).state_dict(5)
    assert_state(DeltaLoader(str(store), settings).state_dict(4)[1], load_file(truth / "step-000004.safetensors"))


def test_cost_counts_signed_markers_as_loaders_read_them(signed_chain, capsys):
    """`cost` sizes markers from refs alone: a signed marker's 140 more bytes are counted too."""
    from lightning_delta.cli import main

    url, _, _ = signed_chain
    assert main(["cost", url, "--regions", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    follower, moved = DeltaLoader(url), 0
    follower.steps()
    for step in range(1, 6):
        follower.state_dict(step)
        assert follower.last_report is not None
        moved += follower.last_report.bytes_read
    assert report["readers"]["in_sync_follower"]["per_region"] == moved


def test_steps_withheld_behind_a_relayed_heartbeat_are_detected(tmp_path, keys):
    """A mirror that relays the trainer's fresh heartbeat (step 4) but withholds steps 3 and 4:
    once that has lasted `max_heartbeat_age`, a strict follower raises."""
    real, mirror = str(tmp_path / "real"), str(tmp_path / "mirror")
    run_id, _ = publish(real, [1, 2, 3, 4], keys["trainer"])
    shutil.copytree(real, mirror)
    for step in (3, 4):
        shutil.rmtree(Path(mirror) / fmt.step_dir(step))
    run = Store(mirror).run()
    beat = fmt.Heartbeat(run_id, run.sha256, 4, time.time() + 3600)  # fresh for the whole test
    Store(mirror).beat(beat, SigningKey.load(keys["trainer"]))
    strict = trusting("trainer", keys=keys, max_heartbeat_age=0.2, refuse_stale=True)
    follower = DeltaLoader(mirror, strict).follow(FollowSettings(poll_seconds=0.05, timeout=120))
    with pytest.raises(StaleChainError, match="names step 4"):
        for followed in follower:
            assert followed.step == 2
    shutil.copytree(Path(real) / fmt.step_dir(3), Path(mirror) / fmt.step_dir(3))
    shutil.copytree(Path(real) / fmt.step_dir(4), Path(mirror) / fmt.step_dir(4))
    assert DeltaLoader(mirror, strict).state_dict()[0] == 4  # nothing withheld any more


def test_a_forged_step_far_ahead_does_not_make_a_follower_skip_the_trainers_steps(tmp_path, keys):
    """A signed follower that refuses a planted step 1000 still takes the trainer's steps 3 and 4
    (damage would make it wait for a step past 1000; a forgery is only passed over)."""
    real = str(tmp_path / "real")
    tensors, truth = weights(), {}
    with DeltaPublisher(real, tensors, PublisherSettings(base_every=10, signing_key=keys["trainer"])) as pub:
        for step in (1, 2):
            tensors["a"][step] = float(step)
            pub.publish(step)
        pub.flush()
        follower = DeltaLoader(real, trusting("trainer", keys=keys)).follow(
            FollowSettings(poll_seconds=0.05, timeout=120)
        )
        assert next(follower).step == 2
        forge(tmp_path, real, pub.run_id, 1000, keys["attacker"])
        for step in (3,):
            tensors["a"][step] = float(step)
            pub.publish(step)
            truth[step] = {k: v.clone() for k, v in tensors.items()}
        pub.flush()
        taken = next(follower)
        assert taken.step == 3 and 1000 in taken.skipped
        assert_state(taken.tensors, truth[3])
        tensors["a"][4] = 4.0
        pub.publish(4)
        pub.flush()
        assert next(follower).step == 4
        follower.close()


@pytest.mark.slow
def test_hydra_delta_signing_key_signs_a_training_run(tmp_path, keys, capsys):
    """`delta.signing_key=...` from the command line of scripts/train.py (Lightning's callback):
    the chain verifies with the trainer's key only."""
    import subprocess
    import sys

    from conftest import ROOT
    from lightning_delta.cli import main

    store = tmp_path / "store"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "steps=3", "model.dim=32"]
    cmd += [f"store.url={store}", f"delta.signing_key={keys['trainer']}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["verify", str(store), "--trust", keys["trainer"] + ".pub"]) == 0
    assert main(["verify", str(store), "--trust", keys["next"] + ".pub"]) == 2
    assert "SignatureError" in capsys.readouterr().err


def _replica_worker(rank: int, url: str, trusted: str, out: str) -> None:
    """One worker of a two-worker replica: the forged step, then the trainer's."""
    import torch.distributed as dist

    from lightning_delta import DeltaError

    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    loader = DeltaLoader(url, LoaderSettings(trusted_keys=(trusted,)), process_group=dist.group.WORLD)
    try:
        loader.state_dict(3)
        forged = "loaded"
    except DeltaError as err:
        forged = type(err).__name__
    step, state = loader.state_dict(2)
    torch.save({"forged": forged, "step": step, "state": state}, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()
    jobs.end()  # not Python's finalization, which a gloo thread can abort (SIGABRT; jobs.end says why)


@pytest.mark.slow
def test_a_replicas_workers_all_refuse_a_forged_step(tmp_path, keys):
    """Only worker 0 reads the (one-rank) chain's markers; both raise `SignatureError`, and both
    then load the trainer's step."""
    real = str(tmp_path / "real")
    run_id, truth = publish(real, [1, 2], keys["trainer"])
    forge(tmp_path, real, run_id, 3, keys["attacker"])
    torch.multiprocessing.spawn(_replica_worker, args=(real, keys["trainer"] + ".pub", str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank-{rank}.pt")
        assert got["forged"] == "SignatureError" and got["step"] == 2, got["forged"]
        assert_state(got["state"], truth[2])


def test_a_private_key_readable_by_others_is_warned_about(tmp_path, caplog):
    path = tmp_path / "key"
    keygen(path)
    with caplog.at_level(logging.WARNING, logger="lightning_delta.signing"):
        SigningKey.load(path)
    assert "readable by other users" not in caplog.text
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="lightning_delta.signing"):
        SigningKey.load(path)
    assert "readable by other users" in caplog.text
    (tmp_path / "other.pub").write_text("x")
    with pytest.raises(FileExistsError):
        keygen(tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_a_mirror_needs_no_key_and_with_keys_copies_only_the_trainers_steps(tmp_path, keys):
    """A mirror without keys relays the signatures and the heartbeat: a trusting follower of the
    mirror loads every step.  Given the trainer's key, a mirror refuses a run signed by another
    key, and never copies a forged part (it stops at that step, as at damage)."""
    from lightning_delta import Mirror

    real, plain, checked = (str(tmp_path / n) for n in ("real", "plain", "checked"))
    run_id, truth = publish(real, [1, 2, 3, 4], keys["trainer"])
    strict = trusting("trainer", keys=keys)
    with Mirror(real, plain) as mirror:
        mirror.sync()
    assert _read(plain, fmt.HEARTBEAT) == _read(real, fmt.HEARTBEAT)  # relayed as the trainer signed it
    assert Store(plain, trust=Trust.of([keys["trainer"] + ".pub"])).heartbeat() is not None
    for step in (1, 2, 3, 4):
        assert_state(DeltaLoader(plain, strict).state_dict(step)[1], truth[step])

    forge(tmp_path, real, run_id, 5, keys["attacker"])
    trust = Trust.of([keys["trainer"] + ".pub"])
    with Mirror(real, checked, trust=trust) as mirror:
        metrics = mirror.sync()
    assert metrics.mirror_step == 4 and metrics.stopped_at is not None and "steps/" in metrics.stopped_at
    assert not (Path(checked) / fmt.step_dir(5)).exists()  # the forged part was never copied
    assert DeltaLoader(checked, strict).steps() == [1, 2, 3, 4]
    foreign = Mirror(real, str(tmp_path / "other"), trust=Trust.of([keys["attacker"] + ".pub"]))
    with foreign, pytest.raises(SignatureError, match="not among"):
        foreign.sync()


def test_a_mirror_that_finds_every_step_by_its_names_still_relays_the_heartbeat(tmp_path, keys, monkeypatch):
    """A paced mirror finds each step at its first poll, so every pass copies one: the heartbeat is
    still relayed once a usual step gap, after the step's markers, or a signed run's followers of
    the mirror would see it stale between listings."""
    from lightning_delta import Mirror, MirrorSettings
    from lightning_delta import mirror as mirror_module

    clock = [0.0]
    monkeypatch.setattr(mirror_module.time, "monotonic", lambda: clock[0])
    home, region = str(tmp_path / "home"), str(tmp_path / "region")
    tensors = weights()
    settings = PublisherSettings(base_every=100, signing_key=keys["trainer"])
    with (
        DeltaPublisher(home, tensors, settings) as publisher,
        Mirror(home, region, MirrorSettings(list_seconds=1e9)) as mirror,
    ):
        for step in range(1, 7):
            tensors["a"][step] = float(step)
            publisher.publish(step)
            publisher.flush()
            deadline = time.monotonic() + 120  # the heartbeat follows the commit on rank 0's thread
            while fmt.decode_heartbeat(_read(home, fmt.HEARTBEAT)).step != step:
                assert time.monotonic() < deadline, "the trainer's heartbeat never named the step"
                time.sleep(0.01)
            clock[0] += 1.0
            metrics = mirror.sync()
            assert metrics.mirror_step == step
            if step == 2:
                listed = metrics.listings
            if step >= 3:  # found by its names, at the first poll: no listing relays it
                assert metrics.listings == listed
                assert fmt.decode_heartbeat(_read(region, fmt.HEARTBEAT)).step == step
