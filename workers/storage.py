"""The output location: one fsspec filesystem and a root prefix; every key is relative to it.

Only this module talks to fsspec for writing, so any backend fsspec knows (local paths,
`file://`, `s3://`, `gs://`, `memory://`) works the same, and a missing backend fails with the
package to install.
"""

from __future__ import annotations

import posixpath
import uuid
from typing import IO

import fsspec

from fleetgen.errors import StorageError

# Backends that fsspec loads lazily, and the pip extra that brings each.
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

    def path(self, key: str) -> str:
        return posixpath.join(self.root, key) if key else self.root

    def key_url(self, key: str) -> str:
        return f"{self.url}/{key}"

    def put(self, key: str, data: bytes) -> None:
        """Write one object whole. Readers never see a partial object: object stores put
        atomically, and on a local disk we write a temporary file and rename it."""
        path = self.path(key)
        try:
            if self.local:
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                with self.fs.open(tmp, "wb") as f:
                    f.write(data)
                self.fs.mv(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        except OSError as err:
            raise StorageError(f"Could not write {self.key_url(key)}: {err}") from err

    def open_write(self, key: str) -> IO[bytes]:
        """A stream for a large object written piece by piece (a shard's tar or Parquet file)."""
        path = self.path(key)
        try:
            if self.local:
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            return self.fs.open(path, "wb")
        except OSError as err:
            raise StorageError(f"Could not open {self.key_url(key)} for writing: {err}") from err

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            raise
        except OSError as err:
            raise StorageError(f"Could not read {self.key_url(key)}: {err}") from err

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def list(self, prefix: str, suffix: str = "") -> list[str]:
        """Names (not keys) of the objects directly under `prefix/` ending in `suffix`, sorted."""
        try:
            entries = self.fs.ls(self.path(prefix), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as err:
            raise StorageError(f"Could not list {self.key_url(prefix)}: {err}") from err
        names = (posixpath.basename(e.rstrip("/")) for e in entries)
        return sorted(n for n in names if n.endswith(suffix) and ".tmp-" not in n)

    def remove(self, key: str) -> None:
        """Remove an object or a whole prefix; absent is fine."""
        path = self.path(key)
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise StorageError(f"Could not remove {self.key_url(key)}: {err}") from err
