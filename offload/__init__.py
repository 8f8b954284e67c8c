"""Fitting a pipeline to one device. No Ray, no fsspec: runs on a bare GPU box.

profile_pipeline / profile_modules   bytes per component and group (real or meta weights)
plan(profile, DeviceSpec, Workload)  pure: the fastest predicted placement that fits, with a reason
apply(pipe, plan, profile, device)   the only caller of diffusers' group offloading API
OffloadStats                         what actually moved

The names load on first use (PEP 562): importing the planner's records (`fleetgen.offload.cost`,
`fleetgen.offload.weight_formats`) loads no torch.
"""

import importlib

_WHERE = {
    "AppliedOffload": "hooks",
    "apply": "hooks",
    "pipeline_modules": "hooks",
    "DeviceSpec": "cost",
    "Placement": "cost",
    "Workload": "cost",
    "OffloadPlan": "planner",
    "plan": "planner",
    "resident_plan": "planner",
    "PipelineProfile": "profile",
    "profile_modules": "profile",
    "profile_pipeline": "profile",
    "OffloadStats": "stats",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
