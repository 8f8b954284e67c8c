"""The output location: one fsspec filesystem and a root prefix; every key is relative to it.

Only this module talks to fsspec, so any backend fsspec knows (local paths, `file://`, `s3://`,
`gs://`, `az://`, `memory://`) works the same, and a missing backend fails with the package to install.

Every store operation goes through one error policy (workers/output/policy.py). Writes that may be applied
while their answer is lost are written so that doing them twice is harmless (`put`, `move`,
`remove`), or read back (`create`).

`create` (create-if-absent, the commit's primitive: workers/output/commit.py) is atomic on the stores
fleetgen knows: a local disk (a hard link), S3 (a conditional PUT, `If-None-Match: *`), GCS (a write
precondition, `ifGenerationMatch=0`) and Azure Blob (a conditional upload, `If-None-Match: *`) — each
through its fsspec backend's `pipe_file(mode="create")`, which raises `FileExistsError` when the object
is there. Any other backend can only check, then write: a job refuses it unless the user accepts that
(`--allow-unsafe-commits`, `Output.unsafe_commit_reason`). What differs per backend is in
workers/output/backends.py.
"""

from __future__ import annotations

import copy
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO

import fsspec
import fsspec.asyn
import pyarrow as pa

from fleetgen.errors import StorageError, one_line
from fleetgen.workers.output.arrow_io import TMP_MARK, RenameOnClose, parquet_schema, read_parquet
from fleetgen.workers.output.backends import azure_copy, remove_s3_prefix, store_kind
from fleetgen.workers.output.policy import STORAGE_ENV, T, guarded

_BACKEND_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
}
MOVE_THREADS = 32  # concurrent moves of one commit (each a server-side copy and a delete on object stores)


def resolve_url(url: str) -> str:
    """One spelling per location, so every command builds the same keys from it: a local path (plain,
    relative, `..`, `~`, `file://`, through symlinks) becomes its absolute real path; a URL loses its
    trailing slashes."""
    url = url.strip()
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url:
        return os.path.realpath(os.path.expanduser(url)) if url else url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.rstrip('/')}"


def url_to_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """`fsspec.core.url_to_fs`, with a message that names the package when a backend is missing."""
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        scheme = url.split("://", 1)[0] if "://" in url else "file"
        package = _BACKEND_PACKAGES.get(scheme, f"the fsspec backend for `{scheme}://`")
        raise StorageError(f"`{url}` needs {package}, which is not installed. Run `pip install {package}`.") from err
    except ValueError as err:
        raise StorageError(f"`{url}` is not a URL fsspec understands: {err}") from err


def version_of(entry: dict) -> str:
    """An object's version from a listing entry or `info()`: its size and ETag (object stores) or
    modification time (local disks); it changes when the object is replaced."""
    keys = ("generation", "ETag", "etag", "mtime", "LastModified", "last_modified", "updated")  # GCS, S3, Azure, local
    stamp = next((entry[k] for k in keys if entry.get(k)), None)
    return f"{entry.get('size')}:{stamp}"


