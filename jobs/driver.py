"""The job, end to end: read config → shard → claim the output → dispatch → collect → summarise.

    files = footers of the input            (no rows read here)
    shards = row ranges of row groups       (stable ids)
    OUT/job.json                            (or: same job → resume; other job → refuse)
    skip shards whose manifest exists       (committed earlier)
    pool of actors pulls shards             (cluster/)
    OUT/summary.json, OUT/_SUCCESS          (the latter only when every shard committed)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from fleetgen.errors import ClusterError, InputError, StorageError
from jobs.config import JobConfig, resolve_paths
from jobs.dataset import describe_columns, write_card
from jobs.fleet import FleetRecord
from jobs.lock import OutputLock
from jobs.models import HUB_ENV, MAX_ADAPTERS, describe, pin_revision, resolve_adapters, resolve_defaults
from jobs.progress import Progress
from jobs.sharding import (
    distinct_strings,
    largest,
    list_input_files,
    plan_shards,
    read_footers,
    resolve_columns,
)
from jobs.state import (
    claim_output,
    fingerprint,
    list_manifests,
    pinned_revision,
    shard_counts,
    write_counts_index,
)
from workers.commit import finish_attempts
from workers.layout import SUCCESS, SUMMARY, manifest_key
from workers.shard import Shard
from workers.storage import STORAGE_ENV, Output
from workers.worker import BatchDone, ShardResult, WorkerSpec

PROBE_AT_MOST = 1000  # shards attempted without a report that the end of a run looks at one by one
CLOSE_TIMEOUT = 10.0  # seconds workers get to close (remove offload directories) at the end
STOPPING_CLOSE = 0.5  # the same under SIGTERM: `ray job stop` SIGKILLs the driver 3 s after it by default


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
    error: str | None = None  # why the run ended early (no worker could be placed, the store failed)
    error_exit: int = 2  # the exit code `error` gives: 2 nothing could run, 1 the store failed (a rerun resumes)

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
class _Run:
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
    error: str | None = None  # why the run was stopped early (the store stopped answering)

    def lost_store(self, reason: str) -> None:
        """The lock's heartbeat has failed for its whole lease: stop as on SIGTERM, exit 1."""
        self.error = f"{reason}; stopped: committed shards are kept, rerun the same command to resume"
        self.progress.log(f"stopping: {self.error}")
        self.output.patience = 1  # what is left to write is tried once each: the store is known to be down
        self.stop.set()


def run_job(config: JobConfig, progress_stream=None, progress_interval: float = 5.0,
            stop: threading.Event | None = None) -> JobSummary:
    """Run (or resume) the job. SIGTERM/SIGINT, or `stop` being set, stop dispatching; running
    shards get `config.stop_grace` seconds to commit, then are abandoned (redone by a rerun)."""
    started = time.monotonic()
    config = resolve_paths(config)
    output = Output(config.output)
    output.check()  # a file in the way, no permission, no credentials, no endpoint: one line, before anything
    files = read_footers(list_input_files(config.input))
    if sum(f.num_rows for f in files) == 0:
        raise InputError(f"`--input` {config.input} has no rows ({len(files)} file(s), all empty).")
    columns = resolve_columns(files, config.columns(), config.prompt_template, config.column_list("keep_columns"),
                              config.column_list("drop_columns"))
    config, pin_note = pin_revision(config, pinned_revision(output, config.model))
    config, family, sources = resolve_defaults(config, columns)
    adapters = resolve_adapters(config, columns, distinct_strings(files, columns.lora, MAX_ADAPTERS))
    plan_size = (max(config.width, largest(files, columns.width) or 0),
                 max(config.height, largest(files, columns.height) or 0))
    shards = plan_shards(files, config.rows_per_shard)
    stop = stop or threading.Event()
    lock = OutputLock(output)
    note = lock.acquire()
    try:
        claim_output(output, config, fingerprint(config, files, columns), shards_total=len(shards),
                     family={**family.to_dict(), "sources": sources})
        _sweep(output)
        listing = list_manifests(output)  # the run's one listing of shards/: the end adds what this run committed
        todo = [s for s in shards if s.id not in listing]
        retry = _with_errors(output, [s for s in shards if s.id in listing], listing) if config.retry_errors else []
        redone = {s.id for s in retry}  # counted as to do again
        progress = Progress(len(shards), sum(s.length for s in shards), shards_done=len(shards) - len(todo) - len(retry),
                            rows_done=sum(s.length for s in shards if s.id in listing and s.id not in redone),
                            stream=progress_stream, interval=progress_interval)
        lock.say = progress.log
        progress.log(describe(config, family, sources))
        for line in (pin_note, note, describe_columns(config, columns, adapters)):
            if line:
                progress.log(line)
        if len(todo) < len(shards):
            progress.log(f"resuming: {len(shards) - len(todo)} of {len(shards)} shards already committed")
        if config.retry_errors:
            progress.log(f"--retry-errors: {len(retry)} committed shard(s) have error rows; only those rows are redone")
        run = _Run(output, shards, todo + retry, listing, progress, stop, started=started)
        lock.on_lost = run.lost_store
        fleet = FleetRecord(output, say=progress.log)
        try:
            if run.todo:
                run.failures, run.workers = _dispatch(config, columns, run, fleet, adapters, plan_size)
        except ClusterError as err:
            # Work done before the fleet was lost is still committed: say so in the summary. A job
            # that never placed a worker leaves nothing but job.json.
            if fleet.workers:
                fleet.flush()
                _finish(run, error=str(err))
            raise
        if not run.error:  # a status record; under an outage the summary is the one write worth trying
            fleet.flush()
        summary, counts = _finish(run)
        if counts is not None:
            try:
                write_card(output, config, family, columns, files[0].schema, summary, counts)
            except StorageError as err:
                progress.log(f"dataset card not written ({err}); the next run writes it")
        return summary
    finally:
        lock.release()


