"""Does the pool keep up with a big fleet? N fake workers, each a batch of `--batch-seconds` per
pipeline call and nothing written, driven by the real `WorkerPool` loop over real Ray streams.

A process per fake worker would need tens of GB here (a Ray worker process is ~50 MB), so the
fake workers are virtual: `--hosts` async Ray actors each serve N / hosts of them, and every
virtual worker's calls (`where`, `start`, `iter_shard`, `close`) are real Ray calls on its host,
`iter_shard` a real streaming generator — what the pool's loop sees per worker is what a real
actor gives it (one stream, one event per batch). Measured on the workers' side:
  busy          the fraction of each worker's time from its first shard's start to its last
                shard's end spent inside shards (goal ≥ 98 % at 1 s per batch)
  driver cpu    the driver process's CPU time over the run's wall time (of one core)
  shard time    how long a shard took inside its worker (ideal: batches x batch seconds; the excess
                is the fake hosts emitting events on a machine the whole simulation shares)
  dispatch      the gap between a worker's shard ending and its next shard starting (the
                round trip through the pool's loop), median / p99 / max
  driver part   of that gap, the driver's own: from the shard's result reaching the driver to
                the driver sending that worker its next shard

    python bench/pool_sim.py [--workers 1000] [--batch-seconds 1.0] [--batches 8] [--shards-per-worker 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetgen.cluster.actor import RayActors  # noqa: E402
from fleetgen.cluster.events import ShardSpeculated  # noqa: E402
from fleetgen.cluster.pool import WorkerPool  # noqa: E402
from fleetgen.workers.rows.shard import Shard  # noqa: E402
from fleetgen.workers.spec import BatchDone, ShardResult  # noqa: E402


@ray.remote
class SimHost:
    """Serves virtual workers: each shard is `batches` sleeps of `batch_seconds`, one event each."""

    def __init__(self, batch_seconds: float, batches: int, ledger: str):
        self.batch_seconds, self.batches, self.ledger = batch_seconds, batches, ledger
        self.spans: dict[int, list[tuple[float, float]]] = {}  # worker -> (start, end) of each shard

    async def where(self, index: int) -> dict:
        return {"host": "sim", "node_ip": "127.0.0.1", "gpu_ids": [], "pid": os.getpid(), "worker": index}

    async def start(self, index: int, spec=None) -> dict:
        return {"pid": os.getpid(), "worker": index}

    async def iter_shard(self, index: int, shard: Shard):
        """As a worker does: a batch at a time, stopping once another attempt has committed (a
        speculative copy of a straggler); the commit creates a marker only if absent."""
        start, marker = time.time(), os.path.join(self.ledger, shard.id)
        for _ in range(self.batches):
            if os.path.exists(marker):
                self.spans.setdefault(index, []).append((start, time.time()))
                yield ShardResult(shard.id, f"w{index}", 0, 0, time.time() - start, committed_by_other=True)
                return
            await asyncio.sleep(self.batch_seconds)
            yield BatchDone(shard.id, f"w{index}", 1, 0, rows=shard.length / self.batches)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            won = True
        except FileExistsError:
            won = False
        self.spans.setdefault(index, []).append((start, time.time()))
        yield ShardResult(
            shard.id,
            f"w{index}",
            self.batches if won else 0,
            0,
            time.time() - start,
            committed_by_other=not won,
            version="sim" if won else None,
        )

    async def close(self, index: int) -> None:
        return None

    async def spans_of(self) -> dict[int, list[tuple[float, float]]]:
        return self.spans


class _Call:
    def __init__(self, host, method: str, index: int, submitted: list | None = None):
        self.method, self.index, self.submitted = getattr(host, method), index, submitted

    def remote(self, *args):
        if self.submitted is not None:
            self.submitted.append((self.index, time.time()))
        return self.method.remote(self.index, *args)


class VirtualWorker:
    """A handle that answers the pool's calls on its host, as an actor handle would."""

    def __init__(self, host, index: int, submitted: list):
        self.index = index
        for method in ("where", "start", "iter_shard", "close"):
            setattr(self, method, _Call(host, method, index, submitted if method == "iter_shard" else None))


