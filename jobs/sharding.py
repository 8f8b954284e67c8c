"""Cutting the input into shards from Parquet footers alone.

A shard is a row range inside one row group: row groups are the unit a reader can fetch, and a
big row group is split into `rows_per_shard` ranges so that a single-row-group file of 100k rows
still spreads over every worker. Shard ids number the shards in input order, so the same input
and `rows_per_shard` always give the same ids (that is what makes resume work).
"""

from __future__ import annotations

import glob as globlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fleetgen.errors import InputError
from fleetgen.workers.output.fields import roles
from fleetgen.workers.output.layout import RESERVED_COLUMNS
from fleetgen.workers.output.storage import guarded, resolve_url, url_to_fs
from fleetgen.workers.rows.batches import template_fields
from fleetgen.workers.rows.shard import ROLES, Columns, Shard


@dataclass(frozen=True)
class InputFile:
    url: str
    size: int  # bytes
    row_groups: tuple[int, ...]  # rows per row group
    schema: pa.Schema
    metadata: pq.FileMetaData | None = field(default=None, compare=False, repr=False)  # the footer (statistics)

    @property
    def num_rows(self) -> int:
        return sum(self.row_groups)


def list_input_files(url: str) -> list[str]:
    """One Parquet file, every `*.parquet` under a directory, or a glob; sorted, as full URLs."""
    url = resolve_url(url)
    fs, path = url_to_fs(url)

    def find() -> list[str] | None:
        if globlib.has_magic(path):
            return [p for p in fs.glob(path) if fs.isfile(p)]
        if fs.isdir(path):
            found = [p for p in fs.find(path) if p.endswith(".parquet")]
            if not found:
                raise InputError(f"`--input` {url} is a directory with no `*.parquet` files in it.")
            return found
        return [path] if fs.exists(path) else None

    paths = guarded("list", url, find)
    if paths is None:
        raise InputError(f"`--input` {url} does not exist.")
    if not paths:
        raise InputError(f"`--input` {url} matches no files.")
    return [fs.unstrip_protocol(p) if "://" in url else p for p in sorted(paths)]


def read_footer(url: str) -> InputFile:
    fs, path = url_to_fs(url)

    def read() -> tuple[pq.FileMetaData, int]:
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f, pre_buffer=False).metadata, fs.size(path)

    try:
        meta, size = guarded("read", url, read)
        schema = meta.schema.to_arrow_schema()
    except pa.ArrowInvalid as err:
        raise InputError(f"`--input` file {url} is not a readable Parquet file: {err}") from err
    groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return InputFile(url=url, size=size, row_groups=groups, schema=schema, metadata=meta)


_STRING = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view, pa.types.is_null)
_INT = (pa.types.is_integer, pa.types.is_null)
_NUMBER = (pa.types.is_integer, pa.types.is_floating, pa.types.is_null)
_KIND_CHECKS = {  # a field's kind (workers/output/fields.py): (type checks, what the type must be)
    "text": (_STRING[:3], "a string"),
    "string": (_STRING, "a string"),
    "int": (_INT, "an integer"),
    "number": (_NUMBER, "a number"),
    "id": ((*_STRING[:3], pa.types.is_integer), "a string or integer"),
    "image": (
        (*_STRING, pa.types.is_binary, pa.types.is_large_binary, pa.types.is_struct, pa.types.is_list),
        "image bytes, a `datasets` Image struct {bytes, path}, a path or URL, or a list of those",
    ),
}


def _kinds() -> dict[str, tuple[tuple, str]]:
    """role: (type checks, what the column's type must be), from the field table."""
    kinds = {}
    for f in roles():
        checks, must = _KIND_CHECKS[f.kind]
        kinds[f.role] = (checks, f"{must} ({f.hint})" if f.hint else must)
    return kinds


def _in_every_file(files: list[InputFile], name: str, what: str) -> bool:
    """Whether every file has column `name` (False: none has it); some but not all is schema drift."""
    have = [f for f in files if name in f.schema.names]
    if 0 < len(have) < len(files):
        f = next(f for f in files if name not in f.schema.names)
        raise InputError(
            f"{what} `{name}` is in {have[0].url} but not in {f.url}: all input files must have the same columns."
        )
    return bool(have)


