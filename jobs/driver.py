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
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from fleetgen.errors import InputError
from jobs.config import JobConfig
from jobs.lock import OutputLock
from jobs.progress import Progress
from jobs.sharding import check_unique_ids, list_input_files, plan_shards, read_footer, resolve_columns
from jobs.state import claim_output, committed_shards, fingerprint, read_manifests
from workers.layout import SUCCESS, SUMMARY
from workers.shard import Shard
from workers.storage import Output
from workers.worker import BatchDone, ShardResult, WorkerSpec


@dataclass
class JobSummary:
    output: str
    shards_total: int
    shards_committed: int
    shards_skipped: int  # already committed when this run started
    images_ok: int
    images_error: int
    seconds: float
    failures: list[dict] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)
    stopped: bool = False  # SIGTERM/SIGINT (e.g. `ray job stop`) ended the run early
    speculative_attempts: int = 0  # straggling shards also given to an idle worker

    @property
    def complete(self) -> bool:
        return self.shards_committed == self.shards_total

    def to_dict(self) -> dict:
        return {"complete": self.complete, **self.__dict__}


def run_job(config: JobConfig, progress_stream=None, progress_interval: float = 5.0,
            stop: threading.Event | None = None) -> JobSummary:
    """Run (or resume) the job. SIGTERM/SIGINT, or `stop` being set, stop dispatching; running
    shards get `config.stop_grace` seconds to commit, then are abandoned (redone by a rerun)."""
    started = time.monotonic()
    output = Output(config.output)
    files = [read_footer(url) for url in list_input_files(config.input)]
    if sum(f.num_rows for f in files) == 0:
        raise InputError(f"`--input` {config.input} has no rows ({len(files)} file(s), all empty).")
    columns = resolve_columns(files, config.columns())
    check_unique_ids(files, columns)
    shards = plan_shards(files, config.rows_per_shard)
    stop = stop or threading.Event()
    lock = OutputLock(output)
    note = lock.acquire()
    try:
        claim_output(output, config, fingerprint(config, files, columns), shards_total=len(shards))
        _sweep(output)
        done = committed_shards(output)
        todo = [s for s in shards if s.id not in done]
        progress = Progress(len(shards), sum(s.length for s in shards), shards_done=len(shards) - len(todo),
                            rows_done=sum(s.length for s in shards if s.id in done),
                            stream=progress_stream, interval=progress_interval)
        if note:
            progress.log(note)
        if len(todo) < len(shards):
            progress.log(f"resuming: {len(shards) - len(todo)} of {len(shards)} shards already committed")
        failures, workers = _dispatch(config, columns, todo, progress, stop) if todo else ([], [])
        _sweep(output)  # what workers killed mid-write (by a fault, or by the pool's shutdown) left
        progress.close()
        summary = _summarise(output, shards, len(todo), started, failures, workers, stop.is_set())
        summary.speculative_attempts = progress.speculated
        output.put(SUMMARY, json.dumps(summary.to_dict(), indent=2).encode())
        if summary.complete:
            output.put(SUCCESS, b"")
        return summary
    finally:
        lock.release()


def _sweep(output: Output) -> None:
    """Remove temporary files of writers that died, where whole objects of the job live. (Each
    shard attempt sweeps its own images/<shard>/ before writing there.)"""
    for prefix in ("shards", "data"):
        output.sweep_tmp(prefix)


