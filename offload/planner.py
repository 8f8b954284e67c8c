"""The planner: a pure function from (profile, device, workload) to the fastest plan that fits.

For every batch size and every combination of per-component options (a storage format and a
placement, priced by offload/cost.py) it predicts
  peak device bytes = resident components
                      + max over phases (the running component's live groups + its activations)
and keeps the combinations whose peak ≤ (1 - MARGIN) × budget and whose host copies (and weights
while loading) fit the host budget; of those it returns the one with the lowest predicted cost per
image: seconds, plus QUANTIZED_SHARE of the ideal time per quantized component (so that `auto`
changes pixels only for a real gain).

The search (offload/search.py) finds what the exhaustive product would and feasibility only widens
with the budget, so more memory never yields a plan predicted to cost more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fleetgen.errors import OffloadError
from fleetgen.offload.cost import MARGIN, DeviceSpec, Placement, Workload, _activations, _ideal, _Option, _options
from fleetgen.offload.phasing import PHASES_CHOICES, phased_plan, split
from fleetgen.offload.reasons import reason as explain
from fleetgen.offload.search import _combos
from fleetgen.offload.speed import Terms
from fleetgen.offload.weight_formats import NONE, QuantizeSpec
from fleetgen.units import format_size

if TYPE_CHECKING:  # the planner reads the profile's numbers; measuring modules (torch) is the profile's
    from fleetgen.offload.profile import PipelineProfile

OFFLOAD_CHOICES = ("auto", "none", "block", "leaf", "disk")
BUDGETS = {"device": "device memory", "host": "host RAM"}  # what a plan says binds it


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
    # phased (offload/phasing.py): each phase's components, in the order they run; () per batch. A component
    # `resident` in a phased plan is on the device during its phase only.
    phases: tuple[tuple[str, ...], ...] = ()
    chunk: int = 0  # phased: images per chunk (one swap of the phases' resident components)
    # predicted seconds per image split per component (and `pipeline`: a call's own fixed cost) into
    # compute, transfers hidden and exposed, and fixed overheads (offload/speed.py): what a measurement is set beside
    terms: dict[str, Terms] = field(default_factory=dict)

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
            **({"phases": [list(p) for p in self.phases], "chunk_images": self.chunk} if self.phases else {}),
            **({"predicted_terms": {n: t.to_dict() for n, t in self.terms.items()}} if self.terms else {}),
        }

    @property
    def key(self) -> tuple:
        """What makes two plans the same plan: placements, formats, batch, phases."""
        return (tuple(sorted(self.modes.items())), tuple(sorted(self.formats.items())), self.batch_size, self.phases)


@dataclass(frozen=True)
class Candidate:
    """One combination of per-component options at one batch size, as the search scores it."""

    combo: tuple[_Option, ...]  # one option per component, in the profile's order
    batch: int
    peak: int  # predicted device bytes: resident + the largest phase
    host: int
    seconds: float  # per image
    moved: int  # bytes per image
    cost: float  # per image: seconds plus what quantizing costs (the objective)

    @property
    def key(self) -> tuple:
        """Lower is better: cost, then (at a cost equal within `TIE`, a difference no measurement could
        show) unquantized first (pixels as the weights were trained), fewer bytes moved, fewer components
        offloaded, the larger batch."""
        quantized = sum(o.quantized for o in self.combo)
        offloaded = sum(o.placement.mode != "resident" for o in self.combo)
        return (_tied(self.cost), quantized, self.moved, offloaded, -self.batch, self.cost)


TIE = 0.001  # costs within 0.1 % of each other compare as equal


def _tied(cost: float) -> int:
    return round(math.log(max(cost, 1e-12)) / math.log1p(TIE))


def _scored(combo: tuple[_Option, ...], batch: int) -> Candidate:
    return Candidate(
        combo,
        batch,
        peak=sum(o.resident for o in combo) + max(o.phase for o in combo),
        host=sum(o.host for o in combo),
        seconds=sum(o.seconds for o in combo) / batch,
        moved=sum(o.moved for o in combo) // batch,
        cost=sum(o.cost for o in combo) / batch,
    )


def _search(tables: list[list[list[_Option]]], limit: float, host_budget: float, bound: float) -> Candidate | None:
    """The best candidate within the limits (device bytes, host bytes steady and while loading)
    costing less per image than `bound`; None when there is none. `tables[b - 1]`: each component's
    options at batch b. Each batch size's best bounds the next; the largest first, as it is most
    often the fastest per image (the key decides, not the order)."""
    found: Candidate | None = None

    def consider(combo: tuple[_Option, ...], batch: int) -> None:
        nonlocal found
        c = _scored(combo, batch)
        if c.peak > limit or c.host > host_budget or c.cost > bound or sum(o.load for o in combo) > host_budget:
            return
        if found is None or c.key < found.key:
            found = c

    first = next((t for t in tables if any(t)), tables[0])  # (a batch asked for: the others' tables are empty)
    policies = list(dict.fromkeys(o.fmt for opts in first for o in opts))  # the run dtype first
    for batch in range(len(tables), 0, -1):
        options = tables[batch - 1]
        if not all(options):
            continue  # a batch size left out (`per_batch_plan`'s `batch`)
        # Quick feasible plans bound the search: per format (every component in it where it can
        # be), all resident where that fits (usually the fastest), else offloading the largest first.
        for fmt in policies:
            pool = [
                [o for o in opts if o.fmt == fmt] or [o for o in opts if not o.quantized] or opts for opts in options
            ]
            resident = [next((o for o in opts if o.placement.mode == "resident"), None) for opts in pool]
            if all(resident):
                consider(tuple(resident), batch)
            if found is None or found.batch != batch:
                greedy = [r or opts[0] for r, opts in zip(resident, pool, strict=True)]
                for i in sorted(range(len(pool)), key=lambda i: -greedy[i].resident):
                    fastest = min((o for o in pool[i] if not o.resident), key=lambda o: o.seconds, default=None)
                    if fastest is not None:
                        greedy[i] = fastest
                        consider(tuple(greedy), batch)
        per_image = found.cost if found else bound
        for combo in _combos(options, limit, host_budget, per_image * batch):
            consider(combo, batch)
    return found


def plan(
    prof: PipelineProfile, device: DeviceSpec, w: Workload, given: dict | None = None, batch: int | None = None
) -> OffloadPlan:
    """The fastest predicted plan whose peak fits `device.budget` and whose host copies (and the
    weights while loading) fit `device.host_budget`; `OffloadError` when none does. Per batch or
    phased (offload/phasing.py), as `w.phases` asks: under `auto` phased only where it is predicted
    cheaper per image, and the reason says both. `given` ({component: Placement}, the others
    resident) and `batch`: that plan predicted (`fleetgen plan --placement --batch`), or why it does
    not fit."""
    if w.phases not in PHASES_CHOICES:
        raise OffloadError(f"`--phases` must be one of {', '.join(PHASES_CHOICES)}; got `{w.phases}`.")
    per_batch = failed = None

    def per_batch_of(prof, device, w, at: int | None = None):
        """The per-batch plan of `prof` (all of it, or a phase's components), at `at` (a phased plan's
        try at a larger batch) unless a batch is asked (`batch`), else its fastest."""
        if given is None:
            return per_batch_plan(prof, device, w, batch or at)
        return given_plan(prof, device, w, {n: p for n, p in given.items() if n in prof.components}, batch or at)

    if given is not None:
        unknown = sorted(set(given) - set(prof.components))
        if unknown:
            raise OffloadError(
                f"no component {', '.join(unknown)} in {prof.model}: it has {', '.join(prof.components)}"
            )
    try:
        per_batch = per_batch_of(prof, device, w)
    except OffloadError as err:
        failed = err
    if (
        w.phases == "off"
        or split(prof, w.decode_apart) is None
        or (failed is not None and str(failed).startswith("Nothing loads"))
    ):
        if failed is not None:
            raise failed
        return per_batch
    try:
        phased = phased_plan(prof, device, w, per_batch_of)
    except OffloadError as err:
        if failed is not None:
            raise failed from None
        return replace(per_batch, reason=f"{per_batch.reason}; not phased: {str(err).split('. ')[0]}")
    if per_batch is None:
        return replace(phased, reason=f"{phased.reason}; per batch nothing fits")
    ratio = per_batch.seconds_per_image / phased.seconds_per_image
    if w.phases == "on" or phased.cost_per_image < per_batch.cost_per_image:
        moved = (
            f"{format_size(phased.moved_per_image)} moved per image instead of {format_size(per_batch.moved_per_image)}"
        )
        return replace(phased, reason=f"{phased.reason}; {moved}; predicted {ratio:.2f}x per batch's images/s")
    return replace(per_batch, reason=f"{per_batch.reason}; not phased: predicted {ratio:.2f}x these images/s")


def per_batch_plan(
    prof: PipelineProfile, device: DeviceSpec, w: Workload, batch: int | None = None, given: dict | None = None
) -> OffloadPlan:
    """The fastest plan calling the whole pipeline per batch (`plan`'s per-batch half); `batch`: at
    that batch size only; `given`: {component: Placement} placed so (`given_plan`)."""
    if given is not None:
        return given_plan(prof, device, w, given, batch)
    if w.offload not in OFFLOAD_CHOICES:
        raise OffloadError(f"`--offload` must be one of {', '.join(OFFLOAD_CHOICES)}; got `{w.offload}`.")
    beside, whole = device.beside, device.budget  # the scorers: resident beside the pipeline in every call
    if beside:
        name = f"{device.name or 'the device'} less {format_size(beside)} for the scorers"
        device = replace(device, budget=max(device.budget - beside, 0), beside=0, name=name)
    names = list(prof.components)
    limit, inf = device.budget * (1 - MARGIN), float("inf")
    resident_ref = _ideal(prof, device, w)
    tables = [[_options(n, prof, device, w, b, resident_ref) for n in names] for b in range(1, w.max_batch + 1)]
    tables = [_with_call_costs(t, b, device) for b, t in enumerate(tables, 1)]
    _check_loading(tables[0], device, w)
    if batch is not None:  # the other batch sizes' options left out: `_search` skips an empty table
        tables = [t if b == batch else [[] for _ in names] for b, t in enumerate(tables, 1)]
    best = _search(tables, limit, device.host_budget, inf)
    if best is None:
        if batch is not None:
            raise OffloadError(f"Nothing fits at batch {batch} on {device.name or 'the device'} (device memory binds)")
        raise _nothing_fits(prof, device, w, tables[0])
    # A budget binds when lifting it alone finds a faster plan.
    faster = {
        "device": _search(tables, inf, device.host_budget, best.cost),
        "host": _search(tables, limit, inf, best.cost),
    }
    binds = tuple(BUDGETS[b] for b in ("device", "host") if faster[b] is not None and faster[b].key < best.key)
    placements = {n: o.placement for n, o in zip(names, best.combo, strict=True)}
    formats = {n: o.fmt for n, o in zip(names, best.combo, strict=True) if o.quantized}
    resident_peak = prof.total_bytes + max(_activations(c, prof, w) for c in prof.components.values())
    reason = explain(prof, device, w, best, placements, formats, resident_peak, binds)
    if formats:
        reason = _why_quantized(prof, device, w, formats, placements, best.seconds) + "; " + reason
    if beside:
        reason += f"; the scorers hold {format_size(beside)} beside the pipeline"
    # a leaner plan (workers/pipeline/plans.py) steps down from the whole budget, the scorers off it again
    return _plan_of(best, names, placements, formats, resident_ref, whole, device, reason, binds)


def _with_call_costs(options: list[list[_Option]], batch: int, device: DeviceSpec) -> list[list[_Option]]:
    """A batch's options with the pipeline call's own fixed costs (offload/speed.py: per call, and per
    image of it) in the first component's seconds and cost: once per plan, whatever its placements,
    so that the search compares whole calls; `_terms` shows them apart, as `pipeline`."""
    fixed = device.speed.call_seconds + device.speed.image_seconds * batch
    if not options or not fixed:
        return options
    first = [replace(o, seconds=o.seconds + fixed, cost=o.cost + fixed) for o in options[0]]
    return [first, *options[1:]]


def _terms(names: list[str], combo: tuple[_Option, ...], batch: int, device: DeviceSpec) -> dict[str, Terms]:
    """Per image: each component's terms, and the pipeline call's own fixed cost."""
    terms = {n: o.terms.scaled(1 / batch) for n, o in zip(names, combo, strict=True)}
    return {**terms, "pipeline": Terms(fixed=device.speed.call_seconds / batch + device.speed.image_seconds)}


def given_plan(
    prof: PipelineProfile, device: DeviceSpec, w: Workload, given: dict, batch: int | None = None
) -> OffloadPlan:
    """The plan that places each component as `given` says ({component: Placement}; the others
    resident), per batch, at `batch` (else the fastest batch up to `w.max_batch` that fits), predicted
    as the planner predicts its own; `OffloadError` saying in one line why it does not fit."""
    unknown = sorted(set(given) - set(prof.components))
    if unknown:
        raise OffloadError(f"no component {', '.join(unknown)} in {prof.model}: it has {', '.join(prof.components)}")
    placements = {n: given.get(n, Placement("resident")) for n in prof.components}
    for n, p in placements.items():
        why = _not_offered(prof.components[n], p, device)
        if why:
            raise OffloadError(f"{n} {p.label}: {why}")
    beside, whole = device.beside, device.budget
    if beside:
        device = replace(device, budget=max(device.budget - beside, 0), beside=0)
    limit = device.budget * (1 - MARGIN)
    ideal = _ideal(prof, device, w)
    names = list(prof.components)
    best = over = None
    for b in [batch] if batch else range(w.max_batch, 0, -1):
        combo = []
        for n in names:
            options = _options(n, prof, device, w, b, ideal, placements[n])
            if not options:
                raise OffloadError(f"{n} {placements[n].label}: its storage format refuses this placement")
            combo.append(options)
        combo = [min(options, key=lambda o: o.cost) for options in _with_call_costs(combo, b, device)]
        c = _scored(tuple(combo), b)
        load = sum(o.load for o in c.combo)
        if c.peak > limit or c.host > device.host_budget or load > device.host_budget:
            over = over or (c, load)
            continue
        if best is None or c.cost < best.cost:
            best = c
    if best is None:
        c, load = over
        if c.host > device.host_budget or load > device.host_budget:
            held = max(c.host, load)
            raise OffloadError(
                f"does not fit (host RAM binds): it holds {format_size(held)} in host RAM, more than the "
                f"{format_size(device.host_budget)} host budget"
            )
        at = f"at batch {c.batch}" if batch else "even at batch 1"
        raise OffloadError(
            f"does not fit (device memory binds): {at} its predicted peak is {format_size(c.peak)}, more than the "
            f"{format_size(limit)} usable of {format_size(device.budget)}"
        )
    formats = {n: o.fmt for n, o in zip(names, best.combo, strict=True) if o.quantized}
    modes = ", ".join(f"{n} {p.label}" for n, p in placements.items() if p.mode != "resident") or "all resident"
    reason = (
        f"as given ({modes}), batch {best.batch}; predicted peak {format_size(best.peak)} "
        f"({format_size(limit)} usable of {format_size(device.budget)})"
    )
    return _plan_of(best, names, placements, formats, ideal, whole, device, reason)


def _plan_of(best: Candidate, names, placements, formats, ideal, whole, device, reason, binds=()) -> OffloadPlan:
    """The plan a candidate makes: its placements and formats, its predicted peak, bytes and seconds
    (against `ideal`, all resident at batch 1), the whole budget it was planned in, and its terms."""
    return OffloadPlan(
        placements=placements,
        batch_size=best.batch,
        peak_bytes=int(best.peak),
        host_bytes=best.host,
        pinned_bytes=sum(o.pinned for o in best.combo),
        moved_per_image=best.moved,
        seconds_per_image=best.seconds,
        relative_speed=ideal / best.seconds,
        budget=whole,
        reason=reason,
        binds=binds,
        formats=formats,
        load_bytes=sum(o.load for o in best.combo),
        cost_per_image=best.cost,
        terms=_terms(names, best.combo, best.batch, device),
    )


def _not_offered(c, p: Placement, device: DeviceSpec) -> str | None:
    """Why the planner never places `c` so (None: it may)."""
    if p.mode == "resident":
        return None
    if p.stream and not device.streams:
        return "streams need a CUDA device"
    if p.stream and c.upcast:
        return "the pipeline upcasts it to float32, and a stream would copy its float16 weights back"
    if p.mode == "block" and not c.blocks:
        return "it has no blocks to group (use leaf_level)"
    if p.disk and p.mode == "leaf":
        return "leaf level on disk corrupts tied weights; use block_level(1)+disk"
    if p.disk and c.adapters:
        return "LoRA layers offloaded to disk compute wrong images"
    return None


def candidates(
    prof: PipelineProfile, device: DeviceSpec, w: Workload, best: OffloadPlan, k: int = 3
) -> list[OffloadPlan]:
    """The plans worth timing beside `best` (the model's choice), fastest predicted first, `best`
    first among equals: the best plan at each batch size and the best all resident, per batch;
    `best`'s own placements at each smaller batch. At most `k`, `best` always among them."""
    found = {best.key: best}
    work = replace(w, phases="off")

    def add(make) -> None:
        try:
            p = make()
        except OffloadError:
            return
        found.setdefault(p.key, p)

    for b in range(1, w.max_batch + 1):
        add(lambda b=b: per_batch_plan(prof, device, work, batch=b))
        if w.offload == "auto":  # `--offload` given is the user's: every candidate keeps it
            add(lambda b=b: per_batch_plan(prof, device, replace(work, offload="none"), batch=b))
        if not best.phases:
            add(lambda b=b: given_plan(prof, device, work, best.placements, b))
    ranked = sorted(found.values(), key=lambda p: (p.cost_per_image, p is not best))
    keep = [p for p in ranked if p is not best][: k - 1]
    return sorted([best, *keep], key=lambda p: (p.cost_per_image, p is not best))


def _check_loading(options: list[list[_Option]], device: DeviceSpec, w: Workload) -> None:
    """Loading holds every component's weights in host RAM first: refused when even that does not fit."""
    loading = sum(min(o.load for o in opts) for opts in options)
    if loading <= device.host_budget:
        return
    quantized = w.quantize.label != NONE
    raise OffloadError(
        f"Nothing loads (host RAM binds): loading holds every component's weights in host RAM "
        f"({format_size(loading)}; diffusers' from_pretrained loads to the CPU before fleetgen places anything"
        + (", formats applied at load counted as they load" if quantized else "")
        + f"), more than the {format_size(device.host_budget)} host budget. Use a node with more RAM "
        "(`--host-memory`), a smaller dtype, or quantized weights" + (" (`--quantize auto`)." if not quantized else ".")
    )


def _nothing_fits(prof: PipelineProfile, device: DeviceSpec, w: Workload, options: list[list[_Option]]) -> OffloadError:
    """Why no plan fits: the host (every plan keeps too much offloaded), else the device, naming
    the leanest plan the host allows and what it would need."""
    inf, hint = float("inf"), ", or `--quantize auto`." if w.quantize.label == NONE else "."
    peaks = [(_scored(c, 1).peak, c) for c in _combos(options, inf, device.host_budget, inf, dims=3)]
    if not peaks:
        return OffloadError(
            f"Nothing fits the host (host RAM binds): every plan with `--offload {w.offload}` keeps more than "
            f"{format_size(device.host_budget)} of offloaded weights in host RAM. Raise `--host-memory` or use "
            "`--offload disk`" + hint
        )
    peak, combo = min(peaks, key=lambda pc: pc[0])
    modes = ", ".join(f"{n} {_label(o)}" for n, o in zip(prof.components, combo, strict=True))
    on = " on " + device.name if device.name else ""
    return OffloadError(
        f"Nothing fits {format_size(device.budget)}{on} (device memory binds) with `--offload {w.offload}`: the "
        f"leanest plan ({modes}, batch 1) needs {format_size(peak / (1 - MARGIN))} including the {MARGIN:.0%} "
        f"margin, at {w.width}x{w.height}. Use a smaller size or a larger `--gpu-memory`"
        + (", or `--offload auto`" if w.offload != "auto" else "")
        + hint
    )


def _label(o: _Option) -> str:
    return f"{o.fmt} {o.placement.label}" if o.quantized else o.placement.label


def _why_quantized(prof, device, w, formats, placements, seconds) -> str:
    """`transformer fp8 resident: 2.3x the predicted images/s of the best unquantized plan (...)`."""
    chosen = ", ".join(f"{n} {f} {placements[n].label}" for n, f in formats.items())
    if not w.quantize.auto:
        return f"{chosen} (`--quantize {w.quantize.label}`)"
    try:
        plain = per_batch_plan(prof, device, replace(w, quantize=QuantizeSpec(), fixed=()))
    except OffloadError as err:
        why = str(err).split(":", 1)[0]
        return f"{chosen}: the only fit (unquantized, {why[0].lower() + why[1:]})"
    modes = ", ".join(f"{n} {m}" for n, m in plain.modes.items() if m != "resident") or "all resident"
    return (
        f"{chosen}: {plain.seconds_per_image / seconds:.2f}x the predicted images/s of the best unquantized plan "
        f"at this budget ({modes}, batch {plain.batch_size})"
    )


def resident_plan(names: list[str], batch_size: int, reason: str) -> OffloadPlan:
    """Everything on the device, no planning: CPU workers without a budget."""
    return OffloadPlan(placements=dict.fromkeys(names, Placement("resident")), batch_size=batch_size, reason=reason)
