"""A Ray worker's start-up CPU: with and without the garbage collector paused over it; and (`--warm`)
a fresh worker's against a parked one's (`fleetgen.warm_workers()`, cluster/warm.py).

A worker of a tiny-model job spends nearly all of its CPU starting: `start()` imports torch,
diffusers and transformers and loads the pipeline, with the cyclic collector paused
(fleetgen/imports.py). Here each run is a fresh `FleetWorker` actor on a local Ray, on CPU, whose
process CPU time is read from /proc across its `start()`; for the "on" runs the actor is first told
to leave the collector on (`collector_on`, before anything of the worker's is imported there). The
two kinds alternate (paused, on, paused, ...) and the ratio is taken per pair, so the machine's noise
hits both. Linux only.

With `--warm`, each pair is a fresh actor's CPU from its process's start through `start(spec)` (what a
run outside a warm block pays per worker) and the CPU of `start(spec2)` of an actor that has already
run `start(spec)` and `close()` (what a parked worker pays when a later run takes it: `spec2` is another
job's, at another step count).

    python bench/worker_start.py [--pairs 5] [--warm] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collector_on(actor) -> bool:
    """Run in a placed actor before its `start()`: `paused_gc` a no-op in its process (the actor's
    module bound it at import; the worker's modules, not imported yet, bind it as they load)."""
    import contextlib
    import sys

    for name in ("fleetgen.imports", "fleetgen.cluster.actor"):
        sys.modules[name].paused_gc = contextlib.nullcontext
    return "fleetgen.workers.worker" not in sys.modules


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_cpu(kind: str, spec) -> float:
    """CPU seconds of one fresh actor's `start()` (its process's boot not counted)."""
    import ray

    from fleetgen.cluster.actor import RemoteWorker

    env = {"env_vars": {"PYTHONPATH": str(ROOT)}}
    actor = RemoteWorker.options(num_cpus=1, runtime_env=env).remote(spec, {"num_cpus": 1})
    pid = ray.get(actor.where.remote())["pid"]
    if kind == "on":
        assert ray.get(actor.__ray_call__.remote(collector_on)), "the worker's modules were imported already"
    before = cpu_seconds(pid)
    ray.get(actor.start.remote())
    spent = cpu_seconds(pid) - before
    ray.get(actor.close.remote())
    ray.kill(actor)
    return spent


def warm_pair(spec, spec2) -> dict:
    """CPU seconds of a fresh actor (boot and `start`), then of the same actor, closed, starting `spec2`."""
    import ray

    from fleetgen.cluster.actor import RemoteWorker

    env = {"env_vars": {"PYTHONPATH": str(ROOT)}}
    actor = RemoteWorker.options(num_cpus=1, runtime_env=env).remote(spec, {"num_cpus": 1})
    pid = ray.get(actor.where.remote())["pid"]
    ray.get(actor.start.remote(spec))
    fresh = cpu_seconds(pid)  # since the process started
    ray.get(actor.close.remote())
    before = cpu_seconds(pid)
    ray.get(actor.start.remote(spec2))
    parked = cpu_seconds(pid) - before
    ray.get(actor.close.remote())
    ray.kill(actor)
    return {"fresh": fresh, "parked": parked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--warm", action="store_true", help="a fresh worker against a parked one")
    parser.add_argument("--json", help="write the figures here as well")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import ray

    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import GenerationSettings, WorkerSpec
    from fleetgen.workers.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp) / "tiny"))
        settings = GenerationSettings(family="sd", task="text-to-image", steps=2, guidance=7.5, width=32, height=32)
        spec = WorkerSpec.of("w0", model, f"{tmp}/out", settings, Columns(), device="cpu", threads=1)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            if args.warm:
                spec2 = WorkerSpec.of(
                    "w0", model, f"{tmp}/out2", replace(settings, steps=3), Columns(), device="cpu", threads=1
                )
                warm_pair(spec, spec2)  # the page cache warm for both kinds
                runs = [warm_pair(spec, spec2) for _ in range(args.pairs)]
            else:
                start_cpu("paused", spec)  # the page cache warm for both kinds
                runs = [{kind: start_cpu(kind, spec) for kind in ("paused", "on")} for _ in range(args.pairs)]
        finally:
            ray.shutdown()
    if args.warm:
        report(args, runs, "fresh", "parked", "a worker's start, CPU seconds: fresh process (boot and start)")
        return
    report(args, runs, "on", "paused", "a worker's start(), CPU seconds: collector on")


def report(args, runs: list[dict], a: str, b: str, what: str) -> None:
    ratios = [r[b] / r[a] for r in runs]
    result = {
        "pairs": runs,
        f"{a}_cpu_s": statistics.median(r[a] for r in runs),
        f"{b}_cpu_s": statistics.median(r[b] for r in runs),
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }
    print(
        f"{what} {result[f'{a}_cpu_s']:.2f}, {b} {result[f'{b}_cpu_s']:.2f} (medians of {args.pairs} pairs); "
        f"{b}/{a} {result['ratio_median']:.2f} (pairs {min(ratios):.2f}-{max(ratios):.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
