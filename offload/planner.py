"""The planner: a pure function from (profile, device, workload) to the fastest plan that fits.

For every batch size and every combination of per-component placements it predicts
  peak device bytes = resident components
                      + max over phases (the running component's live groups + its activations)
and keeps the combinations whose peak ≤ (1 - MARGIN) × budget and whose host copies fit the host
budget; of those it returns the one with the most predicted images/s, from a cost model: compute
time (FLOPs / device FLOP/s) plus transfer time (bytes moved / host→device bandwidth), overlapped
when streams prefetch, amortised over the batch. Every offloaded weight moves once per forward,
whatever the grouping; grouping changes the device floor and the number of transfers.

The search is exhaustive over a fixed candidate set and feasibility only widens with the budget,
so more memory never yields a plan predicted slower.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from fleetgen.errors import OffloadError
from offload.profile import ComponentProfile, PipelineProfile

GiB = 1024**3
MARGIN = 0.10  # of the budget: allocator fragmentation, CUDA context, workspace
SYNC_SECONDS = 30e-6  # a blocking transfer's fixed cost (launch + synchronise), per group
FORWARD_SECONDS = 1e-3  # fixed cost of one forward (kernel launches, Python): what batching amortises
# Activation estimates, bytes per image = tokens × width × dtype bytes × factor. Calibrated on
# published peaks (SDXL UNet and FLUX transformer at 1024², 2-4 GB; SD VAE decode at 1024², ~3 GB);
# they are estimates: the measured peak is in each worker's stats.
ACT_FACTOR = 64
VAE_ACT_FACTOR = 12
TEXT_TOKENS = {"T5EncoderModel": 512, "UMT5EncoderModel": 512}  # else 77 (CLIP)
OFFLOAD_CHOICES = ("auto", "none", "block", "leaf", "disk")


@dataclass(frozen=True)
class DeviceSpec:
    """What a plan is fitted to. Bandwidth and FLOP/s are measured by the worker's probe."""

    budget: int  # device bytes the plan may use
    host_budget: int  # host RAM bytes for offloaded copies (pageable and pinned)
    bandwidth: float = 20e9  # host→device bytes/s
    flops: float = 100e12  # device FLOP/s at the run dtype (effective)
    streams: bool = True  # CUDA streams can overlap transfers with compute
    disk_bandwidth: float = 2e9  # bytes/s reading offloaded groups back from local disk
    name: str = ""


@dataclass(frozen=True)
class Workload:
    width: int = 1024
    height: int = 1024
    steps: int = 30
    guidance: bool = True  # classifier-free guidance doubles the denoiser's batch
    max_batch: int = 8
    offload: str = "auto"  # auto | none | block | leaf | disk: which placements may be used


@dataclass(frozen=True)
class Placement:
    mode: str  # resident | block | leaf | disk
    blocks_per_group: int = 1
    stream: bool = False

    @property
    def label(self) -> str:
        if self.mode == "resident":
            return "resident"
        if self.mode == "disk":
            return "disk(block_level)"
        base = f"block_level({self.blocks_per_group})" if self.mode == "block" else "leaf_level"
        return base + ("+stream" if self.stream else "")


@dataclass(frozen=True)
class OffloadPlan:
    """Placement of every component on one device, the batch size, and what the planner predicts."""

    placements: dict[str, Placement]
    batch_size: int  # images per pipeline call
    peak_bytes: int = 0  # predicted peak device memory
    host_bytes: int = 0  # host RAM held by offloaded copies
    pinned_bytes: int = 0  # of which page-locked (streams)
    moved_per_image: int = 0  # host→device bytes per image
    seconds_per_image: float = 0.0  # predicted
    relative_speed: float = 1.0  # predicted images/s relative to the whole pipeline resident at batch 1
    budget: int = 0
    reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def modes(self) -> dict[str, str]:
        return {n: p.label for n, p in self.placements.items()}

    def to_dict(self) -> dict:
        return {
            "modes": self.modes, "batch_size": self.batch_size, "peak_bytes": self.peak_bytes,
            "host_bytes": self.host_bytes, "pinned_bytes": self.pinned_bytes, "budget_bytes": self.budget,
            "moved_bytes_per_image": self.moved_per_image, "predicted_seconds_per_image": self.seconds_per_image,
            "predicted_relative_speed": round(self.relative_speed, 4), "reason": self.reason,
        }


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / 1024**2:.1f} MiB"


