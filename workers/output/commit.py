"""The shard commit: the first attempt to commit wins, and a losing attempt can never replace the
winner's bytes.

Every attempt of a shard writes its objects under a staging prefix of its own,
`_attempts/<shard>/<attempt>/<final key>`, which no other attempt writes. It commits by creating the
shard's manifest `shards/<shard>.parquet` only if it is absent — atomically: a hard link on local
disks, a conditional write on S3, GCS and Azure (`Output.create`; on any other backend a job runs
only if the user accepts a check, then a write) — and the manifest records the attempt that won. Only the winner then moves its staged objects to their final keys (`images/...`,
`data/...`) and removes objects under the shard's image prefix that its manifest does not name (left
by an earlier commit of the shard that a redo replaced). A loser removes its staging. An attempt
that cannot tell whether its commit landed (the store stopped answering) keeps its staging: what a
committed manifest names is never deleted.

A crash between the commit and the end of the move leaves staging behind: `finish_attempts`
(workers/output/parts.py: the driver's start and end, `fleetgen verify --fix`) completes the move for
the attempts the manifest names; other staging is removed only where no attempt can still win (every
shard committed, or `verify --fix`). A worker commits only while the job's lock names its driver
(`check_fence`). A shard may also commit in parts before its manifest (workers/output/parts.py).
"""

from __future__ import annotations

import io
import json
import posixpath

import pyarrow as pa
import pyarrow.parquet as pq

from fleetgen.errors import ShardError
from fleetgen.workers.output.layout import LOCK, MANIFEST_SCHEMA, STAGING, keeps, manifest_key
from fleetgen.workers.output.storage import Output, parquet_schema, read_parquet

LOOK_ONE_BY_ONE = 8  # moved keys in one folder checked one by one (above: the folder is listed once)
ATTEMPT_KEY = b"fleetgen.attempt"  # manifest metadata: the attempt whose objects the manifest names
COUNTS_KEY = (
    b"fleetgen.counts"  # manifest metadata: {"rows", "images", "ok", "error", "filtered"}, read from the footer
)


def counts_of(records: list[dict], rows: int) -> dict:
    """What a manifest's footer says about its shard, so that jobs/ can count without its rows."""
    statuses = [r["status"] for r in records]
    return {
        "rows": rows,
        "images": len(records),
        "ok": statuses.count("ok"),
        "error": statuses.count("error"),
        "filtered": statuses.count("filtered"),
    }


def records_table(records: list[dict], table: pa.Table, carry: tuple[str, ...], rows: list[int]) -> pa.Table:
    """One row per image, then the carried input columns of each image's row (`rows`: each image's
    row in `table`)."""
    manifest = pa.Table.from_pylist(records, schema=MANIFEST_SCHEMA)
    for name in carry:
        manifest = manifest.append_column(table.schema.field(name), table.column(name).take(rows))
    return manifest


def table_bytes(manifest: pa.Table, attempt: str, counts: dict, extra: dict[bytes, str] | None = None) -> bytes:
    """A manifest (or a part, workers/output/parts.py) as stored: its metadata names the attempt whose
    objects it names, and its counts."""
    metadata = {ATTEMPT_KEY: attempt.encode(), COUNTS_KEY: json.dumps(counts), **(extra or {})}
    buf = io.BytesIO()
    pq.write_table(manifest.replace_schema_metadata(metadata), buf)
    return buf.getvalue()


def manifest_bytes(
    records: list[dict], table: pa.Table, carry: tuple[str, ...], rows: list[int], attempt: str, counts: dict
) -> bytes:
    """The manifest of a shard made by one attempt in one go."""
    return table_bytes(records_table(records, table, carry, rows), attempt, counts)


def keep_committed(output: Output, shard_id: str, records: dict, place=None) -> tuple[bytes, set[str]]:
    """For a retry of a committed shard's error rows: take every committed record that is not an
    error as it is (its image stays where it is stored). Returns the committed manifest's bytes (if
    they change meanwhile, another attempt committed first) and the ids kept.

    `place(row)`: (the key of `records` a committed row is, the image it is made for) where those differ
    from its id (`--best-of`: candidates, workers/best_of.py). An image is redone whole — every row of
    it — where it has an error row and no stored (ok) row; else all its rows are kept, errors too."""
    try:
        base = output.get(manifest_key(shard_id))
    except FileNotFoundError as err:
        raise ShardError(f"Shard {shard_id} has no committed manifest to retry the error rows of.") from err
    images: dict[str, list[tuple[str, dict]]] = {}
    for old in read_parquet(base, columns=MANIFEST_SCHEMA.names).to_pylist():
        key, image = place(old) if place is not None else (old["id"], old["id"])
        if key in records:
            images.setdefault(image, []).append((key, old))
    kept = set()
    for rows in images.values():
        statuses = {old["status"] for _, old in rows}
        if "error" in statuses and "ok" not in statuses:
            continue  # made again, whole
        for key, old in rows:
            records[key] = old
            kept.add(key)
    return base, kept


def staging(shard_id: str, attempt: str) -> str:
    """The prefix (ending in `/`) an attempt writes its objects under."""
    return f"{STAGING}/{shard_id}/{attempt}/"


def attempt_of(manifest: bytes) -> str | None:
    metadata = parquet_schema(manifest).metadata or {}
    value = metadata.get(ATTEMPT_KEY)
    return value.decode() if value else None


