"""What a worker says about itself (`OUT/workers/<w>.json`, `fleetgen status`, the summary's fleet
table): where it runs, the plan its fitted pipeline chose, and what it has done since."""

from __future__ import annotations

import os
import platform
import socket

import torch

from fleetgen import __version__
from fleetgen.workers.pipeline.fitted import FittedPipeline
from fleetgen.workers.pipeline.load import describe_device
from fleetgen.workers.pipeline.plans import predicted_vs_measured
from fleetgen.workers.spec import WorkerSpec


def worker_info(spec: WorkerSpec, fitted: FittedPipeline, load_seconds: float) -> dict:
    """The worker's record once loaded: host, device, plan, quantization, attention, versions."""
    return {
        "worker": spec.name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": describe_device(fitted.device),
        "dtype": str(fitted.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "plan": {**fitted.plan.to_dict(), **fitted.choice},
        # {component: storage format}: the job's `--quantize` mapping, or what `auto` chose here
        "quantized": dict(fitted.quantized),
        "weight_bytes": fitted.weight_bytes,  # per component, measured from the live modules
        "probe": fitted.probe,
        # where the host copy of the weights lives: the node's shared segment or this worker's own, and the bytes
        "host_copy": fitted.host_copy.record(fitted.pipe),
        "attention": fitted.attention.to_dict(),  # the kernel its denoisers run, and why (`--attention`)
        "load_seconds": round(load_seconds, 3),
        # a str, not torch's TorchVersion: the record is unpickled by a driver that never imports torch
        "versions": {"fleetgen": __version__, "torch": str(torch.__version__), "python": platform.python_version()},
    }


def describe(info: dict, fitted: FittedPipeline, stats: dict) -> dict:
    """`info` with what the worker has done: images, speed, offload transfers, caches, compiles."""
    stats = {**stats, "generate_seconds": fitted.seconds}
    secs = stats["generate_seconds"]
    stats["images_per_second"] = round(stats["images"] / secs, 4) if secs else None
    offload = fitted.offload_stats.snapshot()
    moved = sum(c["bytes_onloaded"] for c in offload["components"].values())
    # Transfers overlap compute under streams, so time in them is estimated from the probed
    # bandwidth rather than clocked (see bench/gpu_offload.py for achieved GB/s).
    offload["transfer_seconds_estimated"] = round(moved / fitted.probe["bandwidth"], 4)
    return {
        **info,
        "plan": {**fitted.plan.to_dict(), **fitted.choice},
        "quantized": dict(fitted.quantized),  # a step-down under `auto` may have added one
        "weight_bytes": fitted.weight_bytes,
        "batch_size": fitted.batch_size,
        "stats": stats,
        "offload": offload,
        "cache": fitted.cache.snapshot() if fitted.cache is not None else None,  # the step cache's skips
        # `--compile`: what was compiled, the seconds and graphs it took, why it was taken off (if it was)
        "compile": fitted.compiled.snapshot() if fitted.compiled is not None else None,
        # a phased plan (workers/pipeline/phases.py): chunks, prompts encoded, calls answered from an earlier one
        "phases": fitted.phases.snapshot() if fitted.phases is not None else None,
        "predicted_vs_measured": predicted_vs_measured(fitted.plan, secs, stats["images"], offload),
        "step_downs": list(fitted.step_downs),
        "host_copy": fitted.host_copy.record(fitted.pipe) if fitted.pipe is not None else info.get("host_copy"),
    }
