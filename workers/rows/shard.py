"""A shard: a row range of one row group of one Parquet file, and how a worker reads its rows.
(`workers/rows/batches.py` turns the rows into images and batches.)"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from fleetgen.errors import InputError, StorageError
from fleetgen.workers.output.fields import freeze, setting_roles
from fleetgen.workers.output.storage import guarded, url_to_fs


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


# Roles an input column can play, by the option that names it (`--steps-column` ...): the field
# table's (workers/output/fields.py). Optional roles are used when the input has a column of that name;
# per-row setting columns override the job's.
SETTING_ROLES = setting_roles()
ROLES = ("prompt", "id", "seed", "negative_prompt", *SETTING_ROLES)


def _roles(self) -> dict[str, str]:
    """{role: column} for the roles the input has."""
    return {role: getattr(self, role) for role in ROLES if getattr(self, role)}


def _present(self) -> list[str]:
    """Every input column a worker reads, once each."""
    return list(dict.fromkeys([*self.roles().values(), *self.template_fields, *self.carry]))


# Input column names per role (None: the input has no such column), the columns carried into the
# outputs as they are, and the columns a prompt template reads. One attribute per role of the
# field table, so a new per-row setting is a new attribute here with no other change.
Columns = make_dataclass(
    "Columns",
    [
        ("prompt", "str | None", field(default="prompt")),  # None when `--prompt-template` builds the prompt
        ("id", "str | None", field(default="id")),
        ("seed", "str | None", field(default="seed")),
        ("negative_prompt", "str | None", field(default="negative_prompt")),
        *[(role, "str | None", field(default=None)) for role in SETTING_ROLES],  # JobConfig names them by role
        ("carry", "tuple[str, ...]", field(default=())),  # input columns carried into manifests and outputs, as typed
        ("template_fields", "tuple[str, ...]", field(default=())),
    ],  # input columns the prompt template reads
    namespace={"roles": _roles, "present": _present, "__doc__": "Input column names per role; see above."},
    frozen=True,
)
Columns.__module__ = __name__  # pickled by reference (it travels to workers inside a WorkerSpec)
freeze()


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
            raise InputError(
                f"Row group {shard.row_group} of {shard.path} has {seen} rows; shard {shard.id} needs "
                f"rows {shard.offset}-{end - 1} of it (the file changed since the job started?)."
            )
        return pa.Table.from_batches(batches).slice(shard.offset - first, shard.length)

    try:
        return guarded("read", shard.path, read)
    except (StorageError, OSError, pa.ArrowException) as err:  # OSError: pyarrow's own, over corrupt bytes
        raise InputError(f"Could not read row group {shard.row_group} of {shard.path}: {err}") from err
