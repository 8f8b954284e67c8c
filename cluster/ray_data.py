"""fleetgen as a Ray Data stage: an actor pool whose actors are fleetgen's workers (`fleetgen.ray_data.generate`).

The stage is resolved in the caller's process before any actor starts (jobs/stage.py: the settings table,
the family's defaults, the dataset's columns). Each actor is a `FleetWorker` (cluster/actor.py): placed by
Ray, it plans its own device within its share of the node, shares the node's copy of the weights, and makes
each block's rows as a job's worker makes a shard's (workers/worker.py `make_rows`): the same items, seeds,
batches, retries and records; the pictures come back as bytes in the rows instead of going to a store.
Progress is Ray Data's own."""

from __future__ import annotations

import atexit
import itertools
import json
import os
from dataclasses import replace

import pyarrow as pa
import ray

from fleetgen.cluster.actor import FleetWorker
from fleetgen.cluster.connect import connect
from fleetgen.cluster.sizing import size_fleet
from fleetgen.workers.spec import WorkerSpec

BATCH_ROWS = 16  # rows a stage call makes by default: a few of the worker's batches, one block's worth
NO_SHARDS = 1 << 30  # sizing a pool that pulls blocks, not shards: no cap from the work's count


def pool_of(concurrency):
    """Ray Data's actor pool for `concurrency`: an int (that many actors) or `(min, max)` (autoscaling)."""
    from ray.data import ActorPoolStrategy

    from fleetgen.errors import ConfigError

    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1:
        return ActorPoolStrategy(size=concurrency)
    if (
        isinstance(concurrency, tuple | list)
        and len(concurrency) == 2
        and all(isinstance(n, int) for n in concurrency)
        and 1 <= concurrency[0] <= concurrency[1]
    ):
        low, high = concurrency
        return ActorPoolStrategy(size=low) if low == high else ActorPoolStrategy(min_size=low, max_size=high)
    raise ConfigError(
        f"`concurrency` must be a number of actors or `(min, max)` with 1 <= min <= max; got {concurrency!r}."
    )


class StageWorker:
    """One Ray Data actor: a fleetgen worker, started once, called per block (`pyarrow.Table` in and out).
    Its record (at `stats`) is written after every block, so the last one holds its counts whatever way
    the actor ends; a restarted actor (the same name) goes on from the counts its record holds. It leaves
    the node's copy when Ray Data lets it go (`__del__`) or its process exits (`atexit`); what an actor
    ended without either leaves, its driver reclaims (cluster/reclaim.py)."""

    def __init__(self, spec: WorkerSpec, resources: dict, base: str):
        actor_id = ray.get_runtime_context().get_actor_id() or f"{os.getpid()}"
        self.name = f"rd-{actor_id[:8]}"  # an actor id's first bytes are its own (its last, the job's)
        self.base, self.calls = base, itertools.count()
        earlier = _earlier_record(spec.output, self.name)  # read before this life's first record replaces it
        self.actor = FleetWorker(replace(spec, name=self.name), resources)
        self.actor.start()  # loads, fits its device, shares the node's weights; `stats` gets its record
        worker = self.actor.worker
        if earlier:  # this actor restarted: its counts go on
            for k in ("images", "errors"):
                worker.stats[k] += int(earlier.get("stats", {}).get(k) or 0)
            worker.info["restarts"] = int(earlier.get("restarts") or 0) + 1
            worker.write_info()
        atexit.register(self.close)

    def __call__(self, batch: pa.Table) -> pa.Table:
        worker = self.actor.worker
        rows = worker.make_rows(batch, self.base, f"{self.name} call {next(self.calls)}")
        worker.write_info()
        return rows

    def close(self) -> None:
        try:
            self.actor.close()
        except Exception:  # noqa: BLE001, S110 - an actor going away; nothing to report to
            pass

    def __del__(self):
        self.close()


def _earlier_record(stats: str | None, name: str) -> dict | None:
    """The record an earlier life of actor `name` left at `stats` (None: its first life, or no `stats`)."""
    if not stats:
        return None
    from fleetgen.workers.output.layout import worker_key
    from fleetgen.workers.output.storage import Output

    try:
        return json.loads(Output(stats).get(worker_key(name), attempts=1))
    except Exception:  # noqa: BLE001 - none there (its first life), or unreadable: counted from zero
        return None