class Output:
    """A job's output location (`OUT`). Keys are POSIX paths relative to it (`shards/x.parquet`)."""

    def __init__(self, url: str):
        self.url = resolve_url(url)
        self.fs, self.root = url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        self.kind = store_kind(self.fs)  # "local", "s3", "gcs", "azure"; None: another fsspec backend
        self.local = self.kind == "local"
        self.s3 = self.kind == "s3"
        self.patience: int | None = None  # attempts per operation, when set (1: the store is known to be down)

    def unsafe_commit_reason(self) -> str | None:
        """Why a commit here could split under a race (the backend cannot create an object only if
        absent, atomically), or None where it cannot."""
        if self.atomic_create:
            return None
        scheme = self.url.split("://", 1)[0] if "://" in self.url else "file"
        return (
            f"fleetgen cannot commit atomically on `{scheme}://` ({type(self.fs).__name__} has no create-if-absent): "
            "two attempts of one shard (a straggler's and its replacement's) could both commit"
        )

    @property
    def atomic_create(self) -> bool:
        """Whether `create` is atomic here: local disks (a hard link), S3, GCS and Azure (conditional
        writes). Elsewhere it is a check, then a write (a job refuses that unless accepted)."""
        return self.kind is not None

    def under(self, prefix: str) -> Output:
        """The location `prefix/` inside this one, on the same client (an attempt's staging, read as
        an output of its own by `verify`)."""
        child = copy.copy(self)
        child.url, child.root = self.key_url(prefix.rstrip("/")), self.path(prefix.rstrip("/"))
        return child

    def path(self, key: str) -> str:
        return posixpath.join(self.root, key) if key else self.root

    def key_url(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _retry(self, what: str, key: str, op: Callable[[], T], attempts: int | None = None, read: bool = True) -> T:
        return guarded(what, self.key_url(key), op, attempts or self.patience, read)

    def check(self) -> None:
        """Before a job starts: the location can be reached and written, or a `StorageError` says
        why in one line (a file where the directory should be, no write permission, no
        credentials, an endpoint that does not answer)."""
        if self.local:
            # Nothing is created here: the nearest directory that exists must take a new entry.
            existing = self.root
            while not os.path.lexists(existing):
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing):
                what = "is a file" if existing == self.root else f"is under {existing}, a file"
                raise StorageError(
                    f"`--output` {self.url} {what}, not a directory. Pass a directory (it is created if absent)."
                )
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".fleetgen-probe-", dir=existing))
            except OSError as err:
                raise StorageError(f"`--output` {self.url} is not writable ({existing}: {one_line(err)}).") from err
            return
        self._retry("reach", "", lambda: self.fs.exists(self.path("job.json")), attempts=2)

    def put(self, key: str, data: bytes, attempts: int | None = None) -> None:
        """Write one object whole. Readers never see a partial object: object stores put
        atomically, and on a local disk we write a temporary file and rename it. Doing it twice
        (a retry after a lost answer) leaves the same object. `attempts`: instead of the policy's."""
        path = self.path(key)

        def write() -> None:
            if self.local:
                self.fs.mv(self._local_tmp(path, data), path)
            else:
                self.fs.pipe_file(path, data)

        self._retry("write", key, write, attempts=attempts, read=False)

    def _local_tmp(self, path: str, data: bytes) -> str:
        """`data` in a temporary file beside `path` (local disks), to be renamed or linked there."""
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:8]}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        return tmp

    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist. True when the object there is now `data`, byte for
        byte; False when another writer's object is there. A store may apply a create and lose the
        answer: its client retries and is told the key exists (S3, GCS: 412; Azure: 409). "Exists" is not "someone
        else was first" until the object is read back — so it is, and compared. Atomic where
        `atomic_create` says so."""
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
            if self.kind is not None:
                try:
                    self.fs.pipe_file(path, data, mode="create")
                    return True
                except FileExistsError:  # 412 / 409: someone's object is there (maybe ours)
                    return False
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

        if self._retry("create", key, write, read=False):
            return True
        try:
            return self.get(key) == data
        except FileNotFoundError:
            return False  # there a moment ago, removed since: not ours

    def move(self, src: str, dst: str) -> None:
        """Move an object to another key, replacing what is there (local: a rename; object stores:
        a server-side copy, then a delete). A retry after an answer was lost finds the move done and
        says so."""
        tries = 0

        def move() -> None:
            nonlocal tries
            tries += 1
            try:
                if self.local:
                    self.fs.makedirs(posixpath.dirname(self.path(dst)), exist_ok=True)
                if self.kind == "azure":
                    fsspec.asyn.sync(self.fs.loop, azure_copy, self.fs, self.path(src), self.path(dst))
                    self.fs.rm_file(self.path(src))
                elif self.kind in ("s3", "gcs"):
                    # a server-side copy and a delete (3 requests on S3, 2 on GCS): fsspec's generic
                    # mv expands and stats both paths first (5 on S3), and gcsfs' asks for the moveTo
                    # API, which only buckets with a hierarchical namespace have, before copying (9)
                    self.fs.cp_file(self.path(src), self.path(dst))
                    self.fs.rm_file(self.path(src))
                else:
                    self.fs.mv(self.path(src), self.path(dst))
            except FileNotFoundError:
                # The source is an attempt's own staged object: gone after a try of ours means moved.
                if tries > 1 and not self.exists(src) and self.exists(dst):
                    return
                raise

        self._retry("move", src, move, read=False)

    def each(self, op: Callable[[str], object], keys: list[str], threads: int | None = None) -> None:
        """`op(key)` for every key, concurrently on object stores (a commit's moves: a request or two
        each, so a shard of hundreds takes seconds, not minutes); one by one on a local disk. The
        first error is raised once every key has been tried."""
        threads = threads or MOVE_THREADS
        if self.local or len(keys) <= 1 or threads <= 1:
            for key in keys:
                op(key)
            return
        with ThreadPoolExecutor(max_workers=min(threads, len(keys))) as pool:
            futures = [pool.submit(op, key) for key in keys]
        for future in futures:
            future.result()

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

        def listing() -> dict:
            self.fs.invalidate_cache(self.path(prefix))
            return self.fs.find(self.path(prefix), detail=True)

        try:
            found = self._retry("list", prefix, listing)
        except FileNotFoundError:
            return {}
        root = self.root + "/"
        keys = {posixpath.normpath(p): info.get("size") for p, info in found.items()}
        return {p[len(root) :] if p.startswith(root) else p: size for p, size in keys.items()}

    def sweep_tmp(self, prefix: str) -> int:
        """Remove temporary files a killed writer left under `prefix/` (local disks only: object
        stores never show a partial object). Returns how many."""
        if not self.local or not os.path.isdir(self.path(prefix)):
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
                return RenameOnClose(self.fs, path)
            return self.fs.open(path, "wb")

        return self._retry("open for writing", key, open_, read=False)

    @staticmethod
    def discard(stream: IO[bytes]) -> None:
        """Abandon a stream from `open_write`: nothing appears at its key."""
        discard = getattr(stream, "discard", None)
        if discard is not None:
            try:
                discard()  # local: removes the temporary file; fsspec buffered files: aborts the (multipart) upload
            except Exception:  # noqa: BLE001 - an abort the store did not answer: the upload never completes
                pass
            if hasattr(stream, "closed") and not isinstance(stream, RenameOnClose):
                stream.closed = True  # so that garbage collection does not flush (and complete) it

    def get(self, key: str, attempts: int | None = None) -> bytes:
        """The object's bytes; `FileNotFoundError` when absent. `attempts`: instead of the policy's."""
        return self._retry("read", key, lambda: self.fs.cat_file(self.path(key)), attempts=attempts)

    def get_many(self, keys: list[str], threads: int = 32) -> dict[str, bytes]:
        """Several objects' bytes, fetched concurrently; `FileNotFoundError` when one is absent."""
        if not keys:
            return {}
        with ThreadPoolExecutor(max_workers=min(threads, len(keys))) as pool:
            return dict(zip(keys, pool.map(self.get, keys), strict=True))

    def read_parquet(self, key: str, columns: list[str] | None = None) -> pa.Table:
        """A Parquet object's columns (all of them, or those of `columns` it has)."""
        data = self.get(key)
        if columns is not None:
            have = set(parquet_schema(data).names)
            columns = [c for c in columns if c in have]
        return read_parquet(data, columns)

    def read_with(self, key: str, reader: Callable[[IO[bytes]], T]) -> T:
        """`reader(stream)` over the object, for one read too large to hold (a tar read member by
        member); a transient fault anywhere in it reads again from the start."""

        def read() -> T:
            with self.fs.open(self.path(key), "rb") as f:
                return reader(f)

        return self._retry("read", key, read)

    def version(self, key: str) -> str:
        """The object's version (`version_of`), as a listing of its prefix would give it."""

        def info() -> dict:
            self.fs.invalidate_cache(self.path(key))
            return self.fs.info(self.path(key))

        return version_of(self._retry("look at", key, info))

    def size(self, key: str) -> int:
        return self._retry("look at", key, lambda: self.fs.size(self.path(key)))

    def exists(self, key: str) -> bool:
        def exists() -> bool:
            self.fs.invalidate_cache(self.path(key))
            return self.fs.exists(self.path(key))

        return self._retry("look at", key, exists)

    def listing(self, prefix: str, suffix: str = "") -> dict[str, str]:
        """{name: version} of the objects directly under `prefix/` ending in `suffix`, from one
        listing (temporary files of local writers left out)."""
        try:
            entries = self._retry("list", prefix, lambda: self.fs.ls(self.path(prefix), detail=True, refresh=True))
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            name = posixpath.basename(e["name"].rstrip("/"))
            if name.endswith(suffix) and TMP_MARK not in name:
                out[name] = version_of(e)
        return dict(sorted(out.items()))

    def list(self, prefix: str, suffix: str = "", temporary: bool = False) -> list[str]:
        """Names (not keys) of the objects directly under `prefix/` ending in `suffix`, sorted;
        temporary files of local writers only with `temporary`."""
        try:
            entries = self._retry("list", prefix, lambda: self.fs.ls(self.path(prefix), detail=False, refresh=True))
        except FileNotFoundError:
            return []
        names = (posixpath.basename(e.rstrip("/")) for e in entries)
        return sorted(n for n in names if n.endswith(suffix) and (temporary or TMP_MARK not in n))

    def remove(self, key: str) -> None:
        """Remove an object or a whole prefix; absent is fine. A prefix goes page by page as it is
        listed (local disks: a directory walk; S3: 1,000 keys per listing page, deleted in one
        request), so memory does not grow with the number of objects; elsewhere fsspec lists the
        prefix first."""
        path = self.path(key)

        def remove() -> None:
            if self.local:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.lexists(path):
                    os.remove(path)
            elif self.s3:
                remove_s3_prefix(self.fs, path)
            elif self.fs.exists(path):
                self.fs.rm(path, recursive=True)

        try:
            self._retry("remove", key, remove)
        except FileNotFoundError:
            pass


__all__ = [
    "STORAGE_ENV",
    "TMP_MARK",
    "Output",
    "guarded",
    "parquet_schema",
    "read_parquet",
    "resolve_url",
    "url_to_fs",
    "version_of",
]
