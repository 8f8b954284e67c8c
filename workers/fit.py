"""Fitting this worker's pipeline to its device: choose a plan, and step down after an OOM."""

from __future__ import annotations

import torch

from fleetgen.errors import OffloadError
from offload import DeviceSpec, OffloadPlan, PipelineProfile, Workload, plan, resident_plan

HOST_SHARE = 0.8  # of available host RAM a worker may fill with offloaded copies
STEP_DOWN = 0.75  # after an OOM at batch 1, re-plan for this fraction of the previous budget


def _workload(offload: str, max_batch: int, width: int, height: int, steps: int, cfg: bool) -> Workload:
    return Workload(width=width, height=height, steps=steps, cfg=cfg, max_batch=max_batch, offload=offload)


def device_spec(device: torch.device, probe: dict, gpu_memory: int | None, host_memory: int | None) -> DeviceSpec:
    cuda = device.type == "cuda"
    budget = gpu_memory or (probe["free_bytes"] if cuda else probe["host_available_bytes"])
    return DeviceSpec(
        budget=budget, host_budget=host_memory or int(probe["host_available_bytes"] * HOST_SHARE),
        bandwidth=probe["bandwidth"], flops=probe["flops"], streams=cuda,
        name=torch.cuda.get_device_name(device) if cuda else "cpu",
    )


def choose_plan(profile: PipelineProfile, device: torch.device, probe: dict, *, offload: str, max_batch: int,
                gpu_memory: int | None, host_memory: int | None, width: int, height: int, steps: int,
                cfg: bool) -> OffloadPlan:
    """On a CPU worker with no `--gpu-memory` and `--offload auto|none`, everything is resident at
    `--max-batch`. Otherwise the planner fits the budget: `--gpu-memory`, else the free memory."""
    if device.type == "cpu" and gpu_memory is None and offload in ("auto", "none"):
        return resident_plan(list(profile.components), max_batch,
                             f"all resident: CPU worker without `--gpu-memory`; batch {max_batch} (`--max-batch`)")
    return plan(profile, device_spec(device, probe, gpu_memory, host_memory),
                _workload(offload, max_batch, width, height, steps, cfg))


def leaner_plan(profile: PipelineProfile, current: OffloadPlan, device: torch.device, probe: dict, *,
                offload: str, host_memory: int | None, width: int, height: int, steps: int, cfg: bool) -> OffloadPlan:
    """After an out-of-memory error at batch 1: plan for ever smaller budgets until the placement
    changes; `OffloadError` when even the leanest plan does not fit. A step that goes from the
    current placement straight to "nothing fits" (where activations, not weights, fill the budget)
    is bisected for the budgets between, where a leaner placement may still fit."""
    high = current.budget or probe.get("free_bytes") or probe["host_available_bytes"]
    work = _workload(offload, 1, width, height, steps, cfg)

    def at(budget: int) -> OffloadPlan:
        return plan(profile, device_spec(device, probe, budget, host_memory), work)

    while True:
        budget = int(high * STEP_DOWN)
        try:
            leaner = at(budget)
        except OffloadError:
            low = budget  # nothing fits here; the current placement fits at `high`
            while high - low > max(1, high // 1000):
                middle = (low + high) // 2
                try:
                    leaner = at(middle)
                except OffloadError:
                    low = middle
                    continue
                if leaner.placements != current.placements:
                    return leaner
                high = middle
            raise
        if leaner.placements != current.placements:
            return leaner
        high = budget
