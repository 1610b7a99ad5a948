"""Where snapshots live: a narrow object interface over fsspec, and the commit protocol.

Commit protocol (no rename needed, so it holds on S3 too): a rank writes its blob, then its
commit marker.  A part counts only once its marker exists, and a step is visible only once
the markers of all `world_size` ranks exist.  A publisher that dies mid-upload therefore
leaves at most an invisible step behind.  Locally, each object is written to a temporary name
and renamed, so a reader never opens a half-written file either.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import format as fmt
from .errors import FormatError, SnapshotNotFoundError

__all__ = ["Store", "as_store"]


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
        self._root = self._root.rstrip("/")
        self._local = isinstance(self._fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def read(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError if it does not exist."""
        return self._fs.cat_file(self._path(key))

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write an object so that readers see all of it or nothing.

        With `exclusive`, FileExistsError if the object exists: S3 checks that atomically
        (If-None-Match), local files through a hard link, which fails if the name is taken.
        """
        path = self._path(key)
        if not self._local:
            self._fs.pipe_file(path, data, mode="create" if exclusive else "overwrite")
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
            entries = self._fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]
        if paths:
            self._fs.rm(paths)

    # ------------------------------------------------------------------ commit protocol

    def commit_part(self, step: int, rank: int, world_size: int, blob: bytes) -> None:
        """Publish one rank's part: the blob first, then the marker that makes it count.

        Both are created exclusively, so two publishers can never interleave one chain: the
        second to reach a step gets FileExistsError and the first one's part stays intact.
        """
        key = fmt.blob_path(step, rank, world_size)
        try:
            self.write(key, blob, exclusive=True)
            self.write(fmt.commit_path(step, rank, world_size), fmt.encode_commit(blob), exclusive=True)
        except FileExistsError:
            raise FileExistsError(
                f"{self.url}/{key} already exists: another publisher wrote this step of the chain; "
                "give each run its own store prefix"
            ) from None

    def committed_ranks(self, step: int) -> dict[int, set[int]]:
        """world_size -> ranks whose part of `step` is committed."""
        ranks: dict[int, set[int]] = defaultdict(set)
        for name in self.list(fmt.step_dir(step)):
            parsed = fmt.parse_part_name(name)
            if parsed:
                ranks[parsed[1]].add(parsed[0])
        return ranks

    def published_steps(self, after: int | None = None) -> list[int]:
        """Steps whose folder exists, ascending (complete or not); with `after`, only later ones.

        With `after` and the `latest` pointer, only the blocks from `after`'s to the pointer's
        are listed: a follower's poll costs the same at step 10 and at step 10 million.
        """
        latest = self.latest() if after is not None else None
        if after is not None and latest is not None:
            blocks: Iterable[int] = range(after // fmt.STEPS_PER_BLOCK, max(after, latest) // fmt.STEPS_PER_BLOCK + 1)
        else:
            blocks = sorted(int(n) for n in self.list("steps") if n.isdigit())
            if after is not None:
                blocks = [b for b in blocks if b >= after // fmt.STEPS_PER_BLOCK]
        steps = [int(n) for b in blocks for n in self.list(fmt.block_dir(b)) if n.isdigit()]
        return sorted(s for s in steps if after is None or s > after)

    def latest(self) -> int | None:
        """The newest step rank 0 committed, from the `latest` pointer; None without one."""
        try:
            raw = json.loads(self.read(fmt.LATEST))
        except (FileNotFoundError, ValueError):
            return None
        step = raw.get("step") if isinstance(raw, dict) else None
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None

    def advance_latest(self, step: int) -> None:
        """Point `latest` at `step` (rank 0, after committing it): a hint, never trusted for data."""
        self.write(fmt.LATEST, json.dumps({"step": step}).encode())

    def complete_world_size(self, step: int) -> int | None:
        """The world size whose every rank committed `step`, None if no such set exists."""
        complete = [w for w, ranks in self.committed_ranks(step).items() if len(ranks) == w]
        if len(complete) > 1:
            raise FormatError(f"step {step} is complete for several world sizes: {sorted(complete)}")
        return complete[0] if complete else None

    def read_header(self, step: int, rank: int, world_size: int) -> tuple[fmt.PartHeader, int]:
        """A committed part's header and blob size, with two ranged reads; nothing is verified
        beyond the header's own rules (use `read_part` before trusting any values)."""
        where = fmt.blob_path(step, rank, world_size)
        try:
            size, _ = fmt.decode_commit(self.read(fmt.commit_path(step, rank, world_size)))
            end = fmt.header_end(self._fs.cat_file(self._path(where), start=0, end=fmt.PREFIX_BYTES), size)
            header = fmt.decode_header(self._fs.cat_file(self._path(where), start=0, end=end))
        except FileNotFoundError:
            raise SnapshotNotFoundError(f"{self.url}/{where} is not committed") from None
        return self._placed(header, step, rank, world_size), size

    def read_blob(self, step: int, rank: int, world_size: int) -> bytes:
        """A committed part's bytes, checked against its marker (size and SHA-256)."""
        where = fmt.blob_path(step, rank, world_size)
        try:
            marker = self.read(fmt.commit_path(step, rank, world_size))
        except FileNotFoundError:
            raise SnapshotNotFoundError(f"{self.url}/{where} is not committed") from None
        size, digest = fmt.decode_commit(marker)
        try:
            blob = self.read(where)
        except FileNotFoundError:
            raise FormatError(f"{self.url}/{where} is committed but missing") from None
        fmt.verify_blob(blob, size, digest, f"{self.url}/{where}")
        return blob

    def read_part(self, step: int, rank: int, world_size: int) -> tuple[fmt.PartHeader, memoryview]:
        """A committed part, checked against its marker, with its header validated."""
        return self.parse_part(self.read_blob(step, rank, world_size), step, rank, world_size)

    def parse_part(self, blob: bytes, step: int, rank: int, world_size: int) -> tuple[fmt.PartHeader, memoryview]:
        """Header and payload area of the blob of a part, which must belong where it claims."""
        header, payload = fmt.decode_blob(blob)
        return self._placed(header, step, rank, world_size), payload

    def _placed(self, header: fmt.PartHeader, step: int, rank: int, world_size: int) -> fmt.PartHeader:
        """`header`, if it belongs where it was found (a copied or foreign object does not)."""
        if (header.step, header.rank, header.world_size) != (step, rank, world_size):
            where = fmt.blob_path(step, rank, world_size)
            raise FormatError(f"{self.url}/{where} holds step {header.step} rank {header.rank} of {header.world_size}")
        return header

    # ------------------------------------------------------------------ retention

    def is_base_step(self, step: int) -> bool:
        """Whether `step` is complete and every rank's part of it is a base: a chain starts there."""
        world = self.complete_world_size(step)
        return world is not None and all(
            self.read_header(step, rank, world)[0].kind == fmt.Kind.BASE for rank in range(world)
        )

    def collect(self, keep_bases: int) -> list[int]:
        """Delete every step older than the `keep_bases`-th newest complete base step.

        Nothing a reader can still rebuild from the kept bases is touched: every part after a
        complete base chains back no further than it.  Markers go first, so a part is never
        committed without its blob.  Returns the deleted steps.
        """
        if keep_bases < 1:
            raise ValueError(f"keep_bases must be >= 1, got {keep_bases}")
        steps, found, cutoff = self.published_steps(), 0, None
        for step in reversed(steps):
            if self.is_base_step(step):
                found += 1
                if found == keep_bases:
                    cutoff = step
                    break
        doomed = [s for s in steps if cutoff is not None and s < cutoff]
        for step in doomed:
            folder = fmt.step_dir(step)
            self.delete(f"{folder}/{n}" for n in self.list(folder) if n.endswith(".commit"))
            self._fs.rm(self._path(folder), recursive=True)
        return doomed


def as_store(store: str | Store, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Accept a URL or an existing Store wherever a store is expected."""
    if isinstance(store, Store):
        if storage_options:
            raise ValueError("storage_options apply to a URL, not to an existing Store")
        return store
    return Store(store, storage_options)
