"""What each worker asks Ray for, and how many workers a job may have.

GPU workers ask `num_gpus=--gpus-per-worker` (fractions pack several workers on one large GPU,
each planning within its share); CPU workers ask `num_cpus=--cpu-threads`. On a cluster joined
by address, `--device auto` means GPU workers even when no GPU node is up yet: the pool's
pending actors are the demand that makes the autoscaler start one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleetgen.cluster.connect import ClusterShape
from fleetgen.units import format_size

# Default cap on workers on a cluster when neither `--max-workers` nor `--workers` is given: one per
# shard to do, but no more than this many pending actors at once (each is a GCS entry and a lease
# request; the cluster's own node limits bound what actually runs).
DEFAULT_MAX_WORKERS = 1000


@dataclass(frozen=True)
class Sizing:
    options: dict  # Ray resources per actor: num_gpus / num_cpus / memory
    max_workers: int  # never more actors than this at once
    gpu: bool  # scheduled by the GPU resource
    threads: int | None  # torch CPU threads per worker (None: torch's default, for GPU compute)

    def describe(self) -> str:
        return f"up to {self.max_workers} worker(s) on {'GPU' if self.gpu else 'CPU'}, each asking {format_asks(self.options)}"


def format_asks(options: dict) -> str:
    """Ray actor options as a person reads them: `GPU 0.5, CPU 1, memory 24.0 GiB`."""
    names = {"num_gpus": "GPU", "num_cpus": "CPU"}
    return ", ".join(f"{names.get(k, k)} {format_size(v) if k == 'memory' else f'{v:g}'}" for k, v in options.items())


def size_fleet(
    shape: ClusterShape,
    *,
    device: str,
    gpus_per_worker: float | None,
    cpu_threads: int,
    max_workers: int | None,
    budgets: int,
    host_memory: int | None,
    shards: int,
) -> Sizing:
    gpu = (
        bool(gpus_per_worker)
        or device.startswith("cuda")
        or (device == "auto" and (shape.on_cluster or shape.gpus > 0))
    )
    if gpu:
        per = gpus_per_worker or (1 / math.ceil(budgets / shape.gpus) if budgets > shape.gpus > 0 else 1)
        computes_on_cpu = device == "cpu"
        options = {"num_gpus": per, "num_cpus": cpu_threads if computes_on_cpu else 1}
        if max_workers is None:
            if budgets:
                max_workers = budgets
            elif shape.on_cluster:
                max_workers = min(shards, DEFAULT_MAX_WORKERS)
            else:  # a local machine: its GPUs are all there is
                max_workers = max(1, int(shape.gpus / per))
        threads = cpu_threads if computes_on_cpu else None
    else:
        options = {"num_cpus": cpu_threads}
        max_workers = max_workers or budgets or max(1, shape.cpus // cpu_threads)
        threads = cpu_threads
    if host_memory:
        options["memory"] = host_memory
    return Sizing(options=options, max_workers=max(1, min(max_workers, shards)), gpu=gpu, threads=threads)


def _alive() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def unplaceable(options: dict, waited: float) -> str:
    """Why no worker asking `options` could be placed in `waited` seconds, naming what every node has."""
    nodes = _alive()
    sizes = "; ".join(
        f"{n['NodeManagerAddress']}: "
        + ", ".join(
            f"{k} {format_size(v) if k in ('memory', 'object_store_memory') else f'{v:g}'}"
            for k, v in sorted(n["Resources"].items())
            if not k.startswith("node:")
        )
        for n in nodes
    )
    hint = gpu_hint(options, nodes)
    hint = f" {hint}" if hint else ""
    return (
        f"No worker could be placed in {waited:.0f} s (`--placement-timeout`): each asks for {format_asks(options)}. "
        f"The cluster's {len(nodes)} node(s): {sizes or 'none'}.{hint} Lower what a worker asks "
        "(`--host-memory`, `--gpus-per-worker`, `--cpu-threads`), or give the cluster node types that have it; "
        "an autoscaler starts only the node types it is configured with."
    )


def gpu_hint(options: dict, nodes: list[dict] | None = None) -> str:
    """What to do when workers ask for GPUs and no node of the cluster has one (an autoscaler may
    still be starting one: the hint says both)."""
    nodes = _alive() if nodes is None else nodes
    if options.get("num_gpus") and not any(n["Resources"].get("GPU") for n in nodes):
        return (
            "No node has a GPU yet: to run on CPUs, pass `--device cpu`; else the cluster needs GPU node "
            "types (an autoscaler starts them for pending workers)."
        )
    return ""
