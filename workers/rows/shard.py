"""A shard: a row range of one row group of one Parquet file, and how a worker reads its rows.
(`workers/rows/batches.py` turns the rows into images and batches.)"""

from __future__ import annotations

from dataclasses import dataclass, field

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
IDENTITY_ROLES = ("prompt", "id", "seed", "negative_prompt")
ROLES = (*IDENTITY_ROLES, *SETTING_ROLES)
freeze()  # the roles are read: a field added after this would have no column option


def _identity() -> dict[str, str | None]:
    return {role: role for role in IDENTITY_ROLES}


@dataclass(frozen=True)
class Columns:
    """The input's column for each role it plays (`by_role`: {role: column}, a role absent or None
    where the input has no such column), the columns carried into the outputs as they are, and the
    columns a prompt template reads. A role of the field table is a key here with no other change."""

    by_role: dict[str, str | None] = field(default_factory=_identity)  # prompt None: a template builds it
    carry: tuple[str, ...] = ()  # input columns carried into manifests and outputs, as typed
    template_fields: tuple[str, ...] = ()  # input columns the prompt template reads

    @classmethod
    def of(
        cls,
        prompt: str | None = "prompt",
        id: str | None = "id",
        seed: str | None = "seed",
        negative_prompt: str | None = "negative_prompt",
        *,
        carry: tuple[str, ...] = (),
        template_fields: tuple[str, ...] = (),
        **settings: str | None,
    ) -> Columns:
        """The identity roles' columns in order, the per-row settings' by role (`steps="steps"`)."""
        unknown = [r for r in settings if r not in SETTING_ROLES]
        if unknown:
            raise ValueError(f"no role `{unknown[0]}` in the field table (roles: {', '.join(ROLES)})")
        names = {"prompt": prompt, "id": id, "seed": seed, "negative_prompt": negative_prompt, **settings}
        return cls(names, tuple(carry), tuple(template_fields))

    def __getitem__(self, role: str) -> str | None:
        """The input's column for `role`, or None."""
        return self.by_role.get(role)

    def roles(self) -> dict[str, str]:
        """{role: column} for the roles the input has."""
        return {role: self[role] for role in ROLES if self[role]}

    def present(self) -> list[str]:
        """Every input column a worker reads, once each."""
        return list(dict.fromkeys([*self.roles().values(), *self.template_fields, *self.carry]))

    def record(self) -> dict:
        """As job.json's fingerprint holds them: every role (None where absent), then the carried columns."""
        return {
            **{role: self[role] for role in ROLES},
            "carry": list(self.carry),
            "template_fields": list(self.template_fields),
        }


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
