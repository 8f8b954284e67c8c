"""The job, end to end: read config → shard → claim the output → dispatch → collect → summarise.

files = footers of the input            (no rows read here)
shards = row ranges of row groups       (stable ids)
OUT/job.json                            (or: same job → resume; other job → refuse)
skip shards whose manifest exists       (committed earlier)
pool of actors pulls shards             (cluster/)
OUT/summary.json, OUT/_SUCCESS          (the latter only when every shard committed)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

from fleetgen.errors import ClusterError, ConfigError, InputError, StorageError
from fleetgen.jobs.config import JobConfig, resolve_paths
from fleetgen.jobs.dataset import describe_columns, write_card
from fleetgen.jobs.fleet import FleetRecord, follow
from fleetgen.jobs.hub import HUB_ENV
from fleetgen.jobs.inputs import check_unchanged
from fleetgen.jobs.lock import OutputLock
from fleetgen.jobs.models import MAX_ADAPTERS, describe, resolve_model
from fleetgen.jobs.progress import Progress
from fleetgen.jobs.sharding import (
    distinct_strings,
    largest,
    list_input_files,
    plan_shards,
    read_footers,
    resolve_columns,
)
from fleetgen.jobs.state import claim_output, fingerprint, list_manifests, pinned, shard_counts, sweep
from fleetgen.jobs.summary import JobSummary, Run, finish
from fleetgen.workers.families.table import TEXT
from fleetgen.workers.output.formats import PLUGINS_ENV
from fleetgen.workers.output.parts import parts_counts
from fleetgen.workers.output.storage import STORAGE_ENV, Output
from fleetgen.workers.rows.shard import Shard
from fleetgen.workers.spec import WorkerSpec

CLOSE_TIMEOUT = 10.0  # seconds workers get to close (remove offload directories) at the end
STOPPING_CLOSE = 0.5  # the same under SIGTERM: `ray job stop` SIGKILLs the driver 3 s after it by default


def run_job(
    config: JobConfig, progress_stream=None, progress_interval: float = 5.0, stop: threading.Event | None = None
) -> JobSummary:
    """Run (or resume) the job. SIGTERM/SIGINT, or `stop` being set, stop dispatching; running
    shards get `config.stop_grace` seconds to commit, then are abandoned (redone by a rerun)."""
    started = time.monotonic()
    job = resolve_job(config)
    stop = stop or threading.Event()
    lock = OutputLock(job.output)
    note = lock.acquire()
    try:
        run = _open_run(job, lock, note, stop, started, progress_stream, progress_interval)
        fleet = FleetRecord(job.output, say=run.progress.log)
        try:
            if run.todo:
                _dispatch(job, run, fleet)
        except ClusterError as err:
            # Work done before the fleet was lost is still committed: say so in the summary. A job
            # that never placed a worker leaves nothing but job.json.
            if fleet.workers:
                fleet.flush()
                finish(run, error=str(err))
            raise
        if not run.error:  # a status record; under an outage the summary is the one write worth trying
            fleet.flush()
        else:
            fleet.close()  # no more writes: the store is down, or the output is another driver's now
        summary, counts = finish(run)
        if counts is not None:
            try:
                write_card(job.output, job.config, job.family, job.columns, job.files[0].schema, summary, counts)
            except StorageError as err:
                run.progress.log(f"dataset card not written ({err}); the next run writes it")
        return summary
    finally:
        lock.release()


@dataclass(frozen=True)
class Job:
    """A job as the driver resolved it, before anything is written: paths, the input's footers and
    columns, the pinned model, the family's defaults, the adapters, the largest size, the shards."""

    config: JobConfig  # with the family's defaults and the pinned revision
    output: Output
    files: list
    columns: object
    family: object
    sources: dict  # {setting: where its value came from}
    adapters: tuple
    plan_size: tuple[int, int]
    shards: list[Shard]
    pin_note: str | None


