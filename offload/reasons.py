"""What a plan says of itself: the reason a per-batch plan gives (what is offloaded and why, the batch and
what caps it, the predicted peak, what binds), with a step cache's and a clip's notes. Words only: the
planner (offload/planner.py) decides, this explains."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleetgen.caches import CacheSpec
from fleetgen.offload.cost import MARGIN, _activations, _floor, cache_state_bytes, computed_share
from fleetgen.offload.weight_formats import NONE
from fleetgen.units import format_size

if TYPE_CHECKING:
    from fleetgen.offload.planner import Candidate


def reason(prof, device, w, best: Candidate, placements, formats, resident_peak, binds) -> str:
    batch, peak, host = best.batch, best.peak, best.host
    offloaded = {n: p for n, p in placements.items() if p.mode != "resident"}
    limit = f"{format_size(device.budget * (1 - MARGIN))} usable of {format_size(device.budget)}"
    held = {n: prof.variant(n, formats.get(n, NONE)).bytes for n in placements}
    if not offloaded:
        head = f"all resident ({format_size(sum(held.values()))} of weights)"
    else:
        parts = ", ".join(f"{n} {p.label} ({format_size(held[n])})" for n, p in offloaded.items())
        if w.offload != "auto":
            why = f"`--offload {w.offload}`"
        elif resident_peak > device.budget * (1 - MARGIN):
            why = f"all resident would need {format_size(resident_peak)} at batch 1"
        else:
            why = f"frees room for batch {batch}, predicted faster than all resident at a smaller batch"
        head = f"offload {parts}: {why}"
        if any(p.stream for p in offloaded.values()):
            head += "; streams overlap transfers with compute"
        from_node = sorted(n for n, p in offloaded.items() if p.stream and n in device.shared)
        if from_node:
            head += f"; {', '.join(from_node)} stream from the node's shared copy"
        head += (
            f"; offloaded copies take {format_size(host)} of the {format_size(device.host_budget)} host RAM this worker may "
            "use (its share of the node)"
        )
    cap = batch_cap(w.cache) if batch == w.max_batch else "memory"
    bound = " and ".join(binds) if binds else "neither budget (a larger one would not be faster)"
    return (
        f"{head}; batch {batch} (limited by {cap}); predicted peak {format_size(peak)} ({limit}); binds: {bound}"
        + _video_note(prof, w, placements, formats, batch)
        + _cache_note(prof, w, batch)
    )


def batch_cap(cache: CacheSpec) -> str:
    """What caps the batch when memory does not: `--max-batch`, or a cache deciding per call."""
    return "the first-block cache: one image per call" if cache.per_call else "`--max-batch`"


def _cache_note(prof, w, batch) -> str:
    """A step cache: what it holds on the device and what the plan counts it to save."""
    if w.cache.method == NONE:
        return ""
    notes = []
    for name, c in prof.components.items():
        if not c.per_step:
            continue
        held = format_size(cache_state_bytes(c, prof, w, batch))
        share = computed_share(c, w)
        saved = (
            f"computes {share:.0%} of the steps (time and moves counted so)"
            if share < 1
            else "skips blocks by the data: predicted as none skipped, measured per image"
        )
        notes.append(f"{name} `--cache {w.cache.label}` holds {held} of state and {saved}")
    return "; " + "; ".join(notes) if notes else ""


def _video_note(prof, w, placements, formats, batch) -> str:
    """For a clip: what runs when (two experts on alternate step ranges, one live at a time) and
    the VAE's decode of every frame, often the peak."""
    if not w.frames:
        return ""
    notes = []
    if prof.step_shares:
        shares = ", ".join(f"{n} {share:.0%} of the steps" for n, share in prof.step_shares.items())
        notes.append(f"two experts alternate ({shares}); an offloaded one is on the device only for its steps")
    if "vae" in prof.components:
        vae = prof.variant("vae", formats.get("vae", NONE))
        decode = _floor(vae, placements["vae"]) + _activations(vae, prof, w)  # one clip at a time (sliced)
        if placements["vae"].mode == "resident":
            decode += vae.bytes
        notes.append(
            f"the VAE decodes one clip at a time: {w.frames} frames at {w.width}x{w.height} hold {format_size(decode)}"
        )
    return "; " + "; ".join(notes) if notes else ""
