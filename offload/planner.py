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

from dataclasses import dataclass, field, replace

from fleetgen.errors import OffloadError
from fleetgen.units import format_size
from offload.profile import ComponentProfile, PipelineProfile
from offload.quantize import FORMATS, NONE, allowed, refusal, spec
from offload.search import _combos

MARGIN = 0.10  # of the budget: allocator fragmentation, CUDA context, workspace
SYNC_SECONDS = 30e-6  # a blocking transfer's fixed cost (launch + synchronise), per group
FORWARD_SECONDS = 1e-3  # fixed cost of one forward (kernel launches, Python): what batching amortises
# Activation estimates, bytes per image = tokens × width × dtype bytes × factor. Calibrated on
# published peaks (SDXL UNet and FLUX transformer at 1024², 2-4 GB; SD VAE decode at 1024², ~3 GB);
# they are estimates: the measured peak is in each worker's stats.
ACT_FACTOR = 64
VAE_ACT_FACTOR = 12
# Tokens a text encoder reads per prompt (the families' `max_sequence_length`); else 77 (CLIP).
TEXT_TOKENS = {
    "T5EncoderModel": 512,
    "UMT5EncoderModel": 512,
    "Mistral3ForConditionalGeneration": 512,  # FLUX.2 dev
    "Qwen3ForCausalLM": 512,  # FLUX.2 klein
    "Qwen3Model": 512,  # Z-Image
    "Qwen2_5_VLForConditionalGeneration": 1024,  # Qwen-Image (512 + its template), HunyuanImage (1000)
    "LlamaForCausalLM": 128,  # HiDream
    "Gemma2Model": 300,  # Sana
}
# What a quantized component costs the plan's choice beyond its predicted seconds, as a share of the
# pipeline's time all resident at batch 1 (a fixed measure, whatever the budget): under `auto` a
# format must buy at least this much predicted speed to change the pixels. Added to the time, so
# the search still compares one number per plan ("cost"): more memory never predicts a higher cost,
# and `auto` never predicts slower than `none` (its cost is at most none's, which is its seconds).
QUANTIZED_SHARE = 0.05
OFFLOAD_CHOICES = ("auto", "none", "block", "leaf", "disk")
BUDGETS = {"device": "device memory", "host": "host RAM"}  # what a plan says binds it


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
    formats: tuple[str, ...] = tuple(FORMATS)  # storage formats it can run (`--quantize auto` chooses among them)


@dataclass(frozen=True)
class Workload:
    width: int = 1024
    height: int = 1024
    steps: int = 30
    cfg: bool = True  # the denoiser runs on a doubled batch (classifier-free guidance; not guidance-distilled Flux)
    max_batch: int = 8
    offload: str = "auto"  # auto | none | block | leaf | disk: which placements may be used
    quantize: str = "none"  # none | auto | COMPONENT=FORMAT,...: which storage formats may be used
    fixed: tuple[tuple[str, str], ...] = ()  # (component, format) already applied to live modules
    loaded: bool = False  # planned after loading (a worker): the loading peak is past, not planned


