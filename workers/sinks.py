"""Where a shard's images go, per `--output-format`; written as they are made.

files       one object per image:             OUT/images/<shard>/<id>.<ext>
webdataset  one tar per shard, <id>.<ext> + <id>.json members:  OUT/data/<shard>.tar
parquet     one Parquet file per shard, a row group per batch:  OUT/data/<shard>.parquet

Keys are deterministic. A sink writes under its attempt's staging prefix; the shard manifest (the
commit) is written by the worker after `close()`, and only the winning attempt's objects move to
their keys (workers/commit.py).
"""

from __future__ import annotations

import io
import json
import tarfile
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from workers.layout import IMAGE_FORMATS, data_key, image_key
from workers.storage import Output

# For `datasets.load_dataset`: the `image` struct decodes as an Image feature. Only it is named here;
# `datasets` takes every other column's feature from its Arrow type (carried columns included).
_HF_FEATURES = {"image": {"_type": "Image"}}
PARQUET_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("row_id", pa.string()),
        ("image_index", pa.int32()),
        ("prompt", pa.string()),
        ("negative_prompt", pa.string()),
        ("seed", pa.int64()),
        ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("steps", pa.int32()),
        ("guidance", pa.float32()),
        ("lora", pa.list_(pa.string())),
        ("lora_scale", pa.list_(pa.float32())),
        ("sha256", pa.string()),
        ("nsfw", pa.bool_()),  # the safety checker's verdict where the pipeline has one (flagged images are not stored)
    ],
    metadata={"huggingface": json.dumps({"info": {"features": _HF_FEATURES}})},
)


class Sink(Protocol):
    def add(self, batch: list[tuple[str, bytes, dict]], carried: pa.Table | None) -> list[tuple[str, str | None]]:
        """Store `(id, image bytes, metadata)` items, with their rows' carried input columns
        (`carried`, one row per item, or None); return `(object key, member)` for each."""

    def keep_existing(self) -> None:
        """A retry of a committed shard's error rows: put what the shard's object holds first."""

    def close(self) -> None:
        """Finish the shard's objects (after the last batch)."""

    def abort(self) -> None:
        """Give up: objects not yet complete do not appear."""


class FilesSink:
    def __init__(self, output: Output, shard_id: str, image_format: str, carried: pa.Schema | None = None,
                 prefix: str = ""):
        self.output, self.shard_id, self.image_format, self.prefix = output, shard_id, image_format, prefix

    def add(self, batch, carried=None):
        keys = []
        for row_id, data, _meta in batch:
            key = image_key(self.shard_id, row_id, self.image_format)
            self.output.put(self.prefix + key, data)
            keys.append((key, None))
        return keys

    def keep_existing(self) -> None:
        pass  # one object per image: the kept ones are not touched

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass  # each image object is whole; the attempt's staging is removed with them


class WebDatasetSink:
    def __init__(self, output: Output, shard_id: str, image_format: str, carried: pa.Schema | None = None,
                 prefix: str = ""):
        self.output = output
        self.key = data_key(shard_id, "webdataset")
        self.ext = IMAGE_FORMATS[image_format]
        self.stream = output.open_write(prefix + self.key)
        self.tar = tarfile.open(fileobj=self.stream, mode="w|", format=tarfile.PAX_FORMAT)

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644  # mtime 0: same bytes on a retry
        self.tar.addfile(info, io.BytesIO(data))

    def add(self, batch, carried=None):
        keys = []
        extra = carried.to_pylist() if carried is not None else [{}] * len(batch)
        for (row_id, data, meta), columns in zip(batch, extra, strict=True):
            self._member(f"{row_id}.{self.ext}", data)
            # default=str: dates, decimals and the like become strings in the sample's JSON
            self._member(f"{row_id}.json", json.dumps({**meta, **columns}, sort_keys=True, default=str).encode())
            keys.append((self.key, f"{row_id}.{self.ext}"))
        return keys

    def keep_existing(self) -> None:
        with tarfile.open(fileobj=io.BytesIO(self.output.get(self.key)), mode="r:") as old:
            for info in old:
                self._member(info.name, old.extractfile(info).read())

    def close(self) -> None:
        self.tar.close()
        self.stream.close()

    def abort(self) -> None:
        Output.discard(self.stream)


def parquet_schema(carried: pa.Schema | None) -> pa.Schema:
    """`PARQUET_SCHEMA` followed by the carried input columns, as typed in the input."""
    if carried is None:
        return PARQUET_SCHEMA
    return pa.schema([*PARQUET_SCHEMA, *carried], metadata=PARQUET_SCHEMA.metadata)


class ParquetSink:
    def __init__(self, output: Output, shard_id: str, image_format: str, carried: pa.Schema | None = None,
                 prefix: str = ""):
        self.output = output
        self.key = data_key(shard_id, "parquet")
        self.ext = IMAGE_FORMATS[image_format]
        self.schema = parquet_schema(carried)
        self.stream = output.open_write(prefix + self.key)
        self.writer = pq.ParquetWriter(self.stream, self.schema)

    def add(self, batch, carried=None):
        rows = [
            {**{k: meta[k] for k in PARQUET_SCHEMA.names if k in meta},
             "image": {"bytes": data, "path": f"{row_id}.{self.ext}"}}
            for row_id, data, meta in batch
        ]
        table = pa.Table.from_pylist(rows, schema=PARQUET_SCHEMA)
        if carried is not None:
            table = pa.Table.from_arrays([*table.columns, *carried.columns], schema=self.schema)
        self.writer.write_table(table)
        return [(self.key, None)] * len(batch)

    def keep_existing(self) -> None:
        self.writer.write_table(self.output.read_parquet(self.key).cast(self.schema))

    def close(self) -> None:
        self.writer.close()
        self.stream.close()

    def abort(self) -> None:
        Output.discard(self.stream)
        self.writer.is_open = False  # its footer must not be written to the discarded stream when collected


SINKS = {"files": FilesSink, "webdataset": WebDatasetSink, "parquet": ParquetSink}


def open_sink(output: Output, shard_id: str, output_format: str, image_format: str,
              carried: pa.Schema | None = None, prefix: str = "") -> Sink:
    """`carried`: the input columns carried into each image's record, as typed in the input.
    Objects are written at `prefix` + their final key (an attempt's staging, workers/commit.py);
    `add` returns the final keys."""
    return SINKS[output_format](output, shard_id, image_format, carried, prefix)
