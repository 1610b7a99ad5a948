"""Bytes in and out of one prefix: the object-store protocol the chain is built on, and fsspec's.

`store.Store` (the chain's layout and commit protocol) knows only the few verbs of `ObjectStore`,
so a test fakes a store with a dict, and another backend is one class.  The verbs answer the
protocol's own questions with values (an absent object is `None`, a taken name is `False`); every
failure to reach or use the store is one `StoreError` line that names the URL, where requests go
and what failed, never a credential.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import DeltaError, FormatError, StoreError

__all__ = ["SLOW_SECONDS", "FsspecObjects", "ObjectStore"]

log = logging.getLogger(__name__)

SLOW_SECONDS = 10
"""A request still unanswered after this long is logged once, so silent retries never look like a hang."""


class ObjectStore(Protocol):
    """Objects addressed by '/'-separated keys below one prefix."""

    url: str
    bytes_read: int
    """Bytes of every object read so far: what a reader's traffic is, counted in one place."""

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        """Bytes `[start, end)` of the object (all of it by default); None if it does not exist.
        A folder where an object should be is damage: `FormatError`."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Write the object so that readers see all of it or nothing."""
        ...

    def create(self, key: str, data: bytes) -> bool:
        """`put`, only if no object has the name (atomically); False, writing nothing, if one has."""
        ...

    def list(self, key: str) -> list[str]:
        """Base names of the entries directly below `key`, sorted; empty if there is none."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Remove the objects (a folder found under one of the names goes too: it is damage)."""
        ...

    def delete_prefix(self, key: str) -> None:
        """Everything below `key`, and the folder itself where folders exist."""
        ...


class FsspecObjects:
    """`ObjectStore` over any fsspec file system: a local directory, S3, GCS, Azure, memory.

    URLs stay strings: `pathlib` would collapse the `//` of `s3://bucket`.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        # An instance of our own: fsspec caches and shares instances, and a transaction opened on a
        # shared one (Lightning saves checkpoints inside `fs.transaction`) would defer our writes.
        options = {"skip_instance_cache": True, **(storage_options or {})}
        fs, root = fsspec.core.url_to_fs(self.url, **options)
        endpoint = (options.get("client_kwargs") or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
        self._bind(fs, root, endpoint)

    @classmethod
    def over(cls, fs: fsspec.AbstractFileSystem, root: str) -> FsspecObjects:
        """Objects below `root` of an existing file system (a test's, with faults of its own)."""
        objects = cls.__new__(cls)
        objects.url = f"{fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]}://{root}"
        objects._bind(fs, root, None)
        return objects

    def _bind(self, fs: fsspec.AbstractFileSystem, root: str, endpoint: str | None) -> None:
        self._fs, self._root = fs, root.rstrip("/")
        self._local = isinstance(fs, LocalFileSystem)
        # Where requests go, for errors a user acts on: which server, or that there is none.
        self.where = "the local file system" if self._local else f"endpoint {endpoint or 'the client default'}"
        self._said_slow = False
        self.bytes_read = 0

    def __repr__(self) -> str:
        return f"FsspecObjects({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        try:
            with self._request(f"reading {key}"):
                data = self._fs.cat_file(self._path(key), start=start or None, end=end)
        except FileNotFoundError:
            return None
        except (IsADirectoryError, NotADirectoryError):
            raise FormatError(f"{self.url}/{key} is a folder, not an object") from None
        self.bytes_read += len(data)
        return data

    def put(self, key: str, data: bytes) -> None:
        self._write(key, data, exclusive=False)

    def create(self, key: str, data: bytes) -> bool:
        return self._write(key, data, exclusive=True)

    def _write(self, key: str, data: bytes, exclusive: bool) -> bool:
        """S3 checks an exclusive write atomically (If-None-Match); a local file system through a
        hard link, which fails if the name is taken.  Locally each object is written under a
        temporary name first, so a reader never opens a half-written file."""
        path = self._path(key)
        with self._request(f"writing {key}", local_writes=True):
            if not self._local:
                try:
                    self._fs.pipe_file(path, data, mode="create" if exclusive else "overwrite")
                except FileExistsError:
                    return False
                except FileNotFoundError:
                    raise StoreError(f"{self.url} ({self.where}): the bucket does not exist") from None
                return True
            self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            temp = f"{path}.tmp-{uuid.uuid4().hex}"
            self._fs.pipe_file(temp, data)
            if not exclusive:
                self._fs.mv(temp, path)
                return True
            try:
                os.link(temp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(temp)
            return True

    def list(self, key: str) -> list[str]:
        path = self._path(key)
        self._fs.invalidate_cache(path)  # a follower polls: a cached listing would hide new steps
        try:
            with self._request(f"listing {key}"):
                entries = self._fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]
        if paths:
            with self._request(f"deleting {len(paths)} objects", local_writes=True):
                self._fs.rm(paths, recursive=True)

    def delete_prefix(self, key: str) -> None:
        with self._request(f"deleting {key}", local_writes=True):
            self._fs.rm(self._path(key), recursive=True)

    @contextlib.contextmanager
    def _request(self, action: str, local_writes: bool = False) -> Iterator[None]:
        """One request: a failure to reach or use the store becomes a `StoreError`; the protocol's
        own answers (absent, taken, a folder) pass through to the verbs, except where a local write
        meets them: a prefix under a regular file, say, is a store that cannot be used."""
        timer = threading.Timer(SLOW_SECONDS, self._slow, args=(action,))
        timer.daemon = True
        timer.start()
        try:
            yield
        except DeltaError:
            raise
        except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError) as err:
            if not (local_writes and self._local):
                raise
            raise StoreError(f"{self.url} ({self.where}): {_os_failure(err)} while {action}") from None
        except Exception as err:
            what = _failure(err)
            if what is None:
                raise
            raise StoreError(f"{self.url} ({self.where}): {what} while {action}") from None
        finally:
            timer.cancel()

    def _slow(self, action: str) -> None:
        if not self._said_slow:
            self._said_slow = True
            log.warning(
                "%s: no answer from %s after %d s while %s; the client keeps retrying",
                self.url,
                self.where,
                SLOW_SECONDS,
                action,
            )


def _os_failure(err: OSError) -> str:
    """A local file system's answer, without the temporary names it may carry."""
    reason = err.strerror or type(err).__name__
    if isinstance(err, NotADirectoryError):
        return f"{reason} (a part of the path is a regular file)"
    return reason


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
        return f"the store failed ({type(err).__name__}{f': {err.strerror}' if err.strerror else ''})"
    return None
