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

A crash between the commit and the end of the move leaves staging behind: `finish_attempts` (the
driver's start and end, `fleetgen verify --fix`) completes the move for the attempt the manifest
names; other staging is removed only where no attempt can still win (every shard committed, or
`verify --fix`). A worker commits only while the job's lock names its driver (`check_fence`).
"""

from __future__ import annotations

import io
import json
import posixpath

import pyarrow as pa
import pyarrow.parquet as pq

from fleetgen.errors import ShardError
from fleetgen.workers.output.layout import JOB, LOCK, MANIFEST_SCHEMA, STAGING, keeps, manifest_key
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


def manifest_bytes(
    records: list[dict], table: pa.Table, carry: tuple[str, ...], rows: list[int], attempt: str, counts: dict
) -> bytes:
    """The manifest: one row per image, then the carried input columns of each image's row (`rows`:
    each image's row in `table`); its metadata names the attempt whose objects it names."""
    manifest = pa.Table.from_pylist(records, schema=MANIFEST_SCHEMA)
    for name in carry:
        manifest = manifest.append_column(table.schema.field(name), table.column(name).take(rows))
    manifest = manifest.replace_schema_metadata({ATTEMPT_KEY: attempt.encode(), COUNTS_KEY: json.dumps(counts)})
    buf = io.BytesIO()
    pq.write_table(manifest, buf)
    return buf.getvalue()


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


def promote(output: Output, shard_id: str, attempt: str, named: set[str], prefixes: list[str]) -> int:
    """The winner's staged objects to their final keys; then objects under the format's per-image
    `prefixes` (OutputFormat.object_prefixes: `images/<shard>` for files) that the manifest does not
    name (`named`) are removed, and the staging. Returns objects moved."""
    prefix = staging(shard_id, attempt)
    staged = output.find(prefix.rstrip("/"))

    def move(key: str) -> None:
        try:
            output.move(key, key[len(prefix) :])
        except FileNotFoundError:  # moved meanwhile by the other party finishing this commit (a sweep, or its worker)
            if not output.exists(key[len(prefix) :]):
                raise

    output.each(move, staged)
    check_moved(output, shard_id, [key[len(prefix) :] for key in staged])
    kept = keeps(named)  # a clip's poster and frames stay with it
    for key in (k for prefix in prefixes for k in output.find(prefix)):
        if not kept(key):
            output.remove(key)
    discard(output, shard_id, attempt)
    return len(staged)


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


def job_format(output: Output):
    """The output format of the job at `output`, as its job.json records it."""
    from fleetgen.workers.output.formats import get_format

    return get_format(json.loads(output.get(JOB))["fingerprint"]["generation"]["output_format"])


def finish_attempts(output: Output, discard_others: bool = True) -> tuple[int, int]:
    """Finish the move of every committed attempt whose staging is still there; with
    `discard_others`, remove every other staging. Returns (attempts finished, attempts removed).

    Staging no manifest names may belong to an attempt that is still running: a dead driver's
    worker dies seconds after it (on another host, when Ray gets to it), and it may commit after
    this sweep. Removing its staging then leaves a manifest naming objects that are gone. So only
    where no attempt can still win is it removed: every shard committed (an attempt's commit is
    create-if-absent: it loses), or `verify --fix` on a job whose lock is stale. Finishing a
    winner's move is safe at any time: its worker, if alive, moves the same objects."""
    finished = removed = 0
    fmt = None
    for shard_id in output.list(STAGING):
        try:
            manifest = output.get(manifest_key(shard_id))
        except FileNotFoundError:
            manifest = None
        winner = attempt_of(manifest) if manifest else None
        for attempt in output.list(f"{STAGING}/{shard_id}"):
            if attempt == winner:
                fmt = fmt or job_format(output)
                promote(output, shard_id, attempt, named_objects(manifest), fmt.object_prefixes(shard_id))
                finished += 1
            elif discard_others:
                discard(output, shard_id, attempt)
                removed += 1
        if discard_others:
            output.remove(f"{STAGING}/{shard_id}")
        output.prune(f"{STAGING}/{shard_id}")  # local disks keep empty directories
    return finished, removed