def _finish(run: _Run, error: str | None = None) -> tuple[JobSummary, dict[str, dict] | None]:
    """Sweep, summarise, write summary.json (and _SUCCESS); returns the summary and every committed
    shard's counts (None when the store failed). When the store fails here, the job still ends
    cleanly: the summary comes from what this run's workers reported, summary.json is written if
    the store takes it, no _SUCCESS, exit 1 with the reason in one line; a rerun resumes."""
    counts = None
    try:
        if run.error:  # the store is known to be down: no sweep, no listing; one try at the summary
            raise StorageError(run.error)
        _sweep(run.output)  # what workers killed mid-write (by a fault, or by the pool's shutdown) left
        summary, counts = _summarise(run)
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


def _sweep(output: Output) -> None:
    """Where no shard attempt runs (before the workers start, after they are closed): finish the
    commit of attempts that won but died moving their objects, remove every other attempt's
    staging (workers/commit.py), and temporary files of local writers that died."""
    finish_attempts(output)
    output.sweep_tmp("shards")  # (objects elsewhere reach their keys by a rename or a copy: never partial)


def _summarise(run: _Run) -> tuple[JobSummary, dict[str, dict]]:
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


def _summarise_offline(run: _Run) -> JobSummary:
    """The summary from this run's reports alone (the store does not answer): shards committed
    earlier count as committed, their images are not counted."""
    committed = set(run.listing) | {s for s, r in run.committed.items() if r.counts}
    summary = _summary(run, [r.counts for r in run.committed.values() if r.counts])
    summary.shards_committed = len(committed & {s.id for s in run.shards})
    return summary


def _summary(run: _Run, counts: list[dict]) -> JobSummary:
    total = {k: sum(c[k] for c in counts) for k in ("ok", "error", "filtered", "images")}
    return JobSummary(
        output=run.output.url, shards_total=len(run.shards), shards_committed=len(counts),
        shards_skipped=len(run.shards) - len(run.todo), images_ok=total["ok"], images_filtered=total["filtered"],
        images_error=total["images"] - total["ok"] - total["filtered"],
        seconds=round(time.monotonic() - run.started, 3), failures=run.failures, workers=run.workers,
        stopped=run.stop.is_set(),
    )