def check_fence(output: Output, shard_id: str, token: str | None) -> None:
    """Before a commit: the job's lock (`OUT/_LOCK`) must still name this worker's driver (`token`).
    A stopped or killed driver's workers live on for seconds (on another host, until Ray gets to
    them); once the lock is released or taken over, the next run owns the output, and the end of
    that run removes staging no manifest names. Such an attempt gives up instead. (A check, then
    the commit: milliseconds apart, where the next run takes `jobs.lock.SETTLE` after writing its
    lock before it even starts.) No token (a worker run outside a job): no check."""
    if token is None:
        return
    try:
        held = json.loads(output.get(LOCK))
    except (FileNotFoundError, ValueError):  # released, or a torn write
        held = {}
    if held.get("token") != token:
        owner = f"is held by another driver ({held.get('owner')})" if held else "was released"
        raise ShardError(f"Shard {shard_id}: not committed, the job's lock {owner}: this worker's driver has ended")


def commit_manifest(output: Output, shard_id: str, manifest: bytes, base: bytes | None = None) -> bool:
    """Commit `manifest`; False when another attempt committed first. The manifest names its
    attempt, so a create the store applied but whose answer was lost reads back as this attempt's
    own (`Output.create` compares the bytes): committed. A `StorageError` means it is not known
    whether the commit landed: the caller must keep its staging (the driver's `finish_attempts`
    then finishes or removes it). `base`: the manifest a retry of error rows started from, replaced
    only if it is still there (a check, then a write: the retry runs under the job's lock, one
    attempt per shard unless a straggler is speculated)."""
    key = manifest_key(shard_id)
    if base is None:
        return output.create(key, manifest)
    try:
        current = output.get(key)
    except FileNotFoundError:
        return False
    if current == manifest:
        return True  # this attempt's put, applied on an earlier try whose answer was lost
    if current != base:
        return False
    output.put(key, manifest)
    return True


def committed_since(output: Output, shard_id: str, base: bytes | None = None) -> bool:
    """Whether an attempt has committed the shard: its manifest exists (a retry: differs from `base`,
    the manifest the retry replaces)."""
    if base is None:
        return output.exists(manifest_key(shard_id))
    try:
        return output.get(manifest_key(shard_id)) != base
    except FileNotFoundError:
        return False


def promote(
    output: Output, shard_id: str, sources: list[tuple[str, set[str] | None]], named: set[str], prefixes: list[str]
) -> int:
    """The winner's staged objects to their final keys: `sources`, each an attempt's staging name
    with the final keys of the objects it holds for the manifest (None: all it holds; a part's
    staging may hold images of rows it did not commit, which stay out). Then objects under the
    format's per-image `prefixes` (OutputFormat.object_prefixes: `images/<shard>` for files) that the
    manifest does not name (`named`) are removed, and the stagings. Returns objects moved."""
    moved: list[str] = []
    for attempt, keys in sources:
        prefix = staging(shard_id, attempt)
        wanted = keeps(keys) if keys is not None else (lambda _key: True)  # a clip's poster and frames too
        staged = [k for k in output.find(prefix.rstrip("/")) if wanted(k[len(prefix) :])]

        def move(key: str, prefix: str = prefix) -> None:
            try:
                output.move(key, key[len(prefix) :])
            except (
                FileNotFoundError
            ):  # moved meanwhile by the other party finishing this commit (a sweep, or its worker)
                if not output.exists(key[len(prefix) :]):
                    raise

        output.each(move, staged)
        moved += [key[len(prefix) :] for key in staged]
    check_moved(output, shard_id, moved)
    kept = keeps(named)  # a clip's poster and frames stay with it
    for key in (k for prefix in prefixes for k in output.find(prefix)):
        if not kept(key):
            output.remove(key)
    for attempt, _ in sources:
        discard(output, shard_id, attempt)
    return len(moved)


def check_moved(output: Output, shard_id: str, moved: list[str]) -> None:
    """Every moved object is at its final key: a store (or a backend's move) that lost one fails the
    attempt instead of reporting it committed; its staging is kept for `finish_attempts`. A folder
    that received many (a shard's images) is listed once; a few keys in a shared folder (a shard's
    tar or Parquet file under `data/`, beside every other shard's) are looked at one by one, so the
    check does not grow with the job."""
    missing: list[str] = []
    by_folder: dict[str, list[str]] = {}
    for key in moved:
        by_folder.setdefault(posixpath.dirname(key), []).append(key)
    for folder, keys in sorted(by_folder.items()):
        if len(keys) > LOOK_ONE_BY_ONE:
            listed = {posixpath.join(folder, name) for name in output.list(folder)}
            missing += [k for k in keys if k not in listed]
        else:
            missing += [k for k in keys if not output.exists(k)]
    if missing:
        raise ShardError(
            f"Shard {shard_id}: {len(missing)} object(s) not at their final keys after the move "
            f"(e.g. {output.key_url(sorted(missing)[0])}); `fleetgen verify --fix` finishes or redoes it"
        )


def discard(output: Output, shard_id: str, attempt: str) -> None:
    """A losing or failed attempt: its staging goes."""
    output.remove(staging(shard_id, attempt).rstrip("/"))
    output.prune(f"{STAGING}/{shard_id}")


def named_objects(manifest: bytes) -> set[str]:
    """The final keys a manifest names (its `image` column)."""
    table = read_parquet(manifest, columns=["image"])
    return {k for k in table.column("image").to_pylist() if k}
