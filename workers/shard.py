"""A shard: a row range of one row group of one Parquet file, and how a worker reads its rows.
(`workers/batches.py` turns the rows into images and batches.)"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from fleetgen.errors import InputError, StorageError
from workers.storage import guarded, url_to_fs


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
    retry_errors: bool = False  # committed already: redo only its error rows (`--retry-errors`)


# Roles an input column can play, by the option that names it (`--steps-column` ...). Optional roles
# are used when the input has a column of that name; per-row setting columns override the job's.
SETTING_ROLES = ("steps", "guidance", "width", "height", "num_images", "lora", "lora_scale")
ROLES = ("prompt", "id", "seed", "negative_prompt", *SETTING_ROLES)


@dataclass(frozen=True)
class Columns:
    """Input column names per role (None: the input has no such column), the columns carried into
    the outputs as they are, and the columns a prompt template reads."""

    prompt: str | None = "prompt"  # None when `--prompt-template` builds the prompt
    id: str | None = "id"
    seed: str | None = "seed"
    negative_prompt: str | None = "negative_prompt"
    # per-row settings (JobConfig names them `steps`, `guidance`, ... by default)
    steps: str | None = None
    guidance: str | None = None
    width: str | None = None
    height: str | None = None
    num_images: str | None = None
    lora: str | None = None  # an adapter (path or hub id) for the row; "" for none
    lora_scale: str | None = None
    carry: tuple[str, ...] = ()  # input columns carried into manifests and outputs, types unchanged
    template_fields: tuple[str, ...] = ()  # input columns the prompt template reads

    def roles(self) -> dict[str, str]:
        """{role: column} for the roles the input has."""
        return {role: getattr(self, role) for role in ROLES if getattr(self, role)}

    def present(self) -> list[str]:
        """Every input column a worker reads, once each."""
        return list(dict.fromkeys([*self.roles().values(), *self.template_fields, *self.carry]))


READ_BATCH = 65_536  # rows decoded at a time when a shard is part of a bigger row group


def read_shard(shard: Shard, columns: Columns) -> pa.Table:
    """Only this shard's columns, and its row group only as far as its last row: a reader cannot
    seek to a row inside a row group (pyarrow exposes no page index), so the group's pages are
    streamed from its start and reading stops at the shard's end; pages past it are never fetched."""
    fs, path = url_to_fs(shard.path)
    end = shard.offset + shard.length

    def read() -> pa.Table:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 16)
            if shard.offset == 0 and shard.length == pf.metadata.row_group(shard.row_group).num_rows:
                return pf.read_row_group(shard.row_group, columns=columns.present())
            batches, first, seen = [], None, 0
            for batch in pf.iter_batches(READ_BATCH, row_groups=[shard.row_group], columns=columns.present()):
                if seen + batch.num_rows > shard.offset:
                    first = seen if first is None else first
                    batches.append(batch)
                seen += batch.num_rows
                if seen >= end:
                    break
        if first is None or seen < end:
            raise InputError(f"Row group {shard.row_group} of {shard.path} has {seen} rows; shard {shard.id} needs "
                             f"rows {shard.offset}-{end - 1} of it (the file changed since the job started?).")
        return pa.Table.from_batches(batches).slice(shard.offset - first, shard.length)

    try:
        return guarded("read", shard.path, read)
    except (StorageError, OSError, pa.ArrowException) as err:  # OSError: pyarrow's own, over corrupt bytes
        raise InputError(f"Could not read row group {shard.row_group} of {shard.path}: {err}") from err