RESTARTS = 3  # a stage actor's restarts, and a batch's retries, by default (Ray Data's own: without end)


def apply(
    ds,
    spec: WorkerSpec,
    base: str,
    *,
    workers: int | None = None,
    gpus_per_worker: float | None = None,
    cpu_threads: int = 1,
    concurrency=None,
    batch_rows: int | None = None,
    say=print,
    **ray_remote_args,
):
    """`ds` with the stage mapped over it: actors asking what a job's workers ask (`gpus_per_worker`, or
    `cpu_threads` CPUs on CPU); `concurrency` Ray Data's (an int, or `(min, max)` for an autoscaling pool),
    else `workers` of them, else an autoscaling pool up to one worker per GPU (on CPU: per `cpu_threads`
    CPUs, one CPU left for Ray Data's reads). A pool that would leave Ray Data's reads no CPU is refused
    (or, autoscaling, capped with a line); an actor restarts, and a batch is retried, at most `RESTARTS`
    times unless `ray_remote_args` say otherwise. `say`: where the stage's lines go."""
    from fleetgen.errors import ConfigError

    if batch_rows is not None and batch_rows < 1:
        raise ConfigError(f"`batch_rows` must be 1 or more, got {batch_rows}.")
    shape = connect()
    sizing = size_fleet(
        shape,
        device=spec.source.device,
        gpus_per_worker=gpus_per_worker,
        cpu_threads=cpu_threads,
        max_workers=None,
        budgets=0,
        host_memory=spec.fit.host_memory,
        shards=NO_SHARDS,
    )
    resources = dict(sizing.options)
    asks = {"num_gpus": resources.get("num_gpus"), "num_cpus": resources.get("num_cpus")}
    if resources.get("memory"):
        asks["memory"] = resources["memory"]
    each = ray_remote_args.get("num_cpus", asks["num_cpus"]) or 0
    concurrency = _concurrency(shape, sizing, each, concurrency, workers, say)
    pool = pool_of(concurrency)
    ray_remote_args.setdefault("max_restarts", RESTARTS)
    ray_remote_args.setdefault("max_task_retries", RESTARTS)
    return ds.map_batches(
        StageWorker,
        fn_constructor_kwargs={"spec": replace(spec, threads=sizing.threads), "resources": resources, "base": base},
        batch_size=batch_rows or BATCH_ROWS,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=pool,
        **{k: v for k, v in asks.items() if v is not None and k not in ray_remote_args},
        **ray_remote_args,
    )


def _concurrency(shape, sizing, each: float, concurrency, workers: int | None, say):
    """The stage's pool (`apply`): `concurrency` as given, else `workers`, else autoscaling up to the
    fleet's size; where `each` CPUs an actor would leave Ray Data's reads none, refused (a fixed pool, or
    an autoscaling one whose least is too many), capped with a line, or said (a cluster that may grow)."""
    from fleetgen.errors import ConfigError

    room = (shape.cpus - 1) // each if each else None  # actors that leave Ray Data's reads a CPU
    given = "concurrency" if concurrency is not None else "workers"
    if concurrency is None and workers:
        concurrency = workers
    elif concurrency is None:
        most = sizing.max_workers if sizing.gpu else max(1, (shape.cpus - 1) // sizing.threads)
        concurrency = (1, most)
    pool_of(concurrency)  # its shape checked before its size
    low, high = (concurrency, concurrency) if isinstance(concurrency, int) else concurrency
    if room is None or high <= room:
        return concurrency
    numbers = (
        f"{high} actor(s) of {each:g} CPU(s) each take {high * each:g} of the Ray cluster's {shape.cpus} CPUs, "
        "and Ray Data's read tasks need one of their own"
    )
    if shape.on_cluster:  # nodes may join (an autoscaler): said, not refused
        say(f"{numbers} now: the stage waits for the cluster to grow")
        return concurrency
    if low > room or isinstance(concurrency, int) or room < 1:
        raise ConfigError(
            f"`{given}={concurrency!r}`: {numbers}, so the stage would wait forever. Pass "
            f"`{given}={max(room, 1)}` or fewer{', or fewer `cpu_threads`' if each > 1 else ''}, "
            "or give Ray more CPUs."
        )
    say(f"{numbers}: the pool grows to {room} actor(s), not {high}")
    return (low, room)
