"""An attempt at a shard and its commits: parts as it goes (workers/output/parts.py), then the shard's
manifest (workers/output/commit.py), created only if absent; what an attempt that loses, fails or is told
to stop leaves. The making is workers/worker.py's; this module is what is committed of it, and when."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from fleetgen.errors import ShardError, StorageError
from fleetgen.workers.best_of import BestOf
from fleetgen.workers.output.commit import (
    COUNTS_KEY,
    check_fence,
    commit_manifest,
    committed_since,
    counts_of,
    discard,
    manifest_bytes,
    promote,
    records_table,
)
from fleetgen.workers.output.formats import get_format
from fleetgen.workers.output.layout import manifest_key
from fleetgen.workers.output.parts import Part, chain_end, commit_part, compact, part_bytes, read_chain, settle
from fleetgen.workers.output.storage import Output, parquet_schema
from fleetgen.workers.output.writer import Writer
from fleetgen.workers.rows.batches import WorkItem
from fleetgen.workers.rows.shard import Shard
from fleetgen.workers.spec import PartCommitted, ShardResult, WorkerSpec


@dataclass
class Attempt:
    """One attempt at a shard, from its reading to its commit."""

    shard: Shard
    id: str  # this attempt's name
    table: pa.Table  # the shard's input rows
    images: list[WorkItem]
    records: dict[str, dict]  # the manifest's rows, by image id, filled in as images are made
    todo: list[WorkItem]  # what this attempt makes (a retry: the error rows only)
    kept: set[str]  # a retry: ids whose committed record stays as it is
    base: bytes | None  # a retry: the committed manifest it replaces
    sink: object
    started: float = field(default_factory=time.perf_counter)
    failures: int = 0  # images the pipeline failed
    counts: dict | None = None  # the committed manifest's counts
    pending: list = field(default_factory=list)  # phased with a decode phase: (made, inputs) awaiting it
    best_of: BestOf | None = None  # `--best-of`: each image's candidates, held until all are made
    watch: bool = True  # stop once another attempt commits (False: rows of a Ray Data stage, never committed)
    parts: bool = False  # commits in parts (workers/output/parts.py) every `commit_interval` seconds
    start: int = 0  # the first row this attempt makes: where the shard's committed parts end
    piece: str = ""  # the staging its objects go under now, `<id>-<start>`: a part's, or the tail's
    last_part: float = field(default_factory=time.monotonic)
    made: int = 0  # images it set out to make
    committed: int = 0  # of them, in its committed parts and manifest
    decided: tuple = (0, 0)  # (ok, errors) its manifest committed, its parts' not counted
    done: set = field(default_factory=set)  # ids of images made (or failed) in this pass
    fresh: dict = field(default_factory=dict)  # each record as it was before anything was made

    def __post_init__(self) -> None:
        self.piece = self.piece or f"{self.id}-{self.start:08d}"
        self.fresh = {k: dict(v) for k, v in self.records.items()}

    @property
    def rows(self) -> int:
        return self.table.num_rows

    def images_in(self, first: int, end: int) -> list[WorkItem]:
        return [im for im in self.images if first <= im.row < end]

    def result(self, worker: str, ok: int = 0, errors: int = 0, **kw) -> ShardResult:
        redone = self.made - self.committed
        return ShardResult(self.shard.id, worker, ok, errors, time.perf_counter() - self.started, redone=redone, **kw)


@dataclass(frozen=True)
class Boundary:
    """Every image of the rows before `row` is made (a window's end, or where a notice found the attempt)."""

    row: int
    stop: bool = False


class CommitUnknown(ShardError):
    """The manifest's write failed without saying whether it landed: its staging must stay."""


class Commits:
    """One worker's commits: `open_sink(shard, table, base, staging)` opens a piece's sink; `stats` is
    the worker's, counting the images its commits decide."""

    def __init__(self, output: Output, spec: WorkerSpec, writer: Writer, stats: dict, open_sink: Callable):
        self.output, self.spec, self.writer, self.stats, self.open_sink = output, spec, writer, stats, open_sink

    def seal(self, at: Attempt, first: int, end: int) -> Part:
        """Rows `[first, end)` as a part of this attempt: the writer waited for, the sink closed."""
        self.writer.drain()  # every image written before the commit
        at.sink.close()
        images = at.images_in(first, end)
        table = records_table(
            [at.records[im.id] for im in images], at.table, self.spec.columns.carry, [im.row for im in images]
        )
        return Part(first, end, at.rows, at.piece, part_bytes(table, at.piece, first, end, at.rows))

    def commit_part(self, at: Attempt, end: int) -> PartCommitted | str | None:
        """Commit rows `[start, end)` as a part. Returns its `PartCommitted`; None when there is nothing
        new; "other" when the shard is committed; "moved" when another attempt's part starts at this
        one's row: what this attempt made since is thrown away, and it goes on from the chain's end."""
        if end <= at.start:
            return None
        mine = [im for im in at.todo if at.start <= im.row < end]
        if mine and all(at.records[im.id]["status"] == "error" for im in mine):
            raise ShardError(  # as a whole shard that fails: never committed, the attempt fails
                f"Shard {at.shard.id}: every row from {at.start} to {end} failed in the pipeline; first error: "
                f"{at.records[mine[0].id]['error']}"
            )
        part = self.seal(at, at.start, end)
        check_fence(self.output, at.shard.id, self.spec.lock_token)
        try:
            won = commit_part(self.output, at.shard.id, part)
        except StorageError as err:
            raise CommitUnknown(
                f"Shard {at.shard.id}: could not tell whether its part from row {at.start} landed ({err}); "
                "its staged objects are kept for the driver to finish or remove"
            ) from err
        if not won:
            return self.moved(at)
        at.committed += len(mine)
        ok, errors = self.decided(at, at.images_in(at.start, end))
        event = PartCommitted(at.shard.id, self.spec.name, at.start, end, len(mine), ok, errors)
        self.next_piece(at, end)
        return event

    def decided(self, at: Attempt, images: list[WorkItem]) -> tuple[int, int]:
        """(ok, errors) of the records of `images` this attempt has just committed, in its stats."""
        fresh = [at.records[im.id] for im in images if im.id not in at.kept]
        ok = sum(r["status"] == "ok" for r in fresh)
        self.stats["images"] += ok
        self.stats["errors"] += len(fresh) - ok
        return ok, len(fresh) - ok

    def next_piece(self, at: Attempt, start: int) -> None:
        at.start, at.piece, at.last_part = start, f"{at.id}-{start:08d}", time.monotonic()
        at.sink = self.open_sink(at.shard, at.table, None, at.piece)

    def moved(self, at: Attempt) -> str:
        """Another attempt's part starts where this one's would: this one's staging since goes, and it
        goes on from the chain's end (made again: each row's seed is its own)."""
        self.give_up(at)
        if committed_since(self.output, at.shard.id):
            return "other"
        start = chain_end(self.output, at.shard.id)
        for im in at.images_in(start, at.rows):
            at.records[im.id] = dict(at.fresh[im.id])
        at.todo = [
            im for im in at.images if im.row >= start and at.records[im.id]["status"] == "ok" and im.id not in at.kept
        ]
        at.done, at.failures = set(), 0
        self.next_piece(at, start)
        return "moved"

    def commit(self, at: Attempt) -> tuple[str, str | None]:
        """The shard's manifest: its committed parts' records and this attempt's since (workers/output/
        parts.py), created only if absent; the objects moved to their keys. Returns ("won", the
        manifest's version), ("lost", None) or ("moved", None) (another attempt's part came after the
        chain this one read); `CommitUnknown` when the store did not say whether it landed."""
        tail = self.seal(at, at.start, at.rows)
        chain = read_chain(self.output, at.shard.id) if at.start else []
        if (chain[-1].end if chain else 0) != at.start:
            return self.moved(at), None
        fmt = get_format(self.spec.settings.output_format)
        check_fence(self.output, at.shard.id, self.spec.lock_token)
        try:
            if at.base is not None:  # a retry of error rows: the whole manifest replaces the one it started from
                final = [at.records[im.id] for im in at.images]
                manifest = manifest_bytes(
                    final,
                    at.table,
                    self.spec.columns.carry,
                    [im.row for im in at.images],
                    at.piece,
                    counts_of(final, at.rows),
                )
                won = commit_manifest(self.output, at.shard.id, manifest, at.base)
            else:
                pieces = [*chain, tail] if tail.end > tail.first else chain
                won, manifest = compact(self.output, at.shard.id, fmt, pieces, f"{at.id}-merged")
        except StorageError as err:
            raise CommitUnknown(
                f"Shard {at.shard.id}: could not tell whether its commit landed ({err}); its staged "
                "objects are kept for the driver to finish or remove"
            ) from err
        if not won:
            return "lost", None
        at.counts = json.loads((parquet_schema(manifest).metadata or {})[COUNTS_KEY])
        at.committed += sum(im.row >= at.start for im in at.todo)
        at.decided = self.decided(at, at.images if at.base is not None else at.images_in(at.start, at.rows))
        try:
            version = self.output.version(manifest_key(at.shard.id))  # before the move: nothing else replaces it
        except StorageError:
            version = None  # the driver looks it up
        try:
            if at.base is not None:
                named = {r["image"] for r in final if r["image"]}
                promote(self.output, at.shard.id, [(at.piece, None)], named, fmt.object_prefixes(at.shard.id))
            else:
                settle(self.output, at.shard.id, manifest, fmt, chain, merged=(at.piece,))
        except (StorageError, ShardError) as err:  # committed: what the manifest names must stay
            raise CommitUnknown(
                f"Shard {at.shard.id}: committed, but its objects did not all reach their final keys ({err}); "
                "its staged objects are kept for the driver to finish the move"
            ) from err
        return "won", version

    def give_up(self, at: Attempt) -> None:
        """This attempt lost, failed or was stopped: abort what it opened, remove its staging since its
        last part (its parts' stay: committed). Never raises: it runs while an attempt's own error is on
        its way up (a store that is down would otherwise replace that error with its own), and staging
        it leaves is the driver's to remove."""
        self.writer.cancel()  # the writer thread lets go of the sink first
        try:
            at.sink.abort()
            discard(self.output, at.shard.id, at.piece)
        except StorageError as err:
            print(
                f"[fleetgen] {self.spec.name}: staging of {at.shard.id} left for the driver to remove ({err})",
                flush=True,
            )
