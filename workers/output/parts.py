"""Commits inside a shard: parts, and the manifest they become.

A shard's attempt commits what it has made every `--commit-interval` seconds (and when its process
is told to stop) as a *part*: the records of the images of a row range `[first, end)`, stored as
`parts/<shard>/<first>.parquet` and created only if absent, as a manifest is (`Output.create`). A
part's objects stay under the staging they were made in (`_attempts/<shard>/<staging>/`) until the
shard's manifest names them.

The parts of a shard form one chain from row 0: an attempt creates only the part that starts where
the chain it read ends. So a create that finds the key taken means another attempt extended the
chain first; the loser reads the chain's end and goes on after it. No row is ever in two parts.

The manifest is the chain's records followed by the finishing attempt's own rows after it (its
*tail*, never a part), created only if absent: whoever creates it first wins, and only the manifest's
winner moves objects to their final keys — each part's from its own staging (one object per image),
or, where a shard's images share one object (a tar, a Parquet file), the parts' objects merged into
one under the winner's staging first. Then the parts and their staging go. A crash between the two
leaves parts beside a manifest: `finish_attempts` (the driver's start and end, `fleetgen verify
--fix`) completes it, and compacts a chain that covers every row with no manifest yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from fleetgen.errors import ShardError
from fleetgen.workers.output.commit import (
    COUNTS_KEY,
    attempt_of,
    commit_manifest,
    counts_of,
    discard,
    named_objects,
    promote,
    staging,
    table_bytes,
)
from fleetgen.workers.output.layout import JOB, PARTS, STAGING, manifest_key, part_key, part_prefix
from fleetgen.workers.output.storage import Output, parquet_schema, read_parquet

PART_KEY = b"fleetgen.part"  # a part's metadata: {"first", "end", "rows" (the shard's), "staging"}
SOURCES_KEY = b"fleetgen.sources"  # a manifest's: [[staging, start, stop]]: its rows whose objects each staging holds


@dataclass(frozen=True)
class Part:
    """Rows `[first, end)` of a shard of `rows` rows, their objects under `staging`; `data` its bytes."""

    first: int
    end: int
    rows: int
    staging: str
    data: bytes

    def table(self) -> pa.Table:
        return read_parquet(self.data).replace_schema_metadata(None)


def part_bytes(table: pa.Table, staging_name: str, first: int, end: int, rows: int) -> bytes:
    """A part as stored: the records of its images (`table`, as a manifest's) and where it sits."""
    statuses = table.column("status").to_pylist()
    counts = counts_of([{"status": s} for s in statuses], end - first)
    where = {"first": first, "end": end, "rows": rows, "staging": staging_name}
    return table_bytes(table, staging_name, counts, {PART_KEY: json.dumps(where)})


def part_of(data: bytes, where: str) -> Part:
    """A stored part; `ShardError` for an object that is not one."""
    try:
        raw = (parquet_schema(data).metadata or {})[PART_KEY]
        d = json.loads(raw)
        return Part(int(d["first"]), int(d["end"]), int(d["rows"]), str(d["staging"]), data)
    except (KeyError, ValueError, TypeError, pa.ArrowException) as err:
        raise ShardError(f"{where} is not a fleetgen part ({err}); `fleetgen verify --fix` removes it") from None


def _names(output: Output, shard_id: str) -> list[str]:
    return output.list(part_prefix(shard_id), ".parquet")


def chain_end(output: Output, shard_id: str) -> int:
    """The first row after a shard's committed parts (0: none): one listing, one read."""
    names = _names(output, shard_id)
    if not names:
        return 0
    key = f"{part_prefix(shard_id)}/{names[-1]}"
    return part_of(output.get(key), output.key_url(key)).end


def read_chain(output: Output, shard_id: str) -> list[Part]:
    """A shard's parts in row order, checked to follow one another from row 0."""
    keys = [f"{part_prefix(shard_id)}/{n}" for n in _names(output, shard_id)]
    parts = [part_of(data, output.key_url(key)) for key, data in output.get_many(keys).items()]
    at = 0
    for key, part in zip(keys, parts, strict=True):
        if part.first != at or key != part_key(shard_id, part.first) or part.end <= part.first:
            raise ShardError(
                f"Shard {shard_id}: its parts do not follow one another at {output.key_url(key)} "
                f"(rows {part.first}-{part.end}, expected a part from row {at}); `fleetgen verify --fix` removes them"
            )
        at = part.end
    return parts


def parts_counts(output: Output, committed: set[str]) -> dict[str, dict]:
    """{shard: its parts' counts summed ("rows", "images", "ok", "error", "filtered")} for every shard
    with parts and no manifest (`committed`: the shards that have one): running shards, and shards
    whose attempts were lost. One listing, and the parts of those shards read (a few per worker)."""
    out = {}
    for shard_id in sorted(set(output.list(PARTS)) - committed):
        total: dict[str, int] = {}
        try:
            chain = read_chain(output, shard_id)
        except (ShardError, FileNotFoundError):  # removed meanwhile (compacted), or damaged: `verify` says
            continue
        for part in chain:
            raw = (parquet_schema(part.data).metadata or {}).get(COUNTS_KEY)
            for k, v in json.loads(raw).items():
                total[k] = total.get(k, 0) + v
        if chain:
            out[shard_id] = total
    return out


def commit_part(output: Output, shard_id: str, part: Part) -> bool:
    """Create the part; False when another attempt's part starts at its row (that one stays)."""
    return output.create(part_key(shard_id, part.first), part.data)


def sources_of(manifest: bytes) -> list[tuple[str, set[str]]]:
    """(staging, the final keys of the objects it holds for the manifest) for each staging a manifest's
    objects come from: its parts' and its tail's, or the one it was made or merged in."""
    spans = json.loads((parquet_schema(manifest).metadata or {}).get(SOURCES_KEY) or "null")
    images = read_parquet(manifest, columns=["image"]).column("image").to_pylist()
    if not spans:
        return [(attempt_of(manifest), {k for k in images if k})]
    return [(name, {k for k in images[start:stop] if k}) for name, start, stop in spans]


def compact(output: Output, shard_id: str, fmt, pieces: list[Part], name: str) -> tuple[bool, bytes]:
    """The shard's manifest from `pieces` (its parts in order, then a finishing attempt's tail),
    created only if absent. Where the format keeps one object per image, each piece's staging holds
    its own; where the images share an object, the pieces' objects are merged under staging `name`
    first. Returns (won, the manifest's bytes); `StorageError` from the create: not known whether it
    landed."""
    tables = [p.table() for p in pieces]
    table = pa.concat_tables(tables)
    statuses = table.column("status").to_pylist()
    counts = counts_of([{"status": s} for s in statuses], pieces[-1].rows)
    if len(pieces) == 1 or fmt.object_prefixes(shard_id):
        spans, at = [], 0
        for piece, t in zip(pieces, tables, strict=True):
            spans.append([piece.staging, at, at + t.num_rows])
            at += t.num_rows
    else:
        ok = [
            (
                staging(shard_id, p.staging),
                [r for r in t.select(["id", "status", "member"]).to_pylist() if r["status"] == "ok"],
            )
            for p, t in zip(pieces, tables, strict=True)
        ]
        fmt.merge(output, shard_id, ok, staging(shard_id, name))
        spans = [[name, 0, table.num_rows]]
    manifest = table_bytes(table, spans[0][0], counts, {SOURCES_KEY: json.dumps(spans)})
    return commit_manifest(output, shard_id, manifest), manifest


def settle(
    output: Output, shard_id: str, manifest: bytes, fmt, chain: list[Part], merged: tuple[str, ...] = (), present=None
) -> int:
    """After a manifest is committed: its sources' objects to their final keys, the stagings merged
    into it removed (its parts' and `merged`), then its parts. `present`: the stagings still there
    (None: ask). Returns the sources finished."""
    present = set(output.list(f"{STAGING}/{shard_id}")) if present is None else present
    named = sources_of(manifest)
    sources = [(n, keys) for n, keys in named if n in present]
    if sources:
        promote(output, shard_id, sources, named_objects(manifest), fmt.object_prefixes(shard_id))
    for name in {p.staging for p in chain} | set(merged):
        if name in present and name not in {n for n, _ in named}:
            discard(output, shard_id, name)
    if chain:
        output.remove(part_prefix(shard_id))
    return len(sources)


def job_format(output: Output):
    """The output format of the job at `output`, as its job.json records it."""
    from fleetgen.workers.output.formats import get_format

    return get_format(json.loads(output.get(JOB))["fingerprint"]["generation"]["output_format"])


def finish_attempts(output: Output, discard_others: bool = True) -> tuple[int, int]:
    """Finish every commit a crash interrupted: move the objects of every committed manifest's
    sources still in staging, remove the parts of committed shards, compact a chain of parts that
    covers every row of its shard; with `discard_others`, remove every other staging but the parts'.
    Returns (attempts finished, attempts removed).

    Staging no manifest or part names may belong to an attempt that is still running: a dead driver's
    worker dies seconds after it (on another host, when Ray gets to it), and it may commit after
    this sweep. Removing its staging then leaves a manifest naming objects that are gone. So only
    where no attempt can still win is it removed: every shard committed (an attempt's commit is
    create-if-absent: it loses), or `verify --fix` on a job whose lock is stale. Finishing a
    winner's move is safe at any time: its worker, if alive, moves the same objects."""
    finished = removed = 0
    fmt = None
    with_parts = set(output.list(PARTS))
    for shard_id in sorted(set(output.list(STAGING)) | with_parts):
        try:
            manifest = output.get(manifest_key(shard_id))
        except FileNotFoundError:
            manifest = None
        try:
            chain = read_chain(output, shard_id) if shard_id in with_parts else []
        except ShardError:  # damaged parts: `verify` reports them, `verify --fix` cuts them
            if manifest is None:
                continue  # its staging kept: nothing here can tell what of it is committed
            chain = []
            output.remove(part_prefix(shard_id))  # the manifest is the commit: its parts are spent
        present = set(output.list(f"{STAGING}/{shard_id}"))
        if manifest is None and chain and chain[-1].end >= chain[-1].rows:  # every row in parts: compact
            fmt = fmt or job_format(output)
            name = f"compacted-{chain[-1].staging}"
            won, manifest = compact(output, shard_id, fmt, chain, name)
            manifest = manifest if won else output.get(manifest_key(shard_id))
            present.add(name)
        if manifest is not None:
            fmt = fmt or job_format(output)
            finished += settle(output, shard_id, manifest, fmt, chain, present=present)
            keep = {n for n, _ in sources_of(manifest)} | {p.staging for p in chain}
        else:
            keep = {p.staging for p in chain}  # committed rows: their objects wait for the manifest
        if discard_others:
            for attempt in sorted(present - keep):
                discard(output, shard_id, attempt)
                removed += 1
        output.prune(f"{STAGING}/{shard_id}")  # local disks keep empty directories
        output.prune(part_prefix(shard_id))
    return finished, removed
