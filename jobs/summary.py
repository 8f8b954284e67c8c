"""The end of a run: what it committed, counted from the workers' reports and the start's listing
(never a second full listing of a large output), written to `OUT/summary.json` (and `_SUCCESS`
when every shard committed). A store that fails here still ends the run cleanly, with exit 1."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fleetgen.errors import StorageError
from fleetgen.jobs.progress import Progress
from fleetgen.jobs.state import list_manifests, shard_counts, sweep, write_counts_index
from fleetgen.workers.output.layout import SUCCESS, SUMMARY, manifest_key
from fleetgen.workers.output.storage import Output
from fleetgen.workers.rows.shard import Shard
from fleetgen.workers.spec import ShardResult

PROBE_AT_MOST = 1000  # shards attempted without a report that the end of a run looks at one by one


@dataclass
class JobSummary:
    output: str
    shards_total: int
    shards_committed: int
    shards_skipped: int  # already committed when this run started
    images_ok: int
    images_error: int  # error rows (not generated)
    images_filtered: int  # generated, then flagged by the pipeline's safety checker and not stored
    seconds: float
    failures: list[dict] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)
    stopped: bool = False  # SIGTERM/SIGINT (e.g. `ray job stop`) ended the run early
    speculative_attempts: int = 0  # straggling shards also given to an idle worker
    images_redone: int = (
        0  # made twice: by an attempt that was lost (or beaten to a commit) and again (per worker: `workers`)
    )
    error: str | None = None  # why the run ended early (no worker could be placed, the store failed)
    error_exit: int = 2  # the exit code `error` gives: 2 nothing could run, 1 the store failed (a rerun resumes)
    unit: str = "image"  # what each made object is: "clip" for video tasks (`images_*` count clips then)

    @property
    def complete(self) -> bool:
        return self.shards_committed == self.shards_total and not self.error

    @property
    def exit_code(self) -> int:
        """What `fleetgen run` exits with: 0 complete, 1 incomplete (rerun resumes), 2 an error."""
        return self.error_exit if self.error else 0 if self.complete else 1

    def to_dict(self) -> dict:
        failed = [{"worker": w["worker"], "error": w["failed"]} for w in self.workers if w.get("failed")]
        return {"complete": self.complete, "exit_code": self.exit_code, **self.__dict__, "workers_failed": failed}


@dataclass
class Run:
    """One run of a job: what the driver knows as it goes, for the end of the run to summarise."""

    output: Output
    shards: list[Shard]
    todo: list[Shard]
    listing: dict[str, str]  # the run's one listing of shards/ (at its start)
    progress: Progress
    stop: threading.Event
    started: float = field(default_factory=time.monotonic)
    committed: dict[str, ShardResult] = field(default_factory=dict)  # what this run committed, as reported
    failures: list[dict] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)
    error: str | None = None  # why the run was stopped early (the store stopped answering, or a take-over)
    taken_over: bool = False  # another driver holds the lock now: this run writes nothing more
    lock_token: str | None = None  # the driver's lock: its workers commit only while `OUT/_LOCK` names it
    in_parts: dict[str, int] = field(default_factory=dict)  # rows committed in parts at the run's start, by shard

    def lost_lock(self, reason: str, taken_over: bool = False) -> None:
        """The lock's heartbeat has failed for its whole lease, or found the lock taken over by another
        driver: stop as on SIGTERM, exit 1. Taken over, the run writes nothing more (no sweep, no
        summary): the output is the other driver's now."""
        if taken_over:
            self.taken_over = True
            self.error = f"{reason}; stopped: committed shards are kept, that driver's run goes on from them"
        else:
            self.error = f"{reason}; stopped: committed shards are kept, rerun the same command to resume"
            self.output.patience = 1  # what is left to write is tried once each: the store is known to be down
        self.progress.log(f"stopping: {self.error}")
        self.stop.set()