def refuse_unsafe_commits(config: JobConfig, output: Output) -> None:
    """A store whose backend cannot create-if-absent atomically could keep two attempts' work for one
    shard: refused (exit 2) unless the user accepts it."""
    reason = output.unsafe_commit_reason()
    if reason and not config.allow_unsafe_commits:
        raise ConfigError(
            f"`--output {config.output}`: {reason}. Use a local disk, s3://, gs:// or az://, or pass "
            "`--allow-unsafe-commits` to accept it."
        )


def resolve_job(config: JobConfig) -> Job:
    config = resolve_paths(config)
    output = Output(config.output)
    refuse_unsafe_commits(config, output)
    output.check()  # a file in the way, no permission, no credentials, no endpoint: one line, before anything
    files, columns = read_input(config)
    revision, scorer_commits = pinned(output, config.source.model)  # an earlier run's pins: kept
    r = resolve_model(
        config,
        columns,
        lambda column: distinct_strings(files, column, MAX_ADAPTERS),
        lambda column: largest(files, column),
        revision,
        scorer_commits,
    )
    shards = plan_shards(files, r.config.rows_per_shard)
    return Job(r.config, output, files, columns, r.family, r.sources, r.adapters, r.plan_size, shards, r.pin_note)


def _open_run(
    job: Job, lock: OutputLock, note: str | None, stop: threading.Event, started: float, stream, interval: float
) -> Run:
    """Claim the output for this job, find what is committed, and the run of what is left (`note`:
    what taking the lock said)."""
    config, output, shards = job.config, job.output, job.shards
    fingerprinted = fingerprint(config, job.files, job.columns)
    family = {**job.family.to_dict(), "sources": job.sources}
    claim_output(output, config, fingerprinted, shards_total=len(shards), family=family)
    sweep(output, discard=False)  # a dead driver's workers may still commit: their staging stays
    listing = list_manifests(output)  # the run's one listing of shards/: the end adds what this run committed
    todo = [s for s in shards if s.id not in listing]
    if config.generation.task != TEXT and len(todo) < len(shards):  # inputs are part of the images made
        check_unchanged(output, [s.id for s in shards if s.id in listing])
    retry = _with_errors(output, [s for s in shards if s.id in listing], listing) if config.retry_errors else []
    redone = {s.id for s in retry}  # counted as to do again
    # rows an earlier run committed in parts of shards left open: done, each shard goes on after them
    in_parts = {k: c["rows"] for k, c in parts_counts(output, set(listing)).items()} if todo else {}
    progress = Progress(
        len(shards),
        sum(s.length for s in shards),
        shards_done=len(shards) - len(todo) - len(retry),
        rows_done=sum(s.length for s in shards if s.id in listing and s.id not in redone) + sum(in_parts.values()),
        stream=stream,
        interval=interval,
        unit="clip" if config.generation.task_spec().video else "image",
    )
    lock.say = progress.log
    progress.log(describe(config, job.family, job.sources))
    for line in (job.pin_note, note, describe_columns(config, job.columns, job.adapters)):
        if line:
            progress.log(line)
    if len(todo) < len(shards):
        progress.log(f"resuming: {len(shards) - len(todo)} of {len(shards)} shards already committed")
    if in_parts:
        progress.log(
            f"resuming: {sum(in_parts.values())} rows of {len(in_parts)} open shard(s) committed in parts; "
            "each goes on from there"
        )
    if config.retry_errors:
        progress.log(f"--retry-errors: {len(retry)} committed shard(s) have error rows; only those rows are redone")
    run = Run(
        output, shards, todo + retry, listing, progress, stop, started=started, lock_token=lock.token, in_parts=in_parts
    )
    lock.on_lost = run.lost_lock
    return run


