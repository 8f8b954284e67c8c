"""The actor a pool places: cheap to create, loaded on `start`. The driver that creates it imports no
torch: the worker's modules load in the actor's own process.

Creating the actor only places it (Ray finds a node with the resources it asks for, which on an
autoscaling cluster may mean starting one); `start` then loads the model. Splitting the two lets
the pool tell "waiting for a node" (bounded by `--placement-timeout`) from "loading a model"
(which may download tens of GB), and lets a worker that cannot run report why in one line.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import replace

import ray

from fleetgen.cluster.warm import scope
from fleetgen.errors import ClusterError
from fleetgen.imports import paused_gc
from fleetgen.workers.rows.shard import Shard
from fleetgen.workers.spec import BatchDone, ShardResult, WorkerSpec

GPU_TYPE_PREFIX = "fleetgen-gpu:"  # node types declare e.g. `fleetgen-gpu:A10G-24GB: 1` (cluster/*.yaml)
HOST_SHARE = 0.8  # of a node's Ray memory that the workers on it may fill with offloaded copies


def node_resources(node_id: str) -> dict:
    return next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id), {})


def gpu_type(resources: dict) -> str | None:
    """What a node's type calls its GPU: our custom resource, else Ray's `accelerator_type:`."""
    for prefix in (GPU_TYPE_PREFIX, "accelerator_type:"):
        names = sorted(k.removeprefix(prefix) for k in resources if k.startswith(prefix))
        if names:
            return names[0]
    return None


def fit_to_share(spec: WorkerSpec, resources: dict, placement: dict, device_total: int | None) -> WorkerSpec:
    """Budgets a worker did not get explicitly, from its share of its node: of the node's GPUs
    (else CPUs) for host RAM, so the workers on one node split it instead of each taking 80 %; and
    with a fractional GPU, that fraction of the device's memory (not all of its free memory)."""
    kind = "gpus" if resources.get("num_gpus") else "cpus"
    share = min(1.0, resources.get(f"num_{kind}", 1) / max(placement[f"node_{kind}"], 1e-9))
    fit = spec.fit
    if fit.host_memory is None and placement["node_memory"]:
        fit = replace(fit, host_memory=int(placement["node_memory"] * HOST_SHARE * share), node_share=share)
    fraction = resources.get("num_gpus") or 0
    if fit.gpu_memory is None and device_total and 0 < fraction < 1:
        fit = replace(fit, gpu_memory=int(device_total * fraction))
    return replace(spec, fit=fit)


