"""Fitting a pipeline to one device. No Ray, no fsspec: runs on a bare GPU box.

profile_pipeline / profile_modules   bytes per component and group (real or meta weights)
plan(profile, DeviceSpec, Workload)  pure: the fastest predicted placement that fits, with a reason
apply(pipe, plan, profile, device)   the only caller of diffusers' group offloading API
OffloadStats                         what actually moved
"""

from offload.apply import AppliedOffload, apply, pipeline_modules
from offload.cost import DeviceSpec, Placement, Workload
from offload.planner import OffloadPlan, plan, resident_plan
from offload.profile import PipelineProfile, profile_modules, profile_pipeline
from offload.stats import OffloadStats

__all__ = [
    "AppliedOffload",
    "DeviceSpec",
    "OffloadPlan",
    "OffloadStats",
    "PipelineProfile",
    "Placement",
    "Workload",
    "apply",
    "pipeline_modules",
    "plan",
    "profile_modules",
    "profile_pipeline",
    "resident_plan",
]