@contextmanager
def _stop_on_signals(stop: threading.Event, progress: Progress):
    """SIGTERM (`ray job stop`) and SIGINT set `stop` instead of killing the driver mid-write."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        progress.log(f"{signal.Signals(signum).name}: no new shards; writing what is committed")
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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


def _with_errors(output: Output, committed: list[Shard], listing: dict[str, str]) -> list[Shard]:
    """Committed shards whose manifest has error rows, to be redone (only those rows) by `--retry-errors`."""
    counts = shard_counts(output, listing)
    return [replace(s, retry_errors=True) for s in committed if counts.get(s.id, {}).get("error")]


def _dispatch(config: JobConfig, columns, run: _Run, fleet: FleetRecord, adapters=(),
              plan_size=None) -> tuple[list[dict], list[dict]]:
    """Run `run.todo` on a pool of actors that follows the cluster; returns (failed shards, per-worker table)."""
    from cluster import WorkerPool, connect, disconnect, size_fleet

    todo, progress, stop = run.todo, run.progress, run.stop
    shape = connect(config.ray_address)
    pool = None
    try:
        # After connect: Ray installs its own SIGTERM handler there, ours must sit on top of it.
        with _stop_on_signals(stop, progress):
            budgets = config.worker_budgets()
            gpu_memory, host_memory = config.budgets()
            sizing = size_fleet(shape, device=config.device, gpus_per_worker=config.gpus_per_worker,
                                cpu_threads=config.cpu_threads, max_workers=config.max_workers or config.workers,
                                budgets=len(budgets), host_memory=host_memory, shards=len(todo))

            def spec_for(i: int) -> WorkerSpec:
                return WorkerSpec(
                    name=f"w{i}", model=config.model, output=config.output, settings=config.settings(),
                    columns=columns, max_batch=config.max_batch, device=config.device, dtype=config.dtype,
                    threads=sizing.threads, trust_remote_code=config.trust_remote_code, offload=config.offload,
                    gpu_memory=budgets[i % len(budgets)] if budgets else gpu_memory, host_memory=host_memory,
                    strict_prompts=config.strict_prompts, revision=config.revision, variant=config.variant,
                    adapters=adapters, plan_size=plan_size,
                )

            progress.log(f"{sizing.describe()}; {len(todo)} shard(s) to generate")
            pool = WorkerPool(spec_for, sizing.options, sizing.max_workers, max_attempts=config.max_attempts,
                              max_restarts=config.max_restarts, placement_timeout=config.placement_timeout,
                              env_vars={k: os.environ[k] for k in (*HUB_ENV, *STORAGE_ENV) if k in os.environ})
            return _follow(pool.run(todo, stop=stop, grace=config.stop_grace), todo, progress, fleet, run.committed)
    finally:
        if pool is not None:
            # Under `ray job stop` the driver has seconds before SIGKILL: close briefly, then kill.
            pool.close(timeout=STOPPING_CLOSE if stop.is_set() else CLOSE_TIMEOUT)
            fleet.close_all("stopped" if stop.is_set() else "the job ended")
        disconnect()


def _follow(events, todo: list[Shard], progress: Progress, fleet: FleetRecord,
            committed: dict[str, ShardResult]) -> tuple[list[dict], list[dict]]:
    """Turn the pool's events into progress, the fleet record, the failure list and the per-worker table."""
    from cluster import (
        ShardFailed,
        ShardSpeculated,
        Tick,
        Waiting,
        WorkerFailed,
        WorkerLost,
        WorkerPlaced,
        WorkerReady,
        WorkerReleased,
        WorkerUnreachable,
    )

    lengths = {s.id: s.length for s in todo}
    counted = dict.fromkeys(lengths, 0)  # rows shown per shard, so that retries do not count twice
    table: dict[str, dict] = {}
    failures = []
    for event in events:
        if isinstance(event, Tick):
            progress.update()  # redrawn every interval even while no batch finishes
        elif isinstance(event, WorkerPlaced):
            p = event.placement
            where = f"{p['host']} ({p['node_ip']})" + (f", GPU {','.join(p['gpu_ids'])}" if p["gpu_ids"] else "")
            where += f" [{p['gpu_type']}]" if p.get("gpu_type") else ""
            fleet.note(event.worker, "placed", "loading", where, host=p["host"], node_ip=p["node_ip"],
                       gpu_type=p.get("gpu_type"))
            progress.log(f"{event.worker} placed on {where}; loading the model")
        elif isinstance(event, WorkerReady):
            progress.start_clock()
            plan, info = event.info["plan"], event.info
            row = table.setdefault(event.worker, {"worker": event.worker, "images": 0, "seconds": 0.0, "starts": 0})
            gpu_type = (info.get("placement") or {}).get("gpu_type")
            row.update(device=info["device"]["name"], gpu_type=gpu_type, host=(info.get("placement") or {}).get("host"),
                       device_memory=info["probe"]["total_bytes"], budget=plan["budget_bytes"] or None,
                       modes=plan["modes"], batch=plan["batch_size"], reason=plan["reason"], starts=row["starts"] + 1,
                       warnings=info.get("warnings") or [])
            again = " again (restarted)" if row["starts"] > 1 else ""
            fleet.note(event.worker, "ready", "ready", info["device"]["name"], device=info["device"]["name"])
            progress.log(f"{event.worker} ready{again} on {info['device']['name']} "
                         f"(loaded in {info['load_seconds']:.1f} s): {plan['reason']}")
            for warning in row["warnings"]:
                progress.log(f"WARNING {event.worker}: {warning}")
        elif isinstance(event, WorkerFailed):
            where = f" on {event.placement['host']}" if event.placement else ""
            table[event.worker] = {"worker": event.worker, "images": 0, "seconds": 0.0, "starts": 0,
                                   "failed": event.error}
            fleet.note(event.worker, "failed", "failed", event.error)
            progress.log(f"{event.worker}{where} cannot run, the job goes on without it: {event.error}")
        elif isinstance(event, WorkerLost):
            then = "Ray restarts it when capacity allows" if event.restarting else "dropped (died too often)"
            fleet.note(event.worker, "lost", "restarting" if event.restarting else "lost", event.error)
            progress.log(f"{event.worker} lost ({event.error}); its shard goes back on the queue; {then}")
        elif isinstance(event, WorkerUnreachable):
            fleet.note(event.worker, "unreachable", "unreachable", event.error)
            progress.log(f"{event.worker} unreachable while running {event.shard_id} ({event.error}); the shard "
                         "waits until the worker answers or is known dead, so that it never runs twice at once")
        elif isinstance(event, WorkerReleased):
            fleet.note(event.worker, "released", "released", event.reason)
            progress.log(f"{event.worker} released: {event.reason}")
        elif isinstance(event, Waiting):
            progress.log(f"waiting {event.seconds:.0f} s for {event.pending} worker(s) to be placed "
                         f"(each asks {event.asks}); an autoscaler may be starting nodes"
                         + (f". {event.hint}" if event.hint else ""))
        elif isinstance(event, BatchDone):
            rows = min(event.rows, lengths[event.shard_id] - counted[event.shard_id])
            counted[event.shard_id] += rows
            progress.update(images=event.images, rows=rows)  # row errors: counted when their shard commits
        elif isinstance(event, ShardSpeculated):
            progress.speculated += 1
            progress.log(f"straggler: {event.shard_id} has run {event.running_seconds:.0f} s; also given to "
                         f"idle {event.worker} (first commit wins)")
        elif isinstance(event, ShardResult):
            if event.version is not None:
                committed[event.shard_id] = event
            table[event.worker]["images"] += event.ok
            table[event.worker]["seconds"] += event.seconds
            # as the summary counts them: error rows of committed manifests (filtered images are not errors)
            errors = event.counts["error"] if event.counts else 0
            progress.update(shards=1, rows=lengths[event.shard_id] - counted[event.shard_id], errors=errors)
            counted[event.shard_id] = lengths[event.shard_id]
        elif isinstance(event, ShardFailed):
            failures.append({"shard": event.shard_id, "error": event.error, "attempts": event.attempts})
            progress.update(failed=1)
            progress.log(f"shard {event.shard_id} failed after {event.attempts} attempt(s): {event.error}")
    total = sum(w["images"] for w in table.values()) or 1
    for w in table.values():
        w["images_per_second"] = round(w["images"] / w["seconds"], 3) if w["seconds"] else None
        w["share"] = round(w["images"] / total, 3)
    return failures, sorted(table.values(), key=lambda w: int(w["worker"][1:]))
