"""Parquet decoded without pyarrow's thread pools (see `read_parquet`), and a local file that
appears under its name only when complete."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.parquet as pq

TMP_MARK = ".tmp-"  # in the name of a local file being written; renamed away when complete


def read_parquet(data: bytes, columns: list[str] | None = None) -> pa.Table:
    """A Parquet object's table from its bytes, decoded on this thread. pyarrow 26's thread pools
    make a short-lived process abort at exit ("terminate called without an active exception", exit
    134): in about a third of runs after `pq.read_table` over a buffer or a Python file object, and
    now and then (1 in ~200 on a loaded machine) after a threaded `ParquetFile.read`; a read that
    never starts pool work does not. A manifest or a shard's data file decodes in milliseconds."""
    return pq.ParquetFile(pa.BufferReader(data), pre_buffer=False).read(columns=columns, use_threads=False)


def parquet_schema(data: bytes) -> pa.Schema:
    return pq.ParquetFile(pa.BufferReader(data), pre_buffer=False).schema_arrow


class RenameOnClose:
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
