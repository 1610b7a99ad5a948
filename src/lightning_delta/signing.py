"""Ed25519 keys, and the trust a reader puts in them: only the trainer's weights are loaded.

The trainer signs the run manifest, every commit marker and a heartbeat with its private key
(`SigningKey`); a reader configured with trusted public keys (`Trust`) checks each of them where
it is read (`store.Store`), so every reading path (loader, follower, replica, engine, CLI, mirror)
refuses, with `SignatureError` and before a byte of a payload is decoded, anything unsigned,
signed by another key, or whose signature does not bind what it claims.  What is signed is
`format`'s business (`run_signed_bytes`, `part_signed_bytes`, `heartbeat_signed_bytes`,
docs/FORMAT.md section 10); this module only signs and verifies bytes.

Keys in text: a public key is `ed25519:` and its 32 raw bytes in lower-case hex (the manifest
names its signer so); a private key file is PKCS#8 PEM, as `openssl genpkey -algorithm ed25519`
writes it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import format as fmt
from .errors import SignatureError

__all__ = ["PublicKey", "SigningKey", "Trust", "keygen"]

log = logging.getLogger(__name__)

_KEY_TEXT = re.compile(r"ed25519:[0-9a-f]{64}")
MAX_KEY_FILE = 4096
"""A key file is ~120 bytes of PEM or 73 of text; anything larger is not a key."""


@dataclass(frozen=True)
class PublicKey:
    """A trusted (or signing) public key, by its text `ed25519:<64 hex digits>`."""

    text: str

    def __post_init__(self) -> None:
        if not _KEY_TEXT.fullmatch(self.text):
            raise ValueError(f"not an Ed25519 public key: {self.text[:80]!r} (expected 'ed25519:' and 64 hex digits)")

    @classmethod
    def load(cls, source: str | os.PathLike[str]) -> PublicKey:
        """A key from its text, or from a file holding it (a `.pub` of `keygen`, or a PEM public key)."""
        text = os.fspath(source).strip()
        if _KEY_TEXT.fullmatch(text):
            return cls(text)
        data = _read_key_file(text)
        if data.startswith(b"-----BEGIN PUBLIC KEY-----"):
            key = serialization.load_pem_public_key(data)
            if not isinstance(key, Ed25519PublicKey):
                raise ValueError(f"{text} holds a {type(key).__name__}, not an Ed25519 public key")
            return cls.of(key)
        return cls(data.decode("ascii", errors="replace").strip())

    @classmethod
    def of(cls, key: Ed25519PublicKey) -> PublicKey:
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls("ed25519:" + raw.hex())

    def verify(self, signature: str, message: bytes) -> bool:
        """Whether `signature` (128 hex digits, as the format stores it) signs `message`."""
        try:
            _ed25519(self.text).verify(bytes.fromhex(signature), message)
        except (InvalidSignature, ValueError):
            return False
        return True

    @property
    def short(self) -> str:
        """The key as a person compares it: its first 16 hex digits."""
        return self.text[: len("ed25519:") + 16]


@functools.lru_cache(maxsize=64)
def _ed25519(text: str) -> Ed25519PublicKey:
    """The key object of a key's text, built once: a reader verifies every marker it reads."""
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(text.removeprefix("ed25519:")))


class SigningKey:
    """The trainer's private key: it signs, and is never written to the chain."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = PublicKey.of(key.public_key())

    def __repr__(self) -> str:
        return f"SigningKey({self.public.short}...)"  # never the private bytes

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        """The key of a 32-byte seed (golden tests; a real key comes from `generate`)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        """The private key in a PKCS#8 PEM file (what `keygen` writes); ValueError if it is not one."""
        data = _read_key_file(os.fspath(path))
        with contextlib.suppress(OSError):
            if os.stat(path).st_mode & 0o077:
                log.warning("%s is readable by other users: anyone who can read it can sign weights", os.fspath(path))
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{os.fspath(path)} is not an unencrypted PEM private key: {err}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{os.fspath(path)} holds a {type(key).__name__}, not an Ed25519 private key")
        return cls(key)

    def sign(self, message: bytes) -> str:
        """The signature of `message` as the format stores it: 128 lower-case hex digits."""
        return self._key.sign(message).hex()

    def pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def keygen(path: str | os.PathLike[str]) -> SigningKey:
    """Write a new key: `path` (the private key, mode 0600, created exclusively) and `path.pub`."""
    key = SigningKey.generate()
    path = os.fspath(path)
    if os.path.exists(path + ".pub"):
        raise FileExistsError(f"{path}.pub exists: choose another PATH (keygen never overwrites a key)")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.pem())
    os.chmod(path, 0o600)  # whatever the umask
    with open(path + ".pub", "x") as out:
        out.write(key.public.text + "\n")
    return key


def _read_key_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as err:
        raise ValueError(f"cannot read key {path!r}: {err.strerror or err}") from None
    if len(data) > MAX_KEY_FILE:
        raise ValueError(f"{path} is larger than {MAX_KEY_FILE} bytes: not a key file")
    return data


@dataclass(frozen=True)
class Trust:
    """The public keys a reader accepts a run's signer from (several: rotation).

    Every check raises `SignatureError` naming the object and what to do.
    """

    keys: frozenset[PublicKey]

    @classmethod
    def of(cls, sources: Iterable[str | os.PathLike[str]]) -> Trust | None:
        """Trust in the keys given as paths or text; None for no key (nothing is checked)."""
        keys = frozenset(PublicKey.load(s) for s in sources)
        return cls(keys) if keys else None

    def check_run(self, run: fmt.Run, where: str) -> None:
        """The manifest is signed by a trusted key, over its own bytes."""
        signer, signature = run.manifest.signer, run.manifest.signature
        if signer is None or signature is None:
            raise SignatureError(f"{where}: the run manifest is not signed, and this reader trusts only signed runs")
        key = PublicKey(signer)
        if key not in self.keys:
            raise SignatureError(
                f"{where}: the run is signed by {key.short}..., which is not among the {len(self.keys)} trusted "
                "keys: add its .pub to the trusted keys if that is your trainer's"
            )
        if not key.verify(signature, fmt.run_signed_bytes(run.manifest)):
            raise SignatureError(f"{where}: the run manifest's signature does not match its contents")

    def check_part(self, run: fmt.Run, marker: fmt.CommitMarker, place: fmt.PartPlace, where: str) -> None:
        """The marker is signed by the run's signer (checked by `check_run`), for this run, place and blob."""
        if marker.signature is None:
            raise SignatureError(f"{where}: the commit marker is not signed")
        assert run.manifest.signer is not None  # `check_run` passed
        message = fmt.part_signed_bytes(run.run_id, run.sha256, place, marker)
        if not PublicKey(run.manifest.signer).verify(marker.signature, message):
            raise SignatureError(
                f"{where}: the commit marker's signature does not bind this run, step, rank, kind and blob "
                "(a part moved from elsewhere, or altered)"
            )

    def check_heartbeat(self, run: fmt.Run, beat: fmt.Heartbeat, where: str) -> None:
        if beat.signature is None:
            raise SignatureError(f"{where}: the heartbeat is not signed")
        if (beat.run_id, beat.manifest) != (run.run_id, run.sha256):
            raise SignatureError(f"{where}: the heartbeat is another run's")
        assert run.manifest.signer is not None
        if not PublicKey(run.manifest.signer).verify(beat.signature, fmt.heartbeat_signed_bytes(beat)):
            raise SignatureError(f"{where}: the heartbeat's signature does not match its contents")