@dataclass(frozen=True)
class Placement:
    """Where one component lives. The planner offers disk only at block level: leaf level + disk
    corrupts tied weights (see notes/diffusers-group-offload.md)."""

    mode: str  # resident | block | leaf
    blocks_per_group: int = 1  # block level only
    stream: bool = False  # prefetch the next group on a CUDA side stream (pins a host copy)
    disk: bool = False  # offloaded groups live in files, not host RAM

    @property
    def label(self) -> str:
        if self.mode == "resident":
            return "resident"
        base = f"block_level({self.blocks_per_group})" if self.mode == "block" else "leaf_level"
        return base + ("+stream" if self.stream else "") + ("+disk" if self.disk else "")


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
    binds: tuple[str, ...] = ()  # the budgets that made this plan slower than one without them (BUDGETS)
    formats: dict[str, str] = field(default_factory=dict)  # {component: storage format} of the quantized ones
    load_bytes: int = 0  # host RAM while the pipeline loads
    cost_per_image: float = 0.0  # what the planner minimised: seconds, plus QUANTIZED_SHARE per quantized component

    @property
    def modes(self) -> dict[str, str]:
        return {n: p.label for n, p in self.placements.items()}

    def to_dict(self) -> dict:
        return {
            "modes": self.modes,
            "batch_size": self.batch_size,
            "peak_bytes": self.peak_bytes,
            "host_bytes": self.host_bytes,
            "pinned_bytes": self.pinned_bytes,
            "budget_bytes": self.budget,
            "moved_bytes_per_image": self.moved_per_image,
            "predicted_seconds_per_image": self.seconds_per_image,
            "predicted_relative_speed": round(self.relative_speed, 4),
            "reason": self.reason,
            "binds": list(self.binds),
            "formats": dict(self.formats),
            "load_host_bytes": self.load_bytes,
        }


def _candidates(c: ComponentProfile, device: DeviceSpec, offload: str) -> list[Placement]:
    """`auto` chooses per component among all placements; `none` keeps everything resident;
    `block`, `leaf` and `disk` put every component in that mode (as diffusers' pipeline-level
    `enable_group_offload` would), leaving the planner the variant and the batch size. Placements
    the component's storage format refuses (offload/quantize.py's table) are left out."""
    if c.fmt != NONE:
        return [
            p
            for p in _candidates(replace(c, fmt=NONE), device, offload)
            if not refusal(c.fmt, p.mode, p.stream, p.disk)
        ]
    if offload == "none":
        return [Placement("resident")]
    block = [Placement("block", k) for k in (1, 2, 4) if k == 1 or k <= len(c.blocks)]
    leaf = [Placement("leaf")]
    # A component the pipeline upcasts is never streamed: onload copies its pinned float16 copy,
    # whatever `.to(float32)` did, and float32 inputs meet float16 weights.
    if device.streams and not c.upcast:
        block.append(Placement("block", 1, stream=True))
        leaf.append(Placement("leaf", stream=True))
    disk = [] if c.adapters else [Placement("block", 1, disk=True)]  # LoRA + disk: wrong images (notes)
    forced = {"block": block, "leaf": leaf, "disk": disk or [Placement("block", 1, disk=True)]}
    if offload in forced:
        return forced[offload]  # `--offload disk` with adapters is refused by offload.apply, naming why
    return [Placement("resident"), *(block + disk if c.blocks else []), *leaf]


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
        return w.width * w.height * prof.vae_channels * (prof.vae_dtype_bytes or prof.dtype_bytes) * VAE_ACT_FACTOR
    cfg = 2 if c.per_step and w.cfg else 1
    return _tokens(c, prof, w) * max(c.hidden, 1) * prof.dtype_bytes * ACT_FACTOR * cfg