def finish(run: Run, error: str | None = None) -> tuple[JobSummary, dict[str, dict] | None]:
    """Summarise, sweep, write summary.json (and _SUCCESS); returns the summary and every committed
    shard's counts (None when the store failed). When the store fails here, the job still ends
    cleanly: the summary comes from what this run's workers reported, summary.json is written if
    the store takes it, no _SUCCESS, exit 1 with the reason in one line; a rerun resumes. Taken over
    by another driver, it writes nothing: the summary is returned, exit 1."""
    counts = None
    try:
        if run.error:  # the store is down or the output taken over: no sweep, no listing
            raise StorageError(run.error)
        summary, counts = _summarise(run)
        # Commits whose workers were killed moving their objects are finished; what other attempts
        # staged goes only once every shard is committed: then none of them can win (workers/output/commit.py).
        sweep(run.output, discard=summary.shards_committed == summary.shards_total)
    except StorageError as err:
        run.output.patience = 1  # the summary and the lock are tried once each, not the whole policy again
        summary = _summarise_offline(run)
        summary.error, summary.error_exit = _store_failed(err), 1
    if run.error:
        summary.error, summary.error_exit = run.error, 1
    if error:
        summary.error, summary.error_exit = error, 2
    summary.speculative_attempts = run.progress.speculated
    run.progress.errors = summary.images_error  # the last progress line says what the summary says
    run.progress.close()
    if run.taken_over:  # the output is another driver's: its run writes the summary
        return summary, None
    try:
        run.output.put(SUMMARY, json.dumps(summary.to_dict(), indent=2).encode())
        if summary.complete:
            run.output.put(SUCCESS, b"")
    except StorageError as err:
        if not summary.error:
            summary.error, summary.error_exit = _store_failed(err), 1
        run.progress.log(f"{SUMMARY} not written: {err}")
    return summary, counts


def _store_failed(err: StorageError) -> str:
    return f"the output store failed at the end of the run ({err}); committed shards are kept, rerun to finish"


def _summarise(run: Run) -> tuple[JobSummary, dict[str, dict]]:
    """Counts of every committed manifest, without listing shards/ again: the start's listing, plus
    the version and counts each commit of this run reported, plus a look at the manifest of each
    shard this run attempted whose report did not arrive (a worker lost after its commit), or one
    listing where there are many (not while stopping). Counts not reported come from the counts index where
    it is current, else from the manifests' footers. The index is then rewritten for the next reader."""
    output, listing, known = run.output, dict(run.listing), {}
    for shard_id, result in run.committed.items():
        listing[shard_id], known[shard_id] = result.version, result.counts
    unreported = [s.id for s in run.todo if s.id not in run.committed]
    if run.stop.is_set():
        pass  # `ray job stop` gives seconds: what was reported is what the summary says; a rerun sees the rest
    elif len(unreported) > PROBE_AT_MOST:  # a run that ended early (a lost fleet): one listing beats many looks
        listing.update(list_manifests(output))
    else:
        for shard_id, version in zip(unreported, _versions(output, unreported), strict=True):
            if version is not None:
                listing[shard_id] = version
    all_counts = shard_counts(output, listing, known=known)
    write_counts_index(output, all_counts, listing)
    ids = {s.id for s in run.shards}
    return _summary(run, [c for s, c in all_counts.items() if s in ids]), all_counts


def _summarise_offline(run: Run) -> JobSummary:
    """The summary from this run's reports alone (the store does not answer): shards committed
    earlier count as committed, their images are not counted."""
    committed = set(run.listing) | {s for s, r in run.committed.items() if r.counts}
    summary = _summary(run, [r.counts for r in run.committed.values() if r.counts])
    summary.shards_committed = len(committed & {s.id for s in run.shards})
    return summary


def _summary(run: Run, counts: list[dict]) -> JobSummary:
    total = {k: sum(c[k] for c in counts) for k in ("ok", "error", "filtered", "images")}
    return JobSummary(
        output=run.output.url,
        shards_total=len(run.shards),
        shards_committed=len(counts),
        shards_skipped=len(run.shards) - len(run.todo),
        images_ok=total["ok"],
        images_filtered=total["filtered"],
        images_error=total["images"] - total["ok"] - total["filtered"],
        seconds=round(time.monotonic() - run.started, 3),
        failures=run.failures,
        workers=run.workers,
        images_redone=sum(w.get("images_redone") or 0 for w in run.workers),
        stopped=run.stop.is_set(),
        unit=run.progress.unit,
    )


def _versions(output: Output, shard_ids: list[str], threads: int = 32) -> list[str | None]:
    """Each shard's manifest version, None where it has none (concurrent: one request each)."""

    def version(shard_id: str) -> str | None:
        try:
            return output.version(manifest_key(shard_id))
        except (FileNotFoundError, StorageError):
            return None

    if not shard_ids:
        return []
    with ThreadPoolExecutor(max_workers=min(threads, len(shard_ids))) as pool:
        return list(pool.map(version, shard_ids))
