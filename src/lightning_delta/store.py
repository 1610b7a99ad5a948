"""A chain in an object store: where each object lives, and the commit protocol.

Commit protocol (no rename needed, so it holds on S3 too): a rank writes its blob, then its
commit marker, each created exclusively.  A part counts only once its marker exists, and a step is
visible only once the markers of all the run's ranks exist.  A publisher that dies mid-upload
therefore leaves at most an invisible step behind.

Names found by listing are hints: only those that match their exact pattern count, and every
object is read with a bound (its marker's size, or the format's cap for JSON objects), so a
damaged or hostile store costs at most what the run's own objects would.  Every object is parsed
by `format`, the one parser; this module only says where objects are and what counts.

With a `Trust` (the reader's trusted keys), the run manifest, every commit marker and the heartbeat
are checked here, as they are read, so every reading path gets the check from this one place and
a part's bytes are fetched only by the SHA-256 of a marker its run's trainer signed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from . import format as fmt
from . import records
from .errors import ChainError, ChecksumError, ConflictError, FormatError, MissingObjectError, SnapshotNotFoundError
from .format import PartRef
from .objects import FsspecObjects, ObjectStore
from .signing import SigningKey, Trust

__all__ = ["Store", "as_store"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Store:
    """The chain below one prefix: a fsspec URL (a local path works) or any `ObjectStore`."""

    def __init__(
        self, url: str | ObjectStore, storage_options: Mapping[str, Any] | None = None, *, trust: Trust | None = None
    ) -> None:
        self.trust = trust
        """The keys a run's signer must be among; None reads signed and unsigned chains unchecked."""
        if isinstance(url, str):
            self.objects: ObjectStore = FsspecObjects(url, storage_options)
        elif storage_options:
            raise ValueError("storage_options apply to a URL, not to an object store")
        else:
            self.objects = url
        self.url = self.objects.url
        self._run: fmt.Run | None = None
        self._ignored: set[tuple[str, str]] = set()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @property
    def bytes_read(self) -> int:
        """Bytes of every object read so far (markers, headers, blobs, the manifest)."""
        return self.objects.bytes_read

    def _read(self, key: str, limit: int, parse: Callable[[bytes], T]) -> T | None:
        """`parse` of an object read with a bound (`limit + 1` bytes at most: a larger object is a
        `FormatError`, never read whole); None if it does not exist."""
        data = self.objects.get(key, 0, limit + 1)
        if data is None:
            return None
        try:
            if len(data) > limit:
                raise FormatError(f"is larger than the {limit} bytes expected")
            return parse(data)
        except FormatError as err:
            raise FormatError(f"{self.url}/{key}: {err}") from None

    # ------------------------------------------------------------------ commit protocol

    def commit_part(
        self,
        header: fmt.PartHeader,
        blob: bytes,
        *,
        bridge: bool = False,
        signer: SigningKey | None = None,
        run_id: str | None = None,
    ) -> int:
        """Publish one rank's part: the blob first, then the marker that makes it count, signed by
        `signer` for run `run_id` if given; returns the bytes written (blob and marker).

        Both are created exclusively, so two publishers can never interleave one chain: the
        second to reach a step gets `ConflictError` and the first one's part stays intact.
        """
        where = (header.step, header.rank, header.world_size)
        key = fmt.blob_path(*where, bridge=bridge)
        record = fmt.commit_marker(blob, header)
        if signer is not None:
            if run_id is None:
                raise ValueError("a signed marker binds its run: pass run_id with signer")
            signed = fmt.part_signed_bytes(run_id, header.manifest, fmt.PartPlace(*where, bridge), record)
            record = dataclasses.replace(record, signature=signer.sign(signed))
        marker = records.dumps(record)
        if not (self.objects.create(key, blob) and self.objects.create(fmt.commit_path(*where, bridge=bridge), marker)):
            raise ConflictError(
                f"{self.url}/{key} already exists: another publisher wrote this step of the chain; "
                "give each run its own store prefix"
            )
        return len(blob) + len(marker)

    # ------------------------------------------------------------------ the run

    def manifest(self) -> fmt.Run | None:
        """The run that owns this prefix; None while no publisher has claimed it.

        It is never rewritten, so once read it is kept.
        """
        if self._run is None:
            run = self._read(fmt.RUN_MANIFEST, fmt.MAX_MANIFEST_BYTES, fmt.decode_manifest)
            if run is not None and self.trust is not None:
                self.trust.check_run(run, f"{self.url}/{fmt.RUN_MANIFEST}")
            self._run = run
        return self._run

    def run(self) -> fmt.Run:
        """The run manifest, which must exist: every complete step has one."""
        run = self.manifest()
        if run is None:
            raise FormatError(f"{self.url} holds no {fmt.RUN_MANIFEST}: not a {fmt.PART_FORMAT} chain")
        return run

    def claim(self, manifest: fmt.RunManifest) -> fmt.Run:
        """Make this prefix `manifest`'s run: create the manifest, or find one there already.

        Returns the run in the store, which is another one if the prefix was taken.
        """
        data = fmt.encode_manifest(manifest)
        if self.objects.create(fmt.RUN_MANIFEST, data):
            self._run = fmt.decode_manifest(data)
            return self._run
        return self.run()  # created exclusively, never deleted

    def beat(self, heartbeat: fmt.Heartbeat, key: SigningKey) -> None:
        """Rewrite the heartbeat, signed by `key` (readers see the old one or the new one whole)."""
        signed = dataclasses.replace(heartbeat, signature=key.sign(fmt.heartbeat_signed_bytes(heartbeat)))
        self.objects.put(fmt.HEARTBEAT, records.dumps(signed))

    def heartbeat(self) -> fmt.Heartbeat | None:
        """The run's newest heartbeat (checked against the trusted keys, if any); None if there is none."""
        beat = self._read(fmt.HEARTBEAT, fmt.MAX_MARKER_BYTES, fmt.decode_heartbeat)
        if beat is not None and self.trust is not None:
            self.trust.check_heartbeat(self.run(), beat, f"{self.url}/{fmt.HEARTBEAT}")
        return beat

    # ------------------------------------------------------------------ listing

    def committed_ranks(self, step: int) -> dict[int, set[int]]:
        """world_size -> ranks whose part of `step` is committed (bridges aside)."""
        ranks: dict[int, set[int]] = defaultdict(set)
        for name in self.objects.list(fmt.step_dir(step)):
            parsed = fmt.parse_part_name(name)
            if parsed and not parsed.bridge:
                ranks[parsed.world_size].add(parsed.rank)
        return ranks

    def is_complete(self, step: int, world_size: int) -> bool:
        """Whether every rank of `world_size` committed its part of `step`."""
        return len(self.committed_ranks(step).get(world_size, ())) == world_size

    def published_steps(self, after: int | None = None) -> list[int]:
        """Steps whose folder exists, ascending (complete or not); with `after`, only later ones.

        One listing of `steps/` names the blocks; with `after`, only the blocks from `after`'s on
        are listed, so a follower's poll costs two listings at step 10 and at step 10 million.
        """
        first = 0 if after is None else after // fmt.STEPS_PER_BLOCK
        steps = []
        for block in self._names("steps", fmt.parse_block_name):
            if block >= first:
                steps += self._names(fmt.block_dir(block), functools.partial(_step_in, block=block))
        return sorted(s for s in steps if after is None or s > after)

    def _names(self, key: str, parse: Callable[[str], int | None]) -> list[int]:
        """The entries below `key` that `parse` reads; the others are logged once and ignored."""
        found = []
        for name in self.objects.list(key):
            value = parse(name)
            if value is not None:
                found.append(value)
            elif (key, name) not in self._ignored:
                self._ignored.add((key, name))
                log.warning("ignoring %s/%s/%s: not a name this format writes", self.url, key, name)
        return found

    # ------------------------------------------------------------------ parts

    def read_marker(self, step: int, rank: int, world_size: int, *, bridge: bool = False) -> fmt.CommitMarker:
        where = fmt.commit_path(step, rank, world_size, bridge=bridge)
        marker = self._read(where, fmt.MAX_MARKER_BYTES, fmt.decode_commit)
        if marker is None:
            raise SnapshotNotFoundError(f"{self.url}/{where} does not exist: the part is not committed")
        if marker.prev_step is not None and marker.prev_step >= step:
            raise FormatError(f"{self.url}/{where}: a delta at step {step} against the later step {marker.prev_step}")
        if self.trust is not None:
            place = fmt.PartPlace(step, rank, world_size, bridge)
            self.trust.check_part(self.run(), marker, place, f"{self.url}/{where}")
        return marker

    def part_refs(self, step: int, rank: int, world_size: int) -> list[PartRef]:
        """What a rank committed at `step`, from its markers: its part and, beside a base, its
        bridge if it wrote one.  Empty if the rank's part is not committed."""
        try:
            marker = self.read_marker(step, rank, world_size)
        except SnapshotNotFoundError:
            return []
        refs = [_ref(step, marker, bridge=False)]
        if marker.kind == fmt.Kind.BASE:
            try:
                bridge = self.read_marker(step, rank, world_size, bridge=True)
            except SnapshotNotFoundError:
                return refs
            if bridge.kind == fmt.Kind.DELTA:
                refs.append(_ref(step, bridge, bridge=True))
        return refs

    def read_head(self, ref: PartRef, rank: int, world_size: int) -> fmt.Head:
        """A committed part's header and payload table (`ref` from `part_refs`), with two ranged
        reads; nothing is verified beyond their own rules and where the part was found."""
        key = fmt.blob_path(ref.step, rank, world_size, bridge=ref.bridge)
        prefix = self.objects.get(key, 0, fmt.PREFIX_BYTES)
        if prefix is None:
            raise MissingObjectError(f"{self.url}/{key} is committed but missing (not there yet, or lost)", key)
        try:
            end = fmt.head_end(prefix, ref.size)
            head = self.objects.get(key, 0, end)
            if head is None or len(head) != end:
                raise FormatError(f"is shorter than its commit marker says ({ref.size} bytes)")
            parsed = fmt.decode_head(head)
            fmt.check_placed(parsed.header, ref.step, rank, world_size)
        except FormatError as err:
            raise FormatError(f"{self.url}/{key}: {err}") from None
        return parsed

    def read_object(self, ref: PartRef, rank: int, world_size: int) -> bytes:
        """A committed part's bytes, read with its marker's size as the bound (nothing more is
        checked: `read_blob` and `reader.ChainReader.parse` check them against the marker)."""
        key = fmt.blob_path(ref.step, rank, world_size, bridge=ref.bridge)
        blob = self._read(key, ref.size, lambda data: data)
        if blob is None:
            raise MissingObjectError(f"{self.url}/{key} is committed but missing (not there yet, or lost)", key)
        return blob

    def read_blob(self, ref: PartRef, rank: int, world_size: int) -> bytes:
        """A committed part's bytes, checked against its marker (size and SHA-256) as `ref`
        carries it from `part_refs`."""
        blob = self.read_object(ref, rank, world_size)
        try:
            fmt.verify_blob(blob, ref.marker)
        except (FormatError, ChecksumError) as err:
            raise type(err)(
                f"{self.url}/{fmt.blob_path(ref.step, rank, world_size, bridge=ref.bridge)}: {err}"
            ) from None
        return blob

    def read_part(self, step: int, rank: int, world_size: int, *, bridge: bool = False) -> fmt.Part:
        """A committed part, checked against its marker and parsed (what tools and tests read)."""
        run = self.run()
        if world_size != run.world_size:
            raise SnapshotNotFoundError(f"{self.url}: the run has {run.world_size} ranks, not {world_size}")
        ref = _ref(step, self.read_marker(step, rank, world_size, bridge=bridge), bridge=bridge)
        blob = self.read_blob(ref, rank, world_size)
        try:
            return fmt.parse_part(blob, ref, rank, run)
        except (FormatError, ChainError) as err:
            raise type(err)(f"{self.url}/{fmt.blob_path(step, rank, world_size, bridge=bridge)}: {err}") from None


def _step_in(name: str, block: int) -> int | None:
    return fmt.parse_step_name(name, block)


def _ref(step: int, marker: fmt.CommitMarker, *, bridge: bool) -> PartRef:
    return PartRef(step, marker.kind, marker.prev_step, marker.size, bridge, marker.sha256, marker.signature)


def as_store(
    store: str | Store, storage_options: Mapping[str, Any] | None = None, *, trust: Trust | None = None
) -> Store:
    """Accept a URL or an existing Store wherever a store is expected; with `trust`, a Store that
    checks signatures against it (over the same objects, if `store` trusts other keys or none)."""
    if isinstance(store, Store):
        if storage_options:
            raise ValueError("storage_options apply to a URL, not to an existing Store")
        if trust is not None and store.trust != trust:
            return Store(store.objects, trust=trust)
        return store
    return Store(store, storage_options, trust=trust)
