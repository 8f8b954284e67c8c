"""Applying a plan: the only code that calls diffusers' offloading API.

Per component: resident parts `.to(device)`; offloaded ones `apply_group_offloading` with
`block_modules` where a text encoder would otherwise be one group. Guards for the silent failures
that diffusers' offloading leaves to its caller: a fresh disk directory per worker and component (removed by
`close`), no leaf level + disk on tied weights, no disk offload with LoRA, streams only on CUDA.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from fleetgen.errors import OffloadError
from fleetgen.offload.cost import Placement
from fleetgen.offload.planner import OffloadPlan
from fleetgen.offload.profile import PipelineProfile
from fleetgen.offload.weight_formats import refusal


def pipeline_modules(pipe) -> dict[str, torch.nn.Module]:
    """The pipeline's torch components by name (unet, vae, text_encoder, ...)."""
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def check(
    plan: OffloadPlan, profile: PipelineProfile, modules: dict[str, torch.nn.Module], device: torch.device
) -> None:
    """Refuse what would fail, or silently compute wrong images, before any work."""
    unknown = set(plan.placements) - set(modules)
    if unknown:
        raise OffloadError(f"The plan names components the pipeline lacks: {sorted(unknown)}.")
    for name, p in plan.placements.items():
        fmt = plan.formats.get(name)
        why = refusal(fmt, p.mode, p.stream, p.disk) if fmt else None  # the table the planner reads
        if why:
            raise OffloadError(f"`{name}` {fmt} {p.label}: {why}.")
        if p.stream and device.type != "cuda":
            raise OffloadError(f"`{name}` {p.label}: streams need a CUDA device; this worker runs on {device}.")
        if p.disk and p.mode == "leaf" and profile.components[name].tied:
            raise OffloadError(
                f"`{name}` {p.label}: leaf level + disk corrupts tied weights ({name} shares a "
                "weight between modules). Use block level + disk."
            )
        if p.disk and getattr(modules[name], "peft_config", None):
            raise OffloadError(
                f"`{name}` {p.label}: disk offload with LoRA adapters gives wrong images or "
                "fails. Offload to host RAM instead."
            )


DISK_PREFIX = "fleetgen-offload-"  # + pid: a killed worker's files are removed by the next one


def sweep_stale_disk_dirs() -> None:
    """Remove disk-offload directories left by worker processes that no longer exist."""
    for path in Path(tempfile.gettempdir()).glob(f"{DISK_PREFIX}*"):
        pid = path.name[len(DISK_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


class AppliedOffload:
    """A plan applied to a pipeline; `close()` removes disk offload files."""

    def __init__(self, pipe, plan: OffloadPlan, profile: PipelineProfile, device: torch.device, tag: str = "w"):
        modules = pipeline_modules(pipe)
        check(plan, profile, modules, device)
        self.plan, self.dirs = plan, []
        for name, module in modules.items():
            p = plan.placements.get(name, Placement("resident"))
            if p.mode == "resident":  # phased: on the device in its phase only (workers/pipeline/phases.py)
                module.to("cpu" if plan.phases else device)
                continue
            disk = None
            if p.disk:  # its own empty directory: diffusers reuses group files by name
                sweep_stale_disk_dirs()
                disk = tempfile.mkdtemp(prefix=f"{DISK_PREFIX}{os.getpid()}-{tag}-{name}-")
                self.dirs.append(disk)
            from diffusers.hooks import apply_group_offloading

            apply_group_offloading(
                module,
                onload_device=device,
                offload_device=torch.device("cpu"),
                offload_type="block_level" if p.mode == "block" else "leaf_level",
                num_blocks_per_group=p.blocks_per_group if p.mode == "block" else None,
                use_stream=p.stream,
                offload_to_disk_path=disk,
                block_modules=list(profile.components[name].block_modules) or None,
            )

    def close(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs = []


# Every hook diffusers' group offloading registers (0.42.1: the lazy prefetch hook and the layer
# execution tracker come with streams), removed last-registered first.
OFFLOAD_HOOKS = ("lazy_prefetch_group_offloading", "layer_execution_tracker", "group_offloading")


from fleetgen.offload.stats import COUNTER_HOOK  # noqa: E402 - beside its one use


def unapply(pipe, placed: AppliedOffload | None = None) -> None:
    """Undo a plan: every offloading hook removed (its groups offloaded), every module back on the
    CPU, disk files removed; the pipeline is as it was loaded, ready for another plan."""
    from diffusers.hooks import HookRegistry

    if placed is not None:
        placed.close()
    for module in pipeline_modules(pipe).values():
        registry = HookRegistry.check_if_exists_or_initialize(module)
        for name in (COUNTER_HOOK, *OFFLOAD_HOOKS):  # a counter left by stats never closed goes too
            registry.remove_hook(name, recurse=True)
        module.to("cpu")


def offload_hooks(pipe) -> int:
    """How many offloading hooks the pipeline's modules carry (0 after `unapply`)."""
    return sum(
        name in OFFLOAD_HOOKS
        for m in pipeline_modules(pipe).values()
        for sub in m.modules()
        for name in getattr(getattr(sub, "_diffusers_hook", None), "hooks", {})
    )


def apply(pipe, plan: OffloadPlan, profile: PipelineProfile, device: torch.device, tag: str = "w") -> AppliedOffload:
    return AppliedOffload(pipe, plan, profile, device, tag)