def read_input(config: JobConfig):
    """The input's footers and the columns the job reads from them (an input with no rows is refused)."""
    files = read_footers(list_input_files(config.input))
    if sum(f.num_rows for f in files) == 0:
        raise InputError(f"`--input` {config.input} has no rows ({len(files)} file(s), all empty).")
    columns = resolve_columns(
        files,
        config.columns,
        config.generation.prompt_template,
        config.column_list("keep_columns"),
        config.column_list("drop_columns"),
    )
    return files, columns


def worker_spec(config: JobConfig, name: str, columns, adapters=(), **resolved) -> WorkerSpec:
    """What worker `name` is given: the job's records, with what the driver decides per worker
    (`adapters`; `resolved`: the Fit's budgets and plan size, `threads`, `lock_token`)."""
    if not config.generation.resolved:
        raise ValueError("worker_spec() needs the family's defaults resolved (jobs.models.resolve_defaults)")
    fit = {k: resolved.pop(k) for k in ("gpu_memory", "host_memory", "plan_size") if k in resolved}
    g = config.generation
    fit["shard_images"] = config.rows_per_shard * max(g.images_per_prompt, 1) * max(g.best_of, 1)
    return WorkerSpec(
        name,
        config.output,
        replace(config.source, adapters=adapters),
        config.generation,
        columns,
        replace(config.fit, **fit),
        **resolved,
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


def _with_errors(output: Output, committed: list[Shard], listing: dict[str, str]) -> list[Shard]:
    """Committed shards whose manifest has error rows, to be redone (only those rows) by `--retry-errors`."""
    counts = shard_counts(output, listing)
    return [replace(s, retry_errors=True) for s in committed if counts.get(s.id, {}).get("error")]


def _dispatch(job: Job, run: Run, fleet: FleetRecord) -> None:
    """Run `run.todo` on a pool of actors that follows the cluster; the run records its failures,
    commits and per-worker table."""
    from fleetgen.cluster import WorkerPool, connect, disconnect, reclaim_nodes, size_fleet

    config, columns = job.config, job.columns
    todo, progress, stop = run.todo, run.progress, run.stop
    shape = connect(config.ray_address)
    pool = None
    try:
        # After connect: Ray installs its own SIGTERM handler there, ours must sit on top of it.
        with _stop_on_signals(stop, progress):
            budgets = config.worker_budgets()
            sizing = size_fleet(
                shape,
                device=config.source.device,
                gpus_per_worker=config.gpus_per_worker,
                cpu_threads=config.cpu_threads,
                max_workers=config.max_workers,
                budgets=len(budgets),
                host_memory=config.fit.host_memory,
                shards=len(todo),
            )

            def spec_for(i: int) -> WorkerSpec:
                return worker_spec(
                    config,
                    f"w{i}",
                    columns,
                    adapters=job.adapters,
                    threads=sizing.threads,
                    plan_size=job.plan_size,
                    lock_token=run.lock_token,
                    commit_interval=config.commit_interval,
                    **({"gpu_memory": budgets[i % len(budgets)]} if budgets else {}),
                )

            progress.log(f"{sizing.describe()}; {len(todo)} shard(s) to generate")
            pool = WorkerPool(
                spec_for,
                sizing.options,
                sizing.max_workers,
                max_attempts=config.max_attempts,
                max_restarts=config.max_restarts,
                placement_timeout=config.placement_timeout,
                env_vars={k: os.environ[k] for k in (*HUB_ENV, *STORAGE_ENV, PLUGINS_ENV) if k in os.environ},
            )
            follow(pool.run(todo, stop=stop, grace=config.stop_grace), run, fleet)
    finally:
        if pool is not None:
            # Under `ray job stop` the driver has seconds before SIGKILL: close briefly, then kill.
            pool.close(timeout=STOPPING_CLOSE if stop.is_set() else CLOSE_TIMEOUT)
            fleet.close_all("stopped" if stop.is_set() else "the job ended")
            if not stop.is_set():  # the node copies its killed workers left (a stopping driver has no time)
                reclaim_nodes()
        run.workers = fleet.table()
        disconnect()
