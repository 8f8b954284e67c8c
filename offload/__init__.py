"""Fitting a pipeline to one device. No Ray, no fsspec: runs on a bare GPU box.

profile_pipeline / profile_modules   bytes per component and group (real or meta weights)
plan(profile, DeviceSpec, Workload)  pure: the fastest predicted placement that fits, with a reason
apply(pipe, plan, profile, device)   the only caller of diffusers' group offloading API
OffloadStats                         what actually moved
"""

from fleetgen.offload.apply import AppliedOffload, apply, pipeline_modules
from fleetgen.offload.cost import DeviceSpec, Placement, Workload
from fleetgen.offload.planner import OffloadPlan, plan, resident_plan
from fleetgen.offload.profile import PipelineProfile, profile_modules, profile_pipeline
from fleetgen.offload.stats import OffloadStats

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