def resolve_columns(
    files: list[InputFile],
    wanted: Columns | Mapping[str, str | None],
    template: str | None = None,
    keep: list[str] | None = None,
    drop: list[str] | None = None,
) -> Columns:
    """Check the columns the job reads against every file, and choose the columns carried through.

    The prompt column (or, with a template, every column the template names) must be in every
    file; an optional role's column is used when every file has it. Every other column is carried
    into the manifests and outputs with its type, unless `keep`/`drop` say otherwise."""
    first = files[0]
    listed = ", ".join(first.schema.names)
    resolved = {}
    fields = template_fields(template) if template is not None else []
    for name in fields:
        if not _in_every_file(files, name, "Template column"):
            raise InputError(
                f"`--prompt-template` names column `{name}`, which {first.url} does not have (columns: {listed})."
            )
    kinds = _kinds()
    for role in ROLES:
        name = wanted[role]
        if role == "prompt" and template is not None:
            resolved[role] = None  # the template builds the prompt
            continue
        present = _in_every_file(files, name, "Column")
        if role == "prompt" and not present:
            raise InputError(
                f"Input column `{name}` not found in {first.url} (columns: {listed}). "
                "Pass `--prompt-column NAME`, or build prompts with `--prompt-template`."
            )
        if not present:
            resolved[role] = None
            continue
        checks, must = kinds[role]
        for f in files:
            kind = f.schema.field(name).type
            if not any(check(kind) for check in checks):
                raise InputError(
                    f"Column `{name}` in {f.url} has type {kind}; the {role.replace('_', ' ')} column must be {must}."
                )
        resolved[role] = name
    roles = {n for n in resolved.values() if n}
    for option, names in (("--keep-columns", keep), ("--drop-columns", drop)):
        unknown = [n for n in names or [] if n not in first.schema.names]
        if unknown:
            raise InputError(f"`{option}` names `{unknown[0]}`, which {first.url} does not have (columns: {listed}).")
    carry = [n for n in first.schema.names if n not in roles and (keep is None or n in keep) and n not in (drop or [])]
    for name in carry:
        _in_every_file(files, name, "Column")
        if name in RESERVED_COLUMNS:
            raise InputError(
                f"Input column `{name}` would be carried into the outputs, which have a `{name}` column "
                f"of their own. Pass `--drop-columns {name}` (a template can still read it), or rename it."
            )
    return Columns(resolved, tuple(carry), tuple(fields))


def largest(files: list[InputFile], column: str | None) -> int | None:
    """The largest value of an integer column, from the row groups' statistics (read from the
    footers already in hand) where they have them, else from the column itself."""
    if column is None:
        return None
    best = None
    for f in files:
        meta = f.metadata or read_footer(f.url).metadata
        # the Parquet leaf column (list or struct columns before it make its index differ from Arrow's)
        index = next((i for i in range(meta.num_columns) if meta.schema.column(i).path == column), None)
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(index).statistics if index is not None else None
            if stats is not None and stats.has_min_max:
                top = stats.max
            elif stats is not None and stats.null_count == meta.row_group(g).num_rows:
                continue
            else:  # no statistics: read the column of this row group
                top = pc.max(_read_row_group(f.url, g, column)).as_py()
            if top is not None:
                best = top if best is None else max(best, top)
    return best


def distinct_strings(files: list[InputFile], column: str | None, limit: int) -> list[str]:
    """The distinct non-null values of a string column (at most `limit`+1 are kept: more is an error
    for the caller to word)."""
    if column is None:
        return []
    seen: dict[str, None] = {}
    for f in files:
        for g in range(len(f.row_groups)):
            values = pc.unique(_read_row_group(f.url, g, column).drop_null())
            seen.update(dict.fromkeys(values.to_pylist()))
            if len(seen) > limit:
                return list(seen)
    return list(seen)


def _read_row_group(url: str, group: int, column: str) -> pa.ChunkedArray:
    fs, path = url_to_fs(url)

    def read() -> pa.ChunkedArray:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f, pre_buffer=False)  # no pool work: see workers.storage.read_parquet
            return pf.read_row_group(group, columns=[column], use_threads=False).column(0)

    return guarded("read", url, read)


def plan_shards(files: list[InputFile], rows_per_shard: int) -> list[Shard]:
    """Every shard of the input, in order. Ids have one width for the whole job (at least 5
    digits, more past 99,999 shards), so that they sort as they are numbered."""
    total = sum(-(-rows // rows_per_shard) for f in files for rows in f.row_groups)
    width = max(5, len(str(total - 1)))
    shards = []
    for file_index, f in enumerate(files):
        start = 0
        for group, rows in enumerate(f.row_groups):
            for offset in range(0, rows, rows_per_shard):
                shards.append(
                    Shard(
                        id=f"shard-{len(shards):0{width}d}",
                        path=f.url,
                        file_index=file_index,
                        row_group=group,
                        row_group_start=start,
                        offset=offset,
                        length=min(rows_per_shard, rows - offset),
                    )
                )
            start += rows
    return shards


def read_footers(urls: list[str], threads: int = 16) -> list[InputFile]:
    """Every file's footer, fetched concurrently (object stores answer each in tens of ms), in order."""
    if len(urls) == 1:
        return [read_footer(urls[0])]
    with ThreadPoolExecutor(max_workers=min(threads, len(urls))) as pool:
        return list(pool.map(read_footer, urls))
