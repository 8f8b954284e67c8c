"""Cutting the input into shards from Parquet footers alone.

A shard is a row range inside one row group: row groups are the unit a reader can fetch, and a
big row group is split into `rows_per_shard` ranges so that a single-row-group file of 100k rows
still spreads over every worker. Shard ids number the shards in input order, so the same input
and `rows_per_shard` always give the same ids (that is what makes resume work).
"""

from __future__ import annotations

import glob as globlib
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fleetgen.errors import InputError
from workers.shard import Columns, Shard
from workers.storage import url_to_fs


@dataclass(frozen=True)
class InputFile:
    url: str
    size: int  # bytes
    row_groups: tuple[int, ...]  # rows per row group
    schema: pa.Schema

    @property
    def num_rows(self) -> int:
        return sum(self.row_groups)


def list_input_files(url: str) -> list[str]:
    """One Parquet file, every `*.parquet` under a directory, or a glob; sorted, as full URLs."""
    fs, path = url_to_fs(url)
    if globlib.has_magic(path):
        paths = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        paths = [p for p in fs.find(path) if p.endswith(".parquet")]
        if not paths:
            raise InputError(f"`--input` {url} is a directory with no `*.parquet` files in it.")
    elif fs.exists(path):
        paths = [path]
    else:
        raise InputError(f"`--input` {url} does not exist.")
    if not paths:
        raise InputError(f"`--input` {url} matches no files.")
    return [fs.unstrip_protocol(p) if "://" in url else p for p in sorted(paths)]


def read_footer(url: str) -> InputFile:
    fs, path = url_to_fs(url)
    try:
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
            size = fs.size(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise InputError(f"`--input` file {url} is not a readable Parquet file: {err}") from err
    groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return InputFile(url=url, size=size, row_groups=groups, schema=schema)


_KINDS = {
    "prompt": (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view),
    "negative_prompt": (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view, pa.types.is_null),
    "seed": (pa.types.is_integer, pa.types.is_null),
    "id": (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer),
}


def resolve_columns(files: list[InputFile], wanted: Columns) -> Columns:
    """Check the prompt column and types in every file; optional columns are kept only when
    every file has them (a column in some files but not others is schema drift: an error)."""
    first = files[0]
    resolved = {}
    for role in ("prompt", "id", "seed", "negative_prompt"):
        name = getattr(wanted, role)
        have = [f for f in files if name in f.schema.names]
        if role == "prompt" and len(have) < len(files):
            f = next(f for f in files if name not in f.schema.names)
            raise InputError(
                f"Input column `{name}` not found in {f.url} (columns: {', '.join(f.schema.names)}). "
                "Pass `--prompt-column NAME`."
            )
        if 0 < len(have) < len(files):
            f = next(f for f in files if name not in f.schema.names)
            raise InputError(f"Column `{name}` is in {first.url if have[0] is first else have[0].url} "
                             f"but not in {f.url}: all input files must have the same columns.")
        if not have:
            resolved[role] = None
            continue
        for f in files:
            kind = f.schema.field(name).type
            if not any(check(kind) for check in _KINDS[role]):
                raise InputError(f"Column `{name}` in {f.url} has type {kind}; the {role} column must be "
                                 f"{'an integer' if role == 'seed' else 'a string' if role != 'id' else 'a string or integer'}.")
        resolved[role] = name
    return Columns(**resolved)


def plan_shards(files: list[InputFile], rows_per_shard: int) -> list[Shard]:
    shards = []
    for file_index, f in enumerate(files):
        start = 0
        for group, rows in enumerate(f.row_groups):
            for offset in range(0, rows, rows_per_shard):
                shards.append(Shard(
                    id=f"shard-{len(shards):05d}", path=f.url, file_index=file_index, row_group=group,
                    row_group_start=start, offset=offset, length=min(rows_per_shard, rows - offset),
                ))
            start += rows
    return shards


def check_unique_ids(files: list[InputFile], columns: Columns, examples: int = 3) -> None:
    """Ids name objects: two rows with one id would overwrite each other's image. Reads only the
    id column."""
    if not columns.id:
        return
    tables = []
    for f in files:
        fs, path = url_to_fs(f.url)
        with fs.open(path, "rb") as fh:
            tables.append(pq.read_table(fh, columns=[columns.id]).column(0).cast(pa.string()))
    ids = pa.chunked_array([c for t in tables for c in t.chunks], type=pa.string())
    counts = pc.value_counts(ids.drop_null())
    dups = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dups):
        shown = ", ".join(f"`{d['values']}` ({d['counts']}x)" for d in dups.to_pylist()[:examples])
        raise InputError(f"Column `{columns.id}` must hold unique ids: {len(dups)} repeat, e.g. {shown}. "
                         "Remove the duplicates, or pass `--id-column` naming a unique column.")
