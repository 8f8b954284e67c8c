"""Helpers for the planner's tests."""

import itertools

from fleetgen.offload.cost import MARGIN, _options
from fleetgen.offload.planner import _with_call_costs


def exhaustive_key(prof, device, w):
    """The plan's key by every product of options, every batch size (the search the pruned one
    replaced): (cost per image, components quantized, bytes moved per image, components offloaded);
    None where nothing fits."""
    best = None
    for batch in range(1, w.max_batch + 1):
        tables = _with_call_costs([_options(n, prof, device, w, batch) for n in prof.components], batch, device)
        for combo in itertools.product(*tables):
            peak = sum(o.resident for o in combo) + max(o.phase for o in combo)
            if peak > device.budget * (1 - MARGIN) or sum(o.host for o in combo) > device.host_budget:
                continue
            if sum(o.load for o in combo) > device.host_budget:
                continue
            key = (
                sum(o.cost for o in combo) / batch,
                sum(o.quantized for o in combo),
                sum(o.moved for o in combo) // batch,
                sum(o.placement.mode != "resident" for o in combo),
            )
            best = key if best is None or key < best else best
    return best


def plan_key(plan) -> tuple:
    """The same key for a plan the planner returned."""
    off = sum(p.mode != "resident" for p in plan.placements.values())
    return (plan.cost_per_image, len(plan.formats), plan.moved_per_image, off)
