"""Offload figures that a CPU can measure.

1. Stats overhead: the same offloaded pipeline generating the same images with `OffloadStats`
   attached and without, runs alternating; ratio of wall times (goal: ≤ 2 % slower).
2. Plan time for each shipped architecture: building it on the meta device, profiling, planning.

    python bench/offload_cpu.py [--pairs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetgen.offload import (  # noqa: E402
    DeviceSpec,
    OffloadPlan,
    OffloadStats,
    Placement,
    Workload,
    apply,
    pipeline_modules,
    plan,
    profile_modules,
    profile_pipeline,
)
from fleetgen.offload.architectures import NAMES, build_on_meta  # noqa: E402
from fleetgen.workers.tiny import write_tiny_model  # noqa: E402

CASES = {  # model size -> (level, images, batch, steps)
    "tiny": ("leaf", 8, 4, 8),  # leaf level: the most groups, so the most hook calls per forward
    "small": ("block", 2, 2, 8),
}


def stats_overhead(size: str, pairs: int) -> dict:
    from diffusers import DiffusionPipeline

    level, n, batch, steps = CASES[size]
    with tempfile.TemporaryDirectory() as tmp:
        pipe = DiffusionPipeline.from_pretrained(str(write_tiny_model(Path(tmp) / size, size=size)))
    pipe.set_progress_bar_config(disable=True)
    torch.set_num_threads(2)
    profile = profile_pipeline(pipe)
    placement = Placement("leaf") if level == "leaf" else Placement("block", 1)
    apply(pipe, OffloadPlan({name: placement for name in profile.components}, batch), profile, torch.device("cpu"))

    def run() -> float:
        start = time.perf_counter()
        for i in range(0, n, batch):
            pipe(
                prompt=["a red fox in the forest"] * batch,
                num_inference_steps=steps,
                width=64,
                height=64,
                generator=[torch.Generator().manual_seed(i + j) for j in range(batch)],
            )
        return time.perf_counter() - start

    run()  # warm up
    ratios, onloads = [], 0
    for _ in range(pairs):
        off = run()
        stats = OffloadStats(pipeline_modules(pipe), torch.device("cpu"))
        on = run()
        onloads = sum(c["onloads"] for c in stats.snapshot()["components"].values())
        stats.close()
        ratios.append(on / off)
    return {
        "level": level,
        "images": n,
        "steps": steps,
        "ratios": ratios,
        "median": statistics.median(ratios),
        "onloads_per_run": onloads,
    }


def plan_times() -> dict:
    out = {}
    for name in NAMES:
        start = time.perf_counter()
        profile = profile_modules(name, build_on_meta(name), torch.bfloat16)
        profiled = time.perf_counter()
        p = plan(profile, DeviceSpec(budget=24 * 2**30, host_budget=128 * 2**30), Workload(width=1024, height=1024))
        out[name] = {"profile_s": profiled - start, "plan_s": time.perf_counter() - profiled, "modes": p.modes}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"stats_overhead": {}, "plan_time": plan_times()}
    for name, r in result["plan_time"].items():
        print(f"plan {name}: build+profile {r['profile_s']:.2f} s, plan {r['plan_s']:.3f} s at 24 GiB -> {r['modes']}")
    for size in CASES:
        r = result["stats_overhead"][size] = stats_overhead(size, args.pairs)
        print(
            f"stats overhead {size} ({r['level']} level, {r['onloads_per_run']} onloads/run): "
            f"on/off = {' '.join(f'{x:.3f}' for x in r['ratios'])}, median {r['median']:.3f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
