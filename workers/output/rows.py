"""Images as rows of a table instead of stored objects: a Ray Data stage's output (cluster/ray_data.py).

One row per image record, as a shard's manifest would hold it (workers/output/fields.py), in its order:
the input row's carried columns as they were, the record's fields under their names, then the model,
the worker's plan and the picture's encoded bytes (`image`, or `video` for a clip; null where none was
made: an error or a filtered row). The manifest's `image` (an object key) and `member` have no meaning
here and are left out."""

from __future__ import annotations

import pyarrow as pa

from fleetgen.workers.output.fields import clip_names
from fleetgen.workers.output.layout import MANIFEST_SCHEMA

ADDED = ("model", "plan")  # a row's columns beyond its record's
DROPPED = ("image", "member")  # the record's that a row leaves out


def dropped(media: str) -> tuple[str, ...]:
    """The record's fields a row of `media` leaves out: DROPPED, and an image's rows a clip's fields."""
    return DROPPED + (clip_names() if media == "image" else ())


def rows_schema(carried: pa.Schema, media: str) -> pa.Schema:
    """The rows' columns: `carried` (the input's), the record's of its task, ADDED, then `media` (binary)."""
    record = [f for f in MANIFEST_SCHEMA if f.name not in dropped(media)]
    added = [pa.field(n, pa.string()) for n in ADDED] + [pa.field(media, pa.binary())]
    return pa.schema([*carried, *record, *added])


def as_rows(
    records: list[dict],
    data: list[bytes | None],
    table: pa.Table,
    carry: tuple[str, ...],
    rows: list[int],
    media: str,
    model: str,
    plan: str,
) -> pa.Table:
    """`records` (each image's, in order; `rows`: each one's row of `table`; `data`: each one's encoded
    picture, None where none was made) as rows."""
    carried = table.select(list(carry))
    record = pa.Table.from_pylist(records, schema=MANIFEST_SCHEMA).drop_columns(list(dropped(media)))
    columns = [
        *carried.take(pa.array(rows, pa.int64())).columns,
        *record.columns,
        pa.array([model] * len(records), pa.string()),
        pa.array([plan] * len(records), pa.string()),
        pa.array(data, pa.binary()),
    ]
    return pa.Table.from_arrays(columns, schema=rows_schema(carried.schema.remove_metadata(), media))