def _candidates(c: ComponentProfile, device: DeviceSpec, offload: str) -> list[Placement]:
    if offload == "none":
        return [Placement("resident")]
    out = [Placement("resident")]
    if offload in ("auto", "block"):
        out += [Placement("block", k) for k in (1, 2, 4) if c.blocks and k <= len(c.blocks)]
        if device.streams and c.blocks:
            out.append(Placement("block", 1, stream=True))
    if offload in ("auto", "leaf"):
        out.append(Placement("leaf"))
        if device.streams:
            out.append(Placement("leaf", stream=True))
    if offload in ("auto", "disk") and c.blocks:
        out.append(Placement("disk"))
    return out


def _floor(c: ComponentProfile, p: Placement) -> int:
    """Device bytes the component holds while it runs (beyond what is resident)."""
    if p.mode == "resident":
        return 0
    if p.mode == "leaf":
        return c.non_leaf + c.largest_leaf * (2 if p.stream else 1)
    if p.stream:
        return c.unmatched + 2 * max(c.blocks)
    return c.block_floor(p.blocks_per_group)


def _tokens(c: ComponentProfile, prof: PipelineProfile, w: Workload) -> int:
    if c.per_step:
        return (w.width // (prof.vae_scale * prof.patch)) * (w.height // (prof.vae_scale * prof.patch))
    if c.name == "vae":
        return w.width * w.height // 16
    return TEXT_TOKENS.get(c.cls, 77)


def _activations(c: ComponentProfile, prof: PipelineProfile, w: Workload) -> int:
    """Estimated activation bytes per image while `c` runs."""
    if c.name == "vae":
        return w.width * w.height * prof.vae_channels * prof.dtype_bytes * VAE_ACT_FACTOR
    cfg = 2 if c.per_step and w.guidance else 1
    return _tokens(c, prof, w) * max(c.hidden, 1) * prof.dtype_bytes * ACT_FACTOR * cfg


def _call_seconds(c: ComponentProfile, p: Placement, prof: PipelineProfile, w: Workload, d: DeviceSpec, batch: int) -> float:
    """Seconds `c` takes in one pipeline call of `batch` images."""
    forwards = w.steps if c.per_step else 1
    cfg = 2 if c.per_step and w.guidance else 1
    compute = 2 * c.params * _tokens(c, prof, w) * cfg * batch / d.flops + FORWARD_SECONDS
    if p.mode == "resident":
        return forwards * compute
    if p.mode == "disk":
        transfer = c.bytes / min(d.disk_bandwidth, d.bandwidth) + (len(c.blocks) + 1) * SYNC_SECONDS
        return forwards * (compute + transfer)
    groups = c.leaves if p.mode == "leaf" else -(-len(c.blocks) // p.blocks_per_group) + 1
    transfer = c.bytes / d.bandwidth
    if p.stream:  # prefetch overlaps the next group's copy with this group's compute
        return forwards * (max(compute, transfer) + transfer / max(groups, 1))
    return forwards * (compute + transfer + groups * SYNC_SECONDS)


def _evaluate(prof, device, w, names, combo, batch):
    comps = [prof.components[n] for n in names]
    resident = sum(c.bytes for c, p in zip(comps, combo, strict=True) if p.mode == "resident")
    phase = max(_floor(c, p) + _activations(c, prof, w) * batch for c, p in zip(comps, combo, strict=True))
    host = sum(c.bytes for c, p in zip(comps, combo, strict=True) if p.mode in ("block", "leaf"))
    pinned = sum(c.bytes for c, p in zip(comps, combo, strict=True) if p.stream)
    seconds = sum(_call_seconds(c, p, prof, w, device, batch) for c, p in zip(comps, combo, strict=True)) / batch
    moved = sum(c.bytes * (w.steps if c.per_step else 1) for c, p in zip(comps, combo, strict=True)
                if p.mode != "resident") / batch
    return resident + phase, host, pinned, seconds, int(moved)


def plan(prof: PipelineProfile, device: DeviceSpec, w: Workload) -> OffloadPlan:
    """The fastest predicted plan whose peak fits `device.budget`; `OffloadError` when none does."""
    if w.offload not in OFFLOAD_CHOICES:
        raise OffloadError(f"`--offload` must be one of {', '.join(OFFLOAD_CHOICES)}; got `{w.offload}`.")
    names = list(prof.components)
    choices = [_candidates(prof.components[n], device, w.offload) for n in names]
    limit = device.budget * (1 - MARGIN)
    resident_ref = sum(_call_seconds(prof.components[n], Placement("resident"), prof, w, device, 1) for n in names)
    best, best_key, leanest = None, None, None
    for batch in range(1, w.max_batch + 1):
        for combo in itertools.product(*choices):
            peak, host, pinned, seconds, moved = _evaluate(prof, device, w, names, combo, batch)
            if leanest is None or peak < leanest[0]:
                leanest = (peak, combo, batch)
            if peak > limit or host > device.host_budget:
                continue
            key = (seconds, moved, sum(p.mode != "resident" for p in combo), -batch)
            if best_key is None or key < best_key:
                best_key, best = key, (combo, batch, peak, host, pinned, seconds, moved)
    if best is None:
        peak, combo, batch = leanest
        modes = ", ".join(f"{n} {p.label}" for n, p in zip(names, combo, strict=True))
        raise OffloadError(
            f"Nothing fits {gib(device.budget)}{' on ' + device.name if device.name else ''} with `--offload "
            f"{w.offload}`: the leanest plan ({modes}, batch 1) needs {gib(peak / (1 - MARGIN))} including the "
            f"{MARGIN:.0%} margin, at {w.width}x{w.height}. Use a smaller size or a larger `--gpu-memory`"
            + (", or `--offload auto`." if w.offload != "auto" else ".")
        )
    combo, batch, peak, host, pinned, seconds, moved = best
    placements = dict(zip(names, combo, strict=True))
    return OffloadPlan(
        placements=placements, batch_size=batch, peak_bytes=int(peak), host_bytes=host, pinned_bytes=pinned,
        moved_per_image=moved, seconds_per_image=seconds, relative_speed=resident_ref / seconds,
        budget=device.budget, reason=_reason(prof, device, w, placements, batch, peak),
    )


def _reason(prof, device, w, placements, batch, peak) -> str:
    offloaded = {n: p for n, p in placements.items() if p.mode != "resident"}
    fits = f"predicted peak {gib(peak)} of {gib(device.budget)}"
    if not offloaded:
        head = f"all resident ({gib(prof.total_bytes)} of weights)"
    else:
        parts = [f"{n} {p.label} ({gib(prof.components[n].bytes)})" for n, p in offloaded.items()]
        head = (f"offload {', '.join(parts)}: keeping everything resident would not leave room for "
                f"activations at batch {batch} within the budget" if w.offload == "auto" else
                f"offload {', '.join(parts)} (`--offload {w.offload}`)")
        if any(p.stream for p in offloaded.values()):
            head += "; streams overlap transfers with compute"
    limit = "`--max-batch`" if batch == w.max_batch else "memory"
    return f"{head}; batch {batch} (limited by {limit}); {fits}"


def resident_plan(names: list[str], batch_size: int, reason: str) -> OffloadPlan:
    """Everything on the device, no planning: CPU workers without a budget."""
    return OffloadPlan(placements=dict.fromkeys(names, Placement("resident")), batch_size=batch_size, reason=reason)
