"""Offload plans and applying them to a pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class OffloadPlan:
    """Placement of every pipeline component on one device, plus the batch size."""

    modes: dict[str, str] = field(default_factory=dict)  # component -> "resident"
    batch_size: int = 1  # images per pipeline call
    reason: str = ""

    def to_dict(self) -> dict:
        return {"modes": dict(self.modes), "batch_size": self.batch_size, "reason": self.reason}


def pipeline_modules(pipe) -> dict[str, torch.nn.Module]:
    """The pipeline's torch components by name (unet, vae, text_encoder, ...)."""
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def resident_plan(pipe, batch_size: int, reason: str) -> OffloadPlan:
    modes = {name: "resident" for name in pipeline_modules(pipe)}
    return OffloadPlan(modes=modes, batch_size=batch_size, reason=reason)


def apply(pipe, plan: OffloadPlan, device: torch.device) -> None:
    """Place each component as the plan says."""
    modules = pipeline_modules(pipe)
    unknown = set(plan.modes) - set(modules)
    if unknown:
        raise ValueError(f"The plan names components the pipeline lacks: {sorted(unknown)}.")
    for name, module in modules.items():
        mode = plan.modes.get(name, "resident")
        if mode != "resident":
            raise ValueError(f"Offload mode `{mode}` for `{name}` is not supported.")
        module.to(device)