class SimActors(RayActors):
    """The pool's worker factory: virtual workers spread over `hosts` async actors."""

    def __init__(self, hosts: int, batch_seconds: float, batches: int, ledger: str):
        self.hosts = [
            SimHost.options(max_concurrency=100_000, num_cpus=0).remote(batch_seconds, batches, ledger)
            for _ in range(hosts)
        ]
        self.made = 0
        self.submitted: list[tuple[int, float]] = []  # (worker, when the driver sent it a shard)

    def create(self, spec, options, env_vars, max_restarts):
        worker = VirtualWorker(self.hosts[self.made % len(self.hosts)], self.made, self.submitted)
        self.made += 1
        return worker

    def kill(self, handle) -> None:
        pass  # nothing runs between calls

    def retire(self, handle, closed: bool) -> None:
        pass

    def spans(self) -> dict[int, list[tuple[float, float]]]:
        out = {}
        for spans in ray.get([h.spans_of.remote() for h in self.hosts]):
            out.update(spans)
        return out


def _quantiles(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {}
    return {
        "median": round(1000 * statistics.median(values), 1),
        "p99": round(1000 * values[int(0.99 * (len(values) - 1))], 1),
        "max": round(1000 * values[-1], 1),
    }


def simulate(workers: int, batch_seconds: float, batches: int, shards_per_worker: int, hosts: int) -> dict:
    """Run `workers * shards_per_worker` shards on `workers` virtual workers; returns the measures."""
    ledger = tempfile.mkdtemp(prefix="fleetgen-pool-sim-")  # the "committed" markers
    actors = SimActors(hosts, batch_seconds, batches, ledger)
    ray.get([h.spans_of.remote() for h in actors.hosts])  # hosts up before the clock starts
    shards = [Shard(f"shard-{i:07d}", "sim", 0, 0, 0, 0, batches) for i in range(workers * shards_per_worker)]
    pool = WorkerPool(lambda i: None, {}, workers, actors=actors)
    started, cpu, events, batches_seen, results, speculated = time.time(), time.process_time(), 0, 0, set(), 0
    reported: dict[int, float] = {}  # worker -> when its last shard's result reached the driver
    driver_gaps = []
    for event in pool.run(shards):
        events += 1
        batches_seen += isinstance(event, BatchDone)
        if isinstance(event, ShardResult):
            results.add(event.shard_id)
            reported[int(event.worker[1:])] = time.time()
        while actors.submitted:  # the driver's part of a gap: from a result to the worker's next shard
            worker, when = actors.submitted.pop()
            if worker in reported:
                driver_gaps.append(when - reported.pop(worker))
        speculated += isinstance(event, ShardSpeculated)
    wall, cpu = time.time() - started, time.process_time() - cpu
    pool.close(timeout=5)
    spans = actors.spans()
    shutil.rmtree(ledger, ignore_errors=True)
    busy = inside = 0.0
    gaps = []
    for worker_spans in spans.values():
        worker_spans.sort()
        inside += sum(end - start for start, end in worker_spans)
        busy += worker_spans[-1][1] - worker_spans[0][0]
        gaps += [b[0] - a[1] for a, b in zip(worker_spans, worker_spans[1:], strict=False)]
    gaps.sort()
    starts = [sp[0][0] for sp in spans.values()]
    ends = [sp[-1][1] for sp in spans.values()]
    ideal = shards_per_worker * batches * batch_seconds
    return {
        "workers": workers,
        "hosts": hosts,
        "batch_seconds": batch_seconds,
        "batches_per_shard": batches,
        "shards": len(shards),
        "speculated": speculated,
        "events": events,
        "batch_events": batches_seen,
        "shards_reported": len(results),
        "wall_seconds": round(wall, 2),
        "ideal_seconds": round(ideal, 2),
        "workers_that_ran": len(spans),
        "first_shard_started_s": round(min(starts) - started, 2) if starts else None,
        "last_worker_started_s": round(max(starts) - started, 2) if starts else None,
        "last_shard_ended_s": round(max(ends) - started, 2) if ends else None,
        "mean_shard_seconds": round(inside / max(1, sum(len(v) for v in spans.values())), 3),  # ideal: batches x batch
        "busy_fraction": round(inside / busy, 4) if busy else None,
        "driver_cpu_fraction": round(cpu / wall, 3),  # of one core, the pool's loop and Ray's client in the driver
        "driver_dispatch_ms": _quantiles(driver_gaps),
        "dispatch_ms": {
            "median": round(1000 * statistics.median(gaps), 1) if gaps else None,
            "p99": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 1) if gaps else None,
            "max": round(1000 * gaps[-1], 1) if gaps else None,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--batch-seconds", type=float, default=1.0)
    parser.add_argument("--batches", type=int, default=8, help="batches per shard")
    parser.add_argument("--shards-per-worker", type=int, default=4)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = simulate(args.workers, args.batch_seconds, args.batches, args.shards_per_worker, args.hosts)
    finally:
        ray.shutdown()
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