def _summarise(output: Output, shards: list[Shard], todo: int, started: float, failures, workers, stopped) -> JobSummary:
    """Counts from the committed manifests themselves: the truth, whatever this run did."""
    committed = committed_shards(output) & {s.id for s in shards}
    counts = read_manifests(output, sorted(committed), ["status"])
    statuses = [row["status"] for rows in counts.values() for row in rows]
    return JobSummary(
        output=output.url, shards_total=len(shards), shards_committed=len(committed),
        shards_skipped=len(shards) - todo, images_ok=statuses.count("ok"),
        images_error=len(statuses) - statuses.count("ok"), seconds=round(time.monotonic() - started, 3),
        failures=failures, workers=workers, stopped=stopped,
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


def _dispatch(config: JobConfig, columns, todo: list[Shard], progress: Progress,
              stop: threading.Event) -> tuple[list[dict], list[dict]]:
    """Run `todo` on a pool of actors; returns (failed shards, per-worker table)."""
    from cluster import WorkerPool, connect, disconnect

    shape = connect(config.ray_address)
    try:
        # After connect: Ray installs its own SIGTERM handler there, ours must sit on top of it.
        with _stop_on_signals(stop, progress):
            specs, options = _worker_specs(config, columns, shape)
            progress.log(f"{len(specs)} worker(s) on {'GPU' if shape.gpus else 'CPU'}, {len(todo)} shard(s) to generate")
            with WorkerPool(specs, options, max_attempts=config.max_attempts, max_restarts=config.max_restarts) as pool:
                return _follow(pool.run(todo, stop=stop, grace=config.stop_grace), todo, progress)
    finally:
        disconnect()


def _worker_specs(config: JobConfig, columns, shape) -> tuple[list[WorkerSpec], dict]:
    """One actor per GPU (`num_gpus=1`), else `--workers` CPU actors of `--cpu-threads` each; one
    per `--worker-memory` entry when given. Each reserves its share of its node's host RAM as Ray
    `memory`, so the offloaded copies of the actors on one node fit that node."""
    budgets = config.worker_budgets()
    if shape.gpus:
        count, options, threads = len(budgets) or config.workers or shape.gpus, {"num_gpus": 1}, None
    else:
        threads = config.cpu_threads
        count = len(budgets) or config.workers or max(1, shape.cpus // threads)
        options = {"num_cpus": threads}
    gpu_memory, host_memory = config.budgets()
    host_memory = host_memory or shape.host_share(count)
    if host_memory:
        options["memory"] = host_memory
    specs = [
        WorkerSpec(
            name=f"w{i}", model=config.model, output=config.output, settings=config.settings(), columns=columns,
            max_batch=config.max_batch, device=config.device, dtype=config.dtype, threads=threads,
            trust_remote_code=config.trust_remote_code, offload=config.offload,
            gpu_memory=budgets[i] if budgets else gpu_memory, host_memory=host_memory,
            strict_prompts=config.strict_prompts,
        )
        for i in range(count)
    ]
    return specs, options


def _follow(events, todo: list[Shard], progress: Progress) -> tuple[list[dict], list[dict]]:
    """Turn the pool's events into progress, the failure list and the per-worker table."""
    from cluster import ShardFailed, ShardSpeculated, WorkerReady

    lengths = {s.id: s.length for s in todo}
    counted = dict.fromkeys(lengths, 0)  # rows shown per shard, so that retries do not count twice
    table: dict[str, dict] = {}
    failures = []
    for event in events:
        if isinstance(event, WorkerReady):
            progress.start_clock()
            plan = event.info["plan"]
            row = table.setdefault(event.worker, {"worker": event.worker, "images": 0, "seconds": 0.0, "starts": 0})
            row.update(device=event.info["device"]["name"], device_memory=event.info["probe"]["total_bytes"],
                       budget=plan["budget_bytes"] or None, modes=plan["modes"], batch=plan["batch_size"],
                       reason=plan["reason"], starts=row["starts"] + 1)
            again = " again (restarted)" if row["starts"] > 1 else ""
            progress.log(f"{event.worker} ready{again} on {event.info['device']['name']} "
                         f"(loaded in {event.info['load_seconds']:.1f} s): {plan['reason']}")
        elif isinstance(event, BatchDone):
            rows = min(event.images + event.errors, lengths[event.shard_id] - counted[event.shard_id])
            counted[event.shard_id] += rows
            progress.update(images=event.images, errors=event.errors, rows=rows)
        elif isinstance(event, ShardSpeculated):
            progress.speculated += 1
            progress.log(f"straggler: {event.shard_id} has run {event.running_seconds:.0f} s; also given to "
                         f"idle {event.worker} (first commit wins)")
        elif isinstance(event, ShardResult):
            table[event.worker]["images"] += event.ok
            table[event.worker]["seconds"] += event.seconds
            progress.update(shards=1, rows=lengths[event.shard_id] - counted[event.shard_id])
            counted[event.shard_id] = lengths[event.shard_id]
        elif isinstance(event, ShardFailed):
            failures.append({"shard": event.shard_id, "error": event.error, "attempts": event.attempts})
            progress.update(failed=1)
            progress.log(f"shard {event.shard_id} failed after {event.attempts} attempt(s): {event.error}")
    total = sum(w["images"] for w in table.values()) or 1
    for w in table.values():
        w["images_per_second"] = round(w["images"] / w["seconds"], 3) if w["seconds"] else None
        w["share"] = round(w["images"] / total, 3)
    return failures, sorted(table.values(), key=lambda w: w["worker"])