class FleetWorker:
    """One fleetgen worker as a Ray actor: `where` once placed, `start` to load, then shards."""

    def __init__(self, spec: WorkerSpec, resources: dict):
        self.spec = spec
        self.resources = resources  # what it asked Ray for: num_gpus / num_cpus / memory
        self.worker = None  # a MeteredWorker once started (its module loads torch: in the actor's process only)

    def where(self) -> dict:
        """Where Ray placed this actor: node, host, pid, the GPUs it was given, the node's GPU type."""
        ctx = ray.get_runtime_context()
        node = ctx.get_node_id()
        resources = node_resources(node)
        return {
            "node_id": node,
            "node_ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "gpu_type": gpu_type(resources),
            "node_memory": int(resources.get("memory", 0)) or None,
            "node_gpus": resources.get("GPU", 0),
            "node_cpus": resources.get("CPU", 0),
        }

    def intact(self) -> bool:
        """Still the process Ray first started (never restarted): a parked worker a run may take."""
        return not ray.get_runtime_context().was_current_actor_reconstructed

    def start(self, spec: WorkerSpec | None = None) -> dict:
        """Load the pipeline and plan for this device (once); returns `Worker.describe()` with
        where it runs and any warning about its placement. `spec`: the run's (the pool always passes
        it): a parked worker taken by a later run, or one Ray restarted from its first run's
        arguments, loads that run's job, not the one it was created for (cluster/warm.py)."""
        if spec is not None and spec != self.spec:
            self.close()
            self.spec = spec
        if self.worker is None:
            with paused_gc():  # the process's start is nearly all imports (fleetgen/imports.py)
                import torch

                from fleetgen.cluster.metrics import MeteredWorker
                from fleetgen.workers.notice import install

                install()  # SIGTERM: a shard committing in parts commits what it made first (workers/notice.py)

                placement = self.where()
                warnings = self._check_device(placement)
                cuda = placement["gpu_ids"] and torch.cuda.is_available()
                device_total = torch.cuda.mem_get_info()[1] if cuda else None
                self.worker = MeteredWorker(fit_to_share(self.spec, self.resources, placement, device_total))
            self.worker.info.update(placement=placement, warnings=warnings)
            self.worker.write_info()  # the driver logs the warnings; workers/<name>.json keeps them
        return self.worker.describe()

    def _check_device(self, placement: dict) -> list[str]:
        """A worker given a GPU by Ray whose torch sees no CUDA device is misconfigured: refused
        unless `--device cpu` says to compute on CPU anyway."""
        import torch

        if not placement["gpu_ids"] or torch.cuda.is_available():
            return []
        what = (
            f"Ray gave worker {self.spec.name} GPU {','.join(placement['gpu_ids'])} on {placement['host']} "
            f"({placement['node_ip']}), but torch {torch.__version__} in its process sees no CUDA device"
        )
        if self.spec.source.device != "cpu":
            cause = "a CPU-only torch build" if torch.version.cuda is None else "no usable NVIDIA driver"
            raise ClusterError(
                f"{what} ({cause}). Install a CUDA build of torch on the GPU nodes (see cluster/), "
                "or pass `--device cpu` to compute on CPU on purpose."
            )
        return [f"{what}; computing on CPU as `--device cpu` says."]

    def iter_shard(self, shard: Shard) -> Iterator[BatchDone | ShardResult]:
        yield from self.worker.iter_shard(shard)

    def close(self) -> None:
        """Release the pipeline and what offloading holds (disk-offload directories included), and the
        memory with them: the cycles its hooks form collected, CUDA's cached blocks given back, so that
        a parked process's next job plans for the whole device (cluster/warm.py)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            gc.collect()
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                torch.cuda.empty_cache()


RemoteWorker = ray.remote(FleetWorker)


class RayActors:
    """How the pool starts and ends workers: a Ray actor each, running `FleetWorker`. A simulation
    passes its own (bench/pool_sim.py), with handles that answer the same calls. Inside
    `fleetgen.warm_workers()` a worker is taken from the parked ones when one asked for the same, and
    one that closed cleanly is parked instead of killed (cluster/warm.py)."""

    def __init__(self):
        self.keys: dict[object, tuple] = {}  # each created actor's parking key, by its actor id

    def create(self, spec: WorkerSpec, options: dict, env_vars: dict[str, str], max_restarts: int):
        key = (repr(sorted(options.items())), repr(sorted(env_vars.items())), max_restarts)
        warm = scope()
        handle = warm.take(key) if warm is not None else None
        if handle is None:
            env = {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
            handle = RemoteWorker.options(**options, **env, max_restarts=max_restarts, max_task_retries=0).remote(
                spec, options
            )
        self.keys[handle._actor_id] = key
        return handle

    def retire(self, handle, closed: bool) -> None:
        """The end of a worker's run: parked if it `closed` cleanly inside a warm-workers block,
        else killed."""
        key, warm = self.keys.pop(getattr(handle, "_actor_id", None), None), scope()
        if closed and key is not None and warm is not None:
            warm.park(key, handle)
        else:
            self.kill(handle)

    def kill(self, handle) -> None:
        self.keys.pop(getattr(handle, "_actor_id", None), None)
        ray.kill(handle, no_restart=True)
