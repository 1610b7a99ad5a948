"""Where snapshots live: a narrow object interface over fsspec, and the commit protocol.

Commit protocol (no rename needed, so it holds on S3 too): a rank writes its blob, then its
commit marker.  A part counts only once its marker exists, and a step is visible only once
the markers of all the run's ranks exist.  A publisher that dies mid-upload therefore leaves at
most an invisible step behind.  Locally, each object is written to a temporary name and renamed,
so a reader never opens a half-written file either.

Names found by listing are hints: only those that match their exact pattern count, and every
object is read with a bound (its marker's size, or the format's cap for JSON objects), so a
damaged or hostile store costs at most what the run's own objects would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import format as fmt
from .errors import DeltaError, FormatError, SnapshotNotFoundError, StoreError
from .paths import PartRef

__all__ = ["Store", "as_store"]

log = logging.getLogger(__name__)


class Store:
    """Objects addressed by '/'-separated keys below one fsspec URL (a plain path works).

    URLs stay strings: `pathlib` would collapse the `//` of `s3://bucket`.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        # An instance of our own: fsspec caches and shares instances, and a transaction opened on a
        # shared one (Lightning saves checkpoints inside `fs.transaction`) would defer our writes.
        options = {"skip_instance_cache": True, **(storage_options or {})}
        self._fs, self._root = fsspec.core.url_to_fs(self.url, **options)
        endpoint = (options.get("client_kwargs") or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
        self._said_slow = False
        self._root = self._root.rstrip("/")
        self._local = isinstance(self._fs, LocalFileSystem)
        # Where requests go, for errors a user acts on: which server, or that there is none.
        self._where = "the local file system" if self._local else f"endpoint {endpoint or 'the client default'}"
        self._run: fmt.Run | None = None
        self._ignored: set[tuple[str, str]] = set()
        self.bytes_read = 0
        """Bytes of every object read so far (markers, headers, blobs, the manifest): what a
        reader's traffic is, counted in one place."""

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def read(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes; FileNotFoundError if it does not exist.

        With `limit`, at most `limit + 1` bytes are fetched and a larger object is a `FormatError`:
        a reader never holds more than the bound it expects.
        """
        try:
            with self._request(f"reading {key}"):
                if limit is None:
                    data = self._fs.cat_file(self._path(key))
                else:
                    data = self._fs.cat_file(self._path(key), start=0, end=limit + 1)
        except (IsADirectoryError, NotADirectoryError):
            raise FormatError(f"{self.url}/{key} is a folder, not an object") from None
        self.bytes_read += len(data)
        if limit is None:
            return data
        if len(data) > limit:
            raise FormatError(f"{self.url}/{key} is larger than the {limit} bytes expected")
        return data

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write an object so that readers see all of it or nothing.

        With `exclusive`, FileExistsError if the object exists: S3 checks that atomically
        (If-None-Match), local files through a hard link, which fails if the name is taken.
        """
        path = self._path(key)
        if not self._local:
            try:
                with self._request(f"writing {key}"):
                    self._fs.pipe_file(path, data, mode="create" if exclusive else "overwrite")
            except FileNotFoundError:
                raise StoreError(f"{self.url} ({self._where}): the bucket does not exist") from None
            return
        self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        self._fs.pipe_file(temp, data)
        if not exclusive:
            self._fs.mv(temp, path)
            return
        try:
            os.link(temp, path)
        finally:
            os.unlink(temp)

    def list(self, key: str) -> list[str]:
        """Base names of the entries directly below `key`; empty if there is none."""
        path = self._path(key)
        self._fs.invalidate_cache(path)  # a follower polls: a cached listing would hide new steps
        try:
            with self._request(f"listing {key}"):
                entries = self._fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def delete(self, keys: Iterable[str]) -> None:
        """Remove the objects (a folder found under one of the names goes too: it is damage)."""
        paths = [self._path(k) for k in keys]
        if paths:
            with self._request(f"deleting {len(paths)} objects"):
                self._fs.rm(paths, recursive=True)

    def delete_folder(self, key: str) -> None:
        """Everything below `key`, and the folder itself where folders exist."""
        with self._request(f"deleting {key}"):
            self._fs.rm(self._path(key), recursive=True)

    @contextlib.contextmanager
    def _request(self, action: str) -> Iterator[None]:
        """One request to the store: a failure to reach or use it becomes one `StoreError` line
        that names the URL, the endpoint and what failed; the protocol's own answers (an object
        absent, or present where it was created exclusively) pass through.  A request still
        unanswered after `SLOW_SECONDS` is logged once, so silent retries never look like a hang."""
        timer = threading.Timer(SLOW_SECONDS, self._slow, args=(action,))
        timer.daemon = True
        timer.start()
        try:
            yield
        except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, DeltaError):
            raise
        except Exception as err:
            what = _failure(err)
            if what is None:
                raise
            raise StoreError(f"{self.url} ({self._where}): {what} while {action}") from None
        finally:
            timer.cancel()

    def _slow(self, action: str) -> None:
        if not self._said_slow:
            self._said_slow = True
            log.warning(
                "%s: no answer from %s after %d s while %s; the client keeps retrying",
                self.url,
                self._where,
                SLOW_SECONDS,
                action,
            )

    # ------------------------------------------------------------------ commit protocol

    def commit_part(self, header: fmt.PartHeader, blob: bytes, *, bridge: bool = False) -> int:
        """Publish one rank's part: the blob first, then the marker that makes it count; returns
        the bytes written (blob and marker).

        Both are created exclusively, so two publishers can never interleave one chain: the
        second to reach a step gets FileExistsError and the first one's part stays intact.
        """
        where = (header.step, header.rank, header.world_size)
        key = fmt.blob_path(*where, bridge=bridge)
        marker = fmt.encode_commit(blob, header)
        try:
            self.write(key, blob, exclusive=True)
            self.write(fmt.commit_path(*where, bridge=bridge), marker, exclusive=True)
        except FileExistsError:
            raise FileExistsError(
                f"{self.url}/{key} already exists: another publisher wrote this step of the chain; "
                "give each run its own store prefix"
            ) from None
        return len(blob) + len(marker)

    # ------------------------------------------------------------------ the run

    def manifest(self) -> fmt.Run | None:
        """The run that owns this prefix; None while no publisher has claimed it.

        It is never rewritten, so once read it is kept.
        """
        if self._run is None:
            try:
                data = self.read(fmt.RUN_MANIFEST, fmt.MAX_MANIFEST_BYTES)
            except FileNotFoundError:
                return None
            try:
                self._run = fmt.decode_manifest(data)
            except FormatError as err:
                raise FormatError(f"{self.url}/{fmt.RUN_MANIFEST}: {err}") from None
        return self._run

    def claim(self, manifest: fmt.RunManifest) -> fmt.Run:
        """Make this prefix `manifest`'s run: create the manifest, or find one there already.

        Returns the run in the store, which is another one if the prefix was taken.
        """
        data = fmt.encode_manifest(manifest)
        try:
            self.write(fmt.RUN_MANIFEST, data, exclusive=True)
        except FileExistsError:
            found = self.manifest()
            assert found is not None  # created exclusively, never deleted
            return found
        self._run = fmt.decode_manifest(data)
        return self._run

    # ------------------------------------------------------------------ listing

    def committed_ranks(self, step: int) -> dict[int, set[int]]:
        """world_size -> ranks whose part of `step` is committed (bridges aside)."""
        ranks: dict[int, set[int]] = defaultdict(set)
        for name in self.list(fmt.step_dir(step)):
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
                steps += self._names(fmt.block_dir(block), lambda n, b=block: fmt.parse_step_name(n, b))
        return sorted(s for s in steps if after is None or s > after)

    def _names(self, key: str, parse: Any) -> list[int]:
        """The entries below `key` that `parse` reads; the others are logged once and ignored."""
        found = []
        for name in self.list(key):
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
        try:
            marker = fmt.decode_commit(self.read(where, fmt.MAX_MARKER_BYTES))
        except FileNotFoundError:
            raise SnapshotNotFoundError(f"{self.url}/{where} does not exist: the part is not committed") from None
        except FormatError as err:
            raise FormatError(f"{self.url}/{where}: {err}") from None
        if marker.prev_step is not None and marker.prev_step >= step:
            raise FormatError(f"{self.url}/{where}: a delta at step {step} against the later step {marker.prev_step}")
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
            with contextlib.suppress(SnapshotNotFoundError):
                bridge = self.read_marker(step, rank, world_size, bridge=True)
                if bridge.kind == fmt.Kind.DELTA:
                    refs.append(_ref(step, bridge, bridge=True))
        return refs

    def read_head(self, ref: PartRef, rank: int, world_size: int) -> fmt.Head:
        """A committed part's header and payload table (`ref` from `part_refs`), with two ranged
        reads; nothing is verified beyond their own rules (`read_blob` and `parse_part` check the rest)."""
        step, size = ref.step, ref.size
        where = fmt.blob_path(step, rank, world_size, bridge=ref.bridge)
        try:
            with self._request(f"reading {where}"):
                prefix = self._fs.cat_file(self._path(where), start=0, end=fmt.PREFIX_BYTES)
                end = fmt.head_end(prefix, size)
                head = self._fs.cat_file(self._path(where), start=0, end=end)
            self.bytes_read += len(prefix) + len(head)
            if len(head) != end:
                raise FormatError(f"object is shorter than its commit marker says ({size} bytes)")
            parsed = fmt.decode_head(head)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise FormatError(f"{self.url}/{where} is committed but missing") from None
        except FormatError as err:
            raise FormatError(f"{self.url}/{where}: {err}") from None
        self._placed(parsed.header, step, rank, world_size, where)
        return parsed

    def read_blob(self, ref: PartRef, rank: int, world_size: int) -> bytes:
        """A committed part's bytes, checked against its marker (size and SHA-256) as `ref`
        carries it from `part_refs`."""
        where = fmt.blob_path(ref.step, rank, world_size, bridge=ref.bridge)
        try:
            blob = self.read(where, ref.size)
        except FileNotFoundError:
            raise FormatError(f"{self.url}/{where} is committed but missing") from None
        fmt.verify_blob(blob, fmt.CommitMarker(ref.size, ref.sha256, ref.kind, ref.prev_step), f"{self.url}/{where}")
        return blob

    def read_part(self, step: int, rank: int, world_size: int, *, bridge: bool = False) -> fmt.Part:
        """A committed part, checked against its marker and parsed (what tools and tests read)."""
        ref = _ref(step, self.read_marker(step, rank, world_size, bridge=bridge), bridge=bridge)
        return self.parse_part(self.read_blob(ref, rank, world_size), ref, rank, world_size)

    def parse_part(self, blob: bytes, ref: PartRef, rank: int, world_size: int) -> fmt.Part:
        """The parsed blob of a part, which must be what its marker says and where it was found."""
        where = fmt.blob_path(ref.step, rank, world_size, bridge=ref.bridge)
        try:
            part = fmt.decode_blob(blob)
        except FormatError as err:
            raise FormatError(f"{self.url}/{where}: {err}") from None
        header = self._placed(part.header, ref.step, rank, world_size, where)
        if (header.kind, header.prev_step) != (ref.kind, ref.prev_step):
            raise FormatError(f"{self.url}/{where}: its header and its commit marker disagree on what it is")
        return part

    def _placed(self, header: fmt.PartHeader, step: int, rank: int, world_size: int, where: str) -> fmt.PartHeader:
        """`header`, if it belongs where it was found (a copied or foreign object does not)."""
        if (header.step, header.rank, header.world_size) != (step, rank, world_size):
            raise FormatError(f"{self.url}/{where} holds step {header.step} rank {header.rank} of {header.world_size}")
        return header

    # ------------------------------------------------------------------ retention

    def is_base_step(self, step: int, world_size: int) -> bool:
        """Whether `step` is complete and every rank's part of it is a base: a chain starts there."""
        return self.is_complete(step, world_size) and all(
            self.read_marker(step, rank, world_size).kind == fmt.Kind.BASE for rank in range(world_size)
        )

    def collect(self, keep_bases: int, *, dry_run: bool = False) -> list[int]:
        """Delete every step older than the `keep_bases`-th newest complete base step.

        Nothing a reader can still rebuild from the kept bases is touched: every part after a
        complete base chains back no further than it.  Steps go newest first, each one's markers
        before anything else, so if the deleter dies at any moment every step that is still
        complete still rebuilds (what it leads back to is all older).  Returns the deleted steps
        (with `dry_run`, those it would delete, deleting nothing).
        """
        if keep_bases < 1:
            raise ValueError(f"keep_bases must be >= 1, got {keep_bases}")
        manifest = self.manifest()
        if manifest is None:
            return []
        steps, found, cutoff = self.published_steps(), 0, None
        for step in reversed(steps):
            if self.is_base_step(step, manifest.world_size):
                found += 1
                if found == keep_bases:
                    cutoff = step
                    break
        doomed = [s for s in steps if cutoff is not None and s < cutoff]
        for step in [] if dry_run else reversed(doomed):
            folder = fmt.step_dir(step)
            self.delete(f"{folder}/{n}" for n in self.list(folder) if n.endswith(".commit"))
            self.delete_folder(folder)
        return doomed


SLOW_SECONDS = 10


def _ref(step: int, marker: fmt.CommitMarker, *, bridge: bool) -> PartRef:
    return PartRef(step, marker.kind, marker.prev_step, marker.size, bridge, marker.sha256)


def _failure(err: Exception) -> str | None:
    """What went wrong, in a user's words, from the error's class (botocore's, s3fs's, the OS's);
    None for errors that are not about reaching or using the store."""
    names = {cls.__name__ for cls in type(err).__mro__}
    if names & {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}:
        return "no usable credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, or a role)"
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError"}:
        return "the endpoint is unreachable"
    if "ConnectionError" in names:  # botocore's and the OS's
        return "the connection failed"
    if isinstance(err, PermissionError):
        return "access denied"
    if isinstance(err, OSError):
        return f"the store failed ({type(err).__name__})"
    return None


def as_store(store: str | Store, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Accept a URL or an existing Store wherever a store is expected."""
    if isinstance(store, Store):
        if storage_options:
            raise ValueError("storage_options apply to a URL, not to an existing Store")
        return store
    return Store(store, storage_options)
