"""A shard: a row range of one row group of one Parquet file, and how a worker reads its rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from fleetgen.errors import InputError
from workers.layout import unsafe_id_reason
from workers.seeds import MAX_SEED, derive_seed
from workers.storage import url_to_fs


@dataclass(frozen=True)
class Shard:
    """Rows `[offset, offset + length)` of row group `row_group` in `path` (an fsspec URL)."""

    id: str  # stable across reruns of the same input and --rows-per-shard
    path: str
    file_index: int
    row_group: int
    row_group_start: int  # index in the file of the row group's first row
    offset: int  # first row of the shard, within the row group
    length: int


@dataclass(frozen=True)
class Columns:
    """Input column names; an optional column is None when the input does not have it."""

    prompt: str = "prompt"
    id: str | None = "id"
    seed: str | None = "seed"
    negative_prompt: str | None = "negative_prompt"

    def present(self) -> list[str]:
        return [c for c in (self.prompt, self.id, self.seed, self.negative_prompt) if c]


@dataclass(frozen=True)
class Row:
    id: str
    prompt: str | None
    negative_prompt: str | None
    seed: int | None
    error: str | None  # set when the row cannot be generated at all (bad prompt, id or seed)


def read_shard(shard: Shard, columns: Columns) -> pa.Table:
    """Only this shard's row group and columns are read."""
    fs, path = url_to_fs(shard.path)
    try:
        with fs.open(path, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(shard.row_group, columns=columns.present())
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"Could not read row group {shard.row_group} of {shard.path}: {err}") from err
    return table.slice(shard.offset, shard.length)


def _as_seed(value: object) -> tuple[int | None, str | None]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, None  # null seed: derived from the job seed
    if isinstance(value, bool) or not float(value).is_integer():
        return None, f"seed `{value}` is not an integer"
    seed = int(value)
    if not 0 <= seed <= MAX_SEED:
        return None, f"seed `{seed}` is out of range [0, 2**63-1]"
    return seed, None


def shard_rows(shard: Shard, table: pa.Table, columns: Columns, job_seed: int) -> list[Row]:
    """Turn a shard's table into rows with ids, seeds and per-row errors resolved."""
    data = {name: table.column(name).to_pylist() for name in columns.present()}
    rows = []
    for i in range(table.num_rows):
        if columns.id:
            raw_id = data[columns.id][i]
            row_id = "" if raw_id is None else str(raw_id)
        else:  # position in the input: file, then row within the file
            row_id = f"{shard.file_index:05d}-{shard.row_group_start + shard.offset + i:09d}"
        prompt = data[columns.prompt][i]
        negative = data[columns.negative_prompt][i] if columns.negative_prompt else None
        seed, error = _as_seed(data[columns.seed][i]) if columns.seed else (None, None)
        error = unsafe_id_reason(row_id) or error
        if error is None and (prompt is None or not str(prompt).strip()):
            error = "prompt is null or empty"
        if error is None and seed is None:
            seed = derive_seed(job_seed, row_id)
        rows.append(Row(row_id, prompt, negative, seed, error))
    return rows
