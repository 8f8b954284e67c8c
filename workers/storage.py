"""The output location: one fsspec filesystem and a root prefix; every key is relative to it.

Only this module talks to fsspec for writing, so any backend fsspec knows (local paths,
`file://`, `s3://`, `gs://`, `memory://`) works the same, and a missing backend fails with the
package to install.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Callable
from typing import IO, TypeVar

import fsspec

from fleetgen.errors import StorageError

# Backends that fsspec loads lazily, and the pip extra that brings each.
T = TypeVar("T")
ATTEMPTS = 4  # per storage operation; waits 0.5 s, 1 s, 2 s between them
BACKOFF = 0.5  # seconds before the first retry, doubling
# Errors no retry can fix: fail at once, naming the URL.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError)

S3_PAGE = 1000  # keys per listing page, and the most one DeleteObjects request takes
TMP_MARK = ".tmp-"  # in the name of a local file being written; renamed away when complete

_BACKEND_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def url_to_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """`fsspec.core.url_to_fs`, with a message that names the package when a backend is missing."""
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        scheme = url.split("://", 1)[0] if "://" in url else "file"
        package = _BACKEND_PACKAGES.get(scheme, f"the fsspec backend for `{scheme}://`")
        raise StorageError(
            f"`{url}` needs {package}, which is not installed. Run `pip install {package}`."
        ) from err
    except ValueError as err:
        raise StorageError(f"`{url}` is not a URL fsspec understands: {err}") from err


def version_of(entry: dict) -> str:
    """An object's version from a listing entry or `info()`: its size and ETag (object stores) or
    modification time (local disks); it changes when the object is replaced."""
    stamp = entry.get("ETag") or entry.get("mtime") or entry.get("LastModified") or entry.get("updated")
    return f"{entry.get('size')}:{stamp}"


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


class Output:
    """A job's output location (`OUT`). Keys are POSIX paths relative to it (`shards/x.parquet`)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        self.local = _is_local(self.fs)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.s3 = bool({"s3", "s3a"} & set(protocols))

    @property
    def atomic_create(self) -> bool:
        """Whether `create` is atomic here: local disks (a hard link) and S3 (a conditional PUT,
        If-None-Match). Elsewhere it is a check, then a write."""
        return self.local or self.s3

    def path(self, key: str) -> str:
        return posixpath.join(self.root, key) if key else self.root

    def key_url(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _retry(self, what: str, key: str, op: Callable[[], T]) -> T:
        """Run `op`, retrying transient errors with backoff; a persistent one becomes a
        `StorageError` naming the URL."""
        for attempt in range(ATTEMPTS):
            try:
                return op()
            except _PERMANENT as err:
                raise StorageError(f"Could not {what} {self.key_url(key)}: {err}") from err
            except (OSError, TimeoutError) as err:
                if attempt == ATTEMPTS - 1:
                    raise StorageError(f"Could not {what} {self.key_url(key)} after {ATTEMPTS} attempts: {err}") from err
                time.sleep(BACKOFF * 2**attempt)
        raise AssertionError("unreachable")

    def put(self, key: str, data: bytes) -> None:
        """Write one object whole. Readers never see a partial object: object stores put
        atomically, and on a local disk we write a temporary file and rename it."""
        path = self.path(key)

        def write() -> None:
            if self.local:
                self.fs.mv(self._local_tmp(path, data), path)
            else:
                self.fs.pipe_file(path, data)

        self._retry("write", key, write)

    def _local_tmp(self, path: str, data: bytes) -> str:
        """`data` in a temporary file beside `path` (local disks), to be renamed or linked there."""
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:8]}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        return tmp

    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist; False when it does (another writer was first).
        Atomic where `atomic_create` says so."""
        path = self.path(key)

        def write() -> bool:
            if self.local:
                tmp = self._local_tmp(path, data)
                try:
                    os.link(tmp, path)  # fails if `path` exists: the atomic create-if-absent of POSIX
                    return True
                except FileExistsError:
                    return False
                finally:
                    os.remove(tmp)
            if self.s3:
                try:
                    self.fs.pipe_file(path, data, mode="create")
                    return True
                except FileExistsError:  # 412 Precondition Failed
                    return False
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

        return self._retry("create", key, write)

    def move(self, src: str, dst: str) -> None:
        """Move an object to another key, replacing what is there (local: a rename; object stores:
        copy, then delete)."""
        def move() -> None:
            if self.local:
                self.fs.makedirs(posixpath.dirname(self.path(dst)), exist_ok=True)
            self.fs.mv(self.path(src), self.path(dst))

        self._retry("move", src, move)

    def prune(self, prefix: str) -> None:
        """Remove `prefix/` and its parents up to the root while they are empty directories (local
        disks keep empty directories; object stores have none)."""
        if not self.local:
            return
        while prefix:
            try:
                os.rmdir(self.path(prefix))
            except OSError:  # not empty, or gone
                return
            prefix = posixpath.dirname(prefix)

    def find(self, prefix: str) -> list[str]:
        """Keys of every object under `prefix/`, recursively, sorted."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        """{key: bytes} of every object under `prefix/`, recursively, from one listing."""
        try:
            found = self.fs.find(self.path(prefix), detail=True)
        except FileNotFoundError:
            return {}
        except OSError as err:
            raise StorageError(f"Could not list {self.key_url(prefix)}: {err}") from err
        root = self.root.rstrip("/") + "/"
        keys = {posixpath.normpath(p): info.get("size") for p, info in found.items()}
        return {p[len(root):] if p.startswith(root) else p: size for p, size in keys.items()}

    def sweep_tmp(self, prefix: str) -> int:
        """Remove temporary files a killed writer left under `prefix/` (local disks only: object
        stores never show a partial object). Returns how many."""
        if not self.local or not self.fs.exists(self.path(prefix)):
            return 0
        stale = [p for p in self.fs.find(self.path(prefix)) if TMP_MARK in posixpath.basename(p)]
        for p in stale:
            self.fs.rm_file(p)
        return len(stale)

    def open_write(self, key: str) -> IO[bytes]:
        """A stream for a large object written piece by piece (a shard's tar or Parquet file).
        The object appears whole at `close()` (local disks: a temporary file renamed; object
        stores: the upload completes), or not at all after `discard(stream)`."""
        path = self.path(key)

        def open_() -> IO[bytes]:
            if self.local:
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                return _RenameOnClose(self.fs, path)
            return self.fs.open(path, "wb")

        return self._retry("open for writing", key, open_)

    @staticmethod
    def discard(stream: IO[bytes]) -> None:
        """Abandon a stream from `open_write`: nothing appears at its key."""
        discard = getattr(stream, "discard", None)
        if discard is not None:
            discard()  # local: removes the temporary file; fsspec buffered files: aborts the (multipart) upload
            if hasattr(stream, "closed") and not isinstance(stream, _RenameOnClose):
                stream.closed = True  # so that garbage collection does not flush (and complete) it

    def get(self, key: str) -> bytes:
        """The object's bytes; `FileNotFoundError` when absent."""
        path = self.path(key)
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise
        except OSError:
            return self._retry("read", key, lambda: self.fs.cat_file(path))

    def version(self, key: str) -> str:
        """The object's version (`version_of`), as a listing of its prefix would give it."""
        return version_of(self._retry("look at", key, lambda: self.fs.info(self.path(key))))

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def list(self, prefix: str, suffix: str = "", temporary: bool = False) -> list[str]:
        """Names (not keys) of the objects directly under `prefix/` ending in `suffix`, sorted;
        temporary files of local writers only with `temporary`."""
        try:
            entries = self.fs.ls(self.path(prefix), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as err:
            raise StorageError(f"Could not list {self.key_url(prefix)}: {err}") from err
        names = (posixpath.basename(e.rstrip("/")) for e in entries)
        return sorted(n for n in names if n.endswith(suffix) and (temporary or TMP_MARK not in n))

    def remove(self, key: str) -> None:
        """Remove an object or a whole prefix; absent is fine. A prefix goes page by page as it is
        listed (local disks: a directory walk; S3: 1,000 keys per listing page, deleted in one
        request), so memory does not grow with the number of objects; elsewhere fsspec lists the
        prefix first."""
        path = self.path(key)
        try:
            if self.local:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.lexists(path):
                    os.remove(path)
            elif self.s3:
                self._remove_s3(path)
            elif self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise StorageError(f"Could not remove {self.key_url(key)}: {err}") from err

    def _remove_s3(self, path: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        page: dict = {"NextContinuationToken": None}
        while "NextContinuationToken" in page:
            token = page["NextContinuationToken"]
            page = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{key}/", MaxKeys=S3_PAGE,
                                   **({"ContinuationToken": token} if token else {}))
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                done = self.fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
                if done.get("Errors"):  # per-key failures come back in a 200 answer, not as an exception
                    first = done["Errors"][0]
                    raise OSError(f"{len(done['Errors'])} key(s) not deleted, e.g. {first.get('Key')}: "
                                  f"{first.get('Code')} {first.get('Message')}")
        self.fs.call_s3("delete_object", Bucket=bucket, Key=key)  # the object at the key itself (absent: a no-op)
        self.fs.invalidate_cache(path)


class _RenameOnClose:
    """A local file written under a temporary name and renamed to `path` when closed."""

    def __init__(self, fs, path: str):
        self._fs, self._path = fs, path
        self._tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:8]}"
        self._file = fs.open(self._tmp, "wb")

    def __getattr__(self, name):
        return getattr(self._file, name)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            self._fs.mv(self._tmp, self._path)

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._fs.exists(self._tmp):
            self._fs.rm_file(self._tmp)