def _call_seconds(
    c: ComponentProfile, p: Placement, prof: PipelineProfile, w: Workload, d: DeviceSpec, batch: int
) -> float:
    """Seconds `c` takes in one pipeline call of `batch` images."""
    forwards = w.steps if c.per_step else 1
    cfg = 2 if c.per_step and w.cfg else 1
    slowdown = spec(c.fmt).slowdown if c.fmt != NONE else 1.0  # dequantization (quantize.py's sources)
    compute = 2 * c.params * _tokens(c, prof, w) * cfg * batch * slowdown / d.flops + FORWARD_SECONDS
    if p.mode == "resident":
        return forwards * compute
    if p.disk:
        transfer = c.bytes / min(d.disk_bandwidth, d.bandwidth) + (len(c.blocks) + 1) * SYNC_SECONDS
        return forwards * (compute + transfer)
    groups = c.leaves if p.mode == "leaf" else -(-len(c.blocks) // p.blocks_per_group) + 1
    transfer = c.bytes / d.bandwidth
    if p.stream:  # prefetch overlaps the next group's copy with this group's compute
        return forwards * (max(compute, transfer) + transfer / max(groups, 1))
    return forwards * (compute + transfer + groups * SYNC_SECONDS)


@dataclass(frozen=True)
class _Option:
    """One component in one placement at one batch size: what it adds to the plan."""

    placement: Placement
    resident: int  # device bytes held all the time
    phase: int  # device bytes while it runs (live groups + activations)
    host: int
    pinned: int
    seconds: float  # per pipeline call
    moved: int  # bytes per pipeline call
    load: int = 0  # host bytes while the pipeline loads (its run-dtype bytes unless its format applies at load)
    fmt: str = NONE  # storage format
    cost: float = 0.0  # seconds, plus QUANTIZED_SHARE of the pipeline's ideal time when quantized

    @property
    def quantized(self) -> bool:
        return self.fmt != NONE

    def counts(self) -> tuple:
        return (self.resident, self.phase, self.host, self.pinned, self.cost, self.load)

    def dominates(self, other: _Option) -> bool:
        mine, theirs = self.counts(), other.counts()
        return all(a <= b for a, b in zip(mine, theirs, strict=True)) and mine != theirs


def _formats(name: str, device: DeviceSpec, w: Workload) -> tuple[str, ...]:
    return allowed(w.quantize, name, device.formats, dict(w.fixed))


def _ideal(prof: PipelineProfile, device: DeviceSpec, w: Workload) -> float:
    """Seconds per image of the whole pipeline resident, unquantized, at batch 1 (the plans' measure)."""
    return sum(_call_seconds(prof.variant(n, NONE), Placement("resident"), prof, w, device, 1) for n in prof.components)


def _options(
    name: str, prof: PipelineProfile, device: DeviceSpec, w: Workload, batch: int, ideal: float | None = None
) -> list[_Option]:
    """The component's candidate (format, placement) pairs at `batch`, without those another beats
    on every count (cost included: a quantized one pays QUANTIZED_SHARE of `ideal` per image)."""
    penalty = QUANTIZED_SHARE * (_ideal(prof, device, w) if ideal is None else ideal) * batch
    out = []
    for fmt in _formats(name, device, w):
        c = prof.variant(name, fmt)
        acts = _activations(c, prof, w) * batch
        forwards = w.steps if c.per_step else 1
        load = 0 if w.loaded else c.bytes if fmt != NONE and spec(fmt).at_load else prof.components[name].bytes
        for p in _candidates(c, device, w.offload):
            off = p.mode != "resident"
            pinned = (c.pinned or c.bytes) if p.stream else 0  # the pinned copy is the host copy with streams
            out.append(
                _Option(
                    placement=p,
                    resident=0 if off else c.bytes,
                    phase=_floor(c, p) + acts,
                    host=pinned or (c.bytes if off and not p.disk else 0),
                    pinned=pinned,
                    seconds=(seconds := _call_seconds(c, p, prof, w, device, batch)),
                    moved=c.bytes * forwards if off else 0,
                    load=load,
                    fmt=fmt,
                    cost=seconds + (penalty if fmt != NONE else 0.0),
                )
            )
    return [o for o in out if not any(x.dominates(o) for x in out)]


def plan(prof: PipelineProfile, device: DeviceSpec, w: Workload) -> OffloadPlan:
    """The fastest predicted plan whose peak fits `device.budget` and whose host copies (and the
    weights while loading) fit `device.host_budget`; `OffloadError` when none does."""
    if w.offload not in OFFLOAD_CHOICES:
        raise OffloadError(f"`--offload` must be one of {', '.join(OFFLOAD_CHOICES)}; got `{w.offload}`.")
    names = list(prof.components)
    limit = device.budget * (1 - MARGIN)
    resident_ref = _ideal(prof, device, w)
    resident_peak = prof.total_bytes + max(_activations(c, prof, w) for c in prof.components.values())
    inf = float("inf")
    tables = [[_options(n, prof, device, w, b, resident_ref) for n in names] for b in range(1, w.max_batch + 1)]
    loading = sum(min(o.load for o in opts) for opts in tables[0])
    if loading > device.host_budget:
        raise OffloadError(
            f"Nothing loads (host RAM binds): loading holds every component's weights in host RAM "
            f"({format_size(loading)}; diffusers' from_pretrained loads to the CPU before fleetgen places anything"
            + (", formats applied at load counted as they load" if w.quantize != NONE else "")
            + f"), more than the {format_size(device.host_budget)} host budget. Use a node with more RAM "
            "(`--host-memory`), a smaller dtype, or quantized weights"
            + (" (`--quantize auto`)." if w.quantize == NONE else ".")
        )

    def search(limit: float, host_budget: float, bound: float):
        """The best (key, combo, batch, peak, host, seconds, moved) within the limits, costing less
        per image than `bound` (seconds plus what quantizing costs); None when there is none. Each
        batch size's best bounds the next;
        the largest first, as it is most often the fastest per image (the key decides, not the order)."""
        found = None

        def consider(combo, batch):
            nonlocal found
            peak = sum(o.resident for o in combo) + max(o.phase for o in combo)
            host = sum(o.host for o in combo)
            seconds = sum(o.seconds for o in combo) / batch
            cost = sum(o.cost for o in combo) / batch
            if peak > limit or host > host_budget or cost > bound or sum(o.load for o in combo) > host_budget:
                return
            moved = sum(o.moved for o in combo) // batch
            # equal cost: unquantized first (pixels as the weights were trained), then fewer bytes moved
            quantized = sum(o.quantized for o in combo)
            key = (cost, quantized, moved, sum(o.placement.mode != "resident" for o in combo), -batch)
            if found is None or key < found[0]:
                found = (key, combo, batch, peak, host, seconds, moved)

        policies = list(dict.fromkeys(o.fmt for opts in tables[0] for o in opts))  # the run dtype first
        for batch in range(w.max_batch, 0, -1):
            options = tables[batch - 1]
            # Quick feasible plans bound the search: per format (every component in it where it can
            # be), all resident where that fits (usually the fastest), else offloading the largest first.
            for fmt in policies:
                pool = [
                    [o for o in opts if o.fmt == fmt] or [o for o in opts if not o.quantized] or opts
                    for opts in options
                ]
                resident = [next((o for o in opts if o.placement.mode == "resident"), None) for opts in pool]
                if all(resident):
                    consider(tuple(resident), batch)
                if found is None or found[2] != batch:
                    greedy = [r or opts[0] for r, opts in zip(resident, pool, strict=True)]
                    for i in sorted(range(len(pool)), key=lambda i: -greedy[i].resident):
                        fastest = min((o for o in pool[i] if not o.resident), key=lambda o: o.seconds, default=None)
                        if fastest is not None:
                            greedy[i] = fastest
                            consider(tuple(greedy), batch)
            per_image = found[0][0] if found else bound
            for combo in _combos(options, limit, host_budget, per_image * batch):
                consider(combo, batch)
        return found

    found = search(limit, device.host_budget, inf)
    best = found[1:] if found else None
    best_key = found[0] if found else None
    leanest = None
    if best is None:  # the leanest plan the host allows, for the message: device bytes only
        fits_host = _combos(tables[0], inf, device.host_budget, inf, dims=3)
        peaks = [(sum(o.resident for o in c) + max(o.phase for o in c), c) for c in fits_host]
        leanest = min(peaks, key=lambda pc: pc[0]) if peaks else None
    # A budget binds when lifting it alone finds a faster plan.
    unbound = {}
    if best is not None:
        for lifted, lim, host_budget in (("device", inf, device.host_budget), ("host", limit, inf)):
            faster = search(lim, host_budget, best_key[0])
            unbound[lifted] = faster[0] if faster else None
    if best is None and leanest is None:
        raise OffloadError(
            f"Nothing fits the host (host RAM binds): every plan with `--offload {w.offload}` keeps more than "
            f"{format_size(device.host_budget)} of offloaded weights in host RAM. Raise `--host-memory` or use "
            "`--offload disk`" + (", or `--quantize auto`." if w.quantize == NONE else ".")
        )
    if best is None:
        peak, combo = leanest
        modes = ", ".join(f"{n} {_label(o)}" for n, o in zip(names, combo, strict=True))
        raise OffloadError(
            f"Nothing fits {format_size(device.budget)}{' on ' + device.name if device.name else ''} (device memory binds) "
            f"with `--offload "
            f"{w.offload}`: the leanest plan ({modes}, batch 1) needs {format_size(peak / (1 - MARGIN))} including the "
            f"{MARGIN:.0%} margin, at {w.width}x{w.height}. Use a smaller size or a larger `--gpu-memory`"
            + (", or `--offload auto`" if w.offload != "auto" else "")
            + (", or `--quantize auto`." if w.quantize == NONE else ".")
        )
    combo, batch, peak, host, seconds, moved = best
    placements = {n: o.placement for n, o in zip(names, combo, strict=True)}
    formats = {n: o.fmt for n, o in zip(names, combo, strict=True) if o.quantized}
    binds = tuple(BUDGETS[b] for b in ("device", "host") if unbound[b] is not None and unbound[b] < best_key)
    reason = _reason(prof, device, w, placements, batch, peak, resident_peak, host, binds, formats)
    if formats:
        reason = _why_quantized(prof, device, w, formats, placements, seconds) + "; " + reason
    return OffloadPlan(
        placements=placements,
        batch_size=batch,
        peak_bytes=int(peak),
        host_bytes=host,
        pinned_bytes=sum(o.pinned for o in combo),
        moved_per_image=moved,
        seconds_per_image=seconds,
        relative_speed=resident_ref / seconds,
        budget=device.budget,
        reason=reason,
        binds=binds,
        formats=formats,
        load_bytes=sum(o.load for o in combo),
        cost_per_image=best_key[0],
    )


def _label(o: _Option) -> str:
    return f"{o.fmt} {o.placement.label}" if o.quantized else o.placement.label


def _why_quantized(prof, device, w, formats, placements, seconds) -> str:
    """`transformer fp8 resident: 2.3x the predicted images/s of the best unquantized plan (...)`."""
    chosen = ", ".join(f"{n} {f} {placements[n].label}" for n, f in formats.items())
    if w.quantize != "auto":
        return f"{chosen} (`--quantize {w.quantize}`)"
    try:
        plain = plan(prof, device, replace(w, quantize=NONE, fixed=()))
    except OffloadError as err:
        why = str(err).split(":", 1)[0]
        return f"{chosen}: the only fit (unquantized, {why[0].lower() + why[1:]})"
    modes = ", ".join(f"{n} {m}" for n, m in plain.modes.items() if m != "resident") or "all resident"
    return (
        f"{chosen}: {plain.seconds_per_image / seconds:.2f}x the predicted images/s of the best unquantized plan "
        f"at this budget ({modes}, batch {plain.batch_size})"
    )


def _reason(prof, device, w, placements, batch, peak, resident_peak, host, binds, formats) -> str:
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
        head += (
            f"; offloaded copies take {format_size(host)} of the {format_size(device.host_budget)} host RAM this worker may "
            "use (its share of the node)"
        )
    cap = "`--max-batch`" if batch == w.max_batch else "memory"
    bound = " and ".join(binds) if binds else "neither budget (a larger one would not be faster)"
    return f"{head}; batch {batch} (limited by {cap}); predicted peak {format_size(peak)} ({limit}); binds: {bound}"


def resident_plan(names: list[str], batch_size: int, reason: str) -> OffloadPlan:
    """Everything on the device, no planning: CPU workers without a budget."""
    return OffloadPlan(placements=dict.fromkeys(names, Placement("resident")), batch_size=batch_size, reason=reason)
