"""Fitting a pipeline to one device. No Ray, no fsspec: runs on a bare GPU box.

`OffloadPlan` says where each component lives and the batch size, with the reason; `apply` is the
only code that moves a pipeline's components.
"""

from offload.plan import OffloadPlan, apply, resident_plan

__all__ = ["OffloadPlan", "apply", "resident_plan"]
