"""`parquet`: one Parquet file per shard, `OUT/data/<shard>.parquet`, a row group per batch; its
`image` column decodes as a `datasets` Image feature (`datasets.load_dataset(OUT)`); a video job's
`video` column as a Video feature, beside its `poster` (the first frame, an Image feature)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fleetgen.workers.output.fields import table
from fleetgen.workers.output.formats import OutputFormat, ReadBack, Unreadable, register
from fleetgen.workers.output.layout import EXTENSIONS, POSTER, frame_name
from fleetgen.workers.output.made import MASK, input_name
from fleetgen.workers.output.storage import Output
from fleetgen.workers.output.video import VIDEO_FORMATS

# For `datasets.load_dataset`: the `image` struct decodes as an Image feature. Only it is named here;
# `datasets` takes every other column's feature from its Arrow type (carried columns included).
_BYTES = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # what `datasets` Image and Video features hold


def media_column(media_format: str) -> str:
    return "video" if media_format in VIDEO_FORMATS else "image"


def stored_schema(inputs: tuple[str, ...] = (), media: str = "image") -> pa.Schema:
    """The stored fields of the field table (workers/output/fields.py), the image (or `video`) after the
    seed (read when a sink opens: fields a plugin added are in it); `inputs`: the image columns
    stored beside it (`--store-inputs`: `input_image`, `mask_image`; a clip's `poster`), each an
    Image feature too."""
    stored = [pa.field(f.name, f.type) for f in table() if f.sidecar]
    at = next(i for i, f in enumerate(stored) if f.name == "seed") + 1
    extra = [pa.field(name, pa.list_(_BYTES) if name == FRAMES else _BYTES) for name in inputs]
    image = {"_type": "Image"}
    features = {
        media: {"_type": media.capitalize()},
        **{name: {"_type": "Sequence", "feature": image} if name == FRAMES else image for name in inputs},
    }
    return pa.schema(
        [*stored[:at], pa.field(media, _BYTES), *extra, *stored[at:]],
        metadata={"huggingface": json.dumps({"info": {"features": features}})},
    )


# the column of each companion stored beside an image (workers/output/made.py): `--store-inputs`'s first
# input and mask, and a clip's poster frame
COMPANION_COLUMNS = {input_name(0): "input_image", MASK: "mask_image", POSTER: "poster"}
FRAMES = "frames"  # `--store-frames`: a clip's frames, a list of images (a `datasets` Sequence of Image)


def data_key(shard_id: str) -> str:
    return f"data/{shard_id}.parquet"


def parquet_schema(carried: pa.Schema | None, inputs: tuple[str, ...] = (), media: str = "image") -> pa.Schema:
    """The stored fields followed by the carried input columns, as typed in the input."""
    base = stored_schema(inputs, media)
    if carried is None:
        return base
    return pa.schema([*base, *carried], metadata=base.metadata)


class ParquetSink:
    def __init__(
        self,
        output: Output,
        shard_id: str,
        image_format: str,
        carried: pa.Schema | None = None,
        prefix: str = "",
        inputs: tuple[str, ...] = (),
    ):
        self.output = output
        self.key = data_key(shard_id)
        self.ext, self.media = EXTENSIONS[image_format], media_column(image_format)
        self.base, self.schema = stored_schema(inputs, self.media), parquet_schema(carried, inputs, self.media)
        self.stream = output.open_write(prefix + self.key)
        self.writer = pq.ParquetWriter(self.stream, self.schema)

    def add(self, made, carried=None):
        rows = [self._row(m) for m in made]
        table = pa.Table.from_pylist(rows, schema=self.base)
        if carried is not None:
            table = pa.Table.from_arrays([*table.columns, *carried.columns], schema=self.schema)
        self.writer.write_table(table)
        return [(self.key, None)] * len(made)

    def _row(self, m) -> dict:
        row = {k: m.meta[k] for k in self.base.names if k in m.meta}
        row[self.media] = {"bytes": m.data, "path": f"{m.id}.{self.ext}"}
        members = dict(m.companions.members())
        row.update(
            (column, {"bytes": members[name], "path": f"{m.id}.{name}"})
            for name, column in COMPANION_COLUMNS.items()
            if name in members
        )
        if FRAMES in self.base.names:  # frame-0000.png ..., in the order the writer made them
            row[FRAMES] = [{"bytes": v, "path": f"{m.id}.{frame_name(i)}"} for i, v in enumerate(m.companions.frames)]
        return row

    def keep_existing(self) -> None:
        self.writer.write_table(self.output.read_parquet(self.key).select(self.schema.names).cast(self.schema))

    def close(self) -> None:
        self.writer.close()
        self.stream.close()

    def abort(self) -> None:
        Output.discard(self.stream)
        self.writer.is_open = False  # its footer must not be written to the discarded stream when collected


class Parquet(OutputFormat):
    name = "parquet"
    description = "a Parquet file per shard, data/<shard>.parquet (datasets.load_dataset)"
    data_files = "data/*.parquet"
    carries_records = True

    def sink(self, output, shard_id, image_format, carried, prefix, inputs=()):
        return ParquetSink(output, shard_id, image_format, carried, prefix, inputs)

    def shard_objects(self, shard_id: str) -> list[str]:
        return [data_key(shard_id)]

    def merge(self, output, shard_id, pieces, prefix) -> None:
        """One Parquet file from the pieces', a piece's rows at a time (its ok rows' ids), in order."""
        stream, writer = output.open_write(prefix + data_key(shard_id)), None
        try:
            for source, rows in pieces:
                table = output.read_parquet(source + data_key(shard_id))
                table = table.filter(pc.is_in(table.column("id"), pa.array([r["id"] for r in rows], pa.string())))
                writer = writer or pq.ParquetWriter(stream, table.schema)
                writer.write_table(table)
            if writer is not None:
                writer.close()
            stream.close()
        except BaseException:
            Output.discard(stream)
            if writer is not None:
                writer.is_open = False
            raise

    def read_back(
        self, output: Output, shard_id: str, rows: list[dict], wanted: set[str] | None
    ) -> tuple[ReadBack, list[str]]:
        """The id column, then the image column of every row group (`wanted` None) or of the row
        groups holding a wanted id; an image whose bytes were not read has the manifest's size."""
        sizes = {r["id"]: r.get("size") for r in rows}

        def read(f) -> ReadBack:
            pf = pq.ParquetFile(f, pre_buffer=False)  # no pool work: see workers.storage.read_parquet
            ids = pf.read(columns=["id"], use_threads=False).column("id").to_pylist()
            media = "video" if "video" in pf.schema_arrow.names else "image"
            found = {i: (sizes.get(i), None) for i in ids}  # present; bytes not read: trust the manifest's size
            starts = [0]
            for g in range(pf.metadata.num_row_groups):
                starts.append(starts[-1] + pf.metadata.row_group(g).num_rows)
            for g in range(pf.metadata.num_row_groups):
                if wanted is None or wanted & set(ids[starts[g] : starts[g + 1]]):
                    group = pf.read_row_group(g, columns=["id", media], use_threads=False)
                    for rid, image in zip(group.column("id").to_pylist(), group.column(media).to_pylist(), strict=True):
                        data = image["bytes"] if image else None
                        found[rid] = (len(data), data) if data is not None else (None, None)
            return found

        try:
            held = output.read_with(data_key(shard_id), read)
        except FileNotFoundError:
            held = {}
        except pa.ArrowException as err:  # the bytes came, and they are not Parquet: damage
            raise Unreadable(f"not a readable parquet file: {err}") from err
        return {r["id"]: held.get(r["id"], (None, None)) for r in rows}, []

    def how_to_load(self, url: str, shards: list[str]) -> list[str]:
        return [
            "```python",
            "import datasets",
            f'ds = datasets.load_dataset("{url}", split="train")  # `image` is an Image feature',
            "```",
            "",
            "Video jobs: `video` is a Video feature (decoded with `torchcodec`; "
            '`ds.cast_column("video", datasets.Video(decode=False))` gives the MP4 bytes) and `poster` its first '
            "frame.",
        ]


PARQUET = register(Parquet())
