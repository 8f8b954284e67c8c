"""`fleetgen plan`: the plan each device budget would get, without weights or a GPU."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from dataclasses import dataclass, field, replace

from fleetgen.errors import ConfigError, OffloadError
from fleetgen.offload import DeviceSpec, Workload, plan
from fleetgen.offload.architectures import NAMES, build_on_meta, pipeline_settings, resolve
from fleetgen.offload.devices import ASSUMED_BANDWIDTH, ASSUMED_FLOPS, GPUS, host_available_bytes, node_copy_refusal
from fleetgen.offload.devices import gpu as device_table
from fleetgen.offload.profiles import PipelineProfile, stored_profile
from fleetgen.offload.weight_formats import CHOOSABLE, check_components, spec
from fleetgen.scores import ScoreSpec
from fleetgen.settings import Row, build, check_names, nested, setting, table
from fleetgen.units import format_size, parse_size
from fleetgen.workers.families.detect import Family, choose_task, identify_dir
from fleetgen.workers.spec import Fit, GenerationSettings, Source


def plan_settings() -> list[Row]:
    """`fleetgen plan`'s options: the model, its own, then the job's settings it plans with (declared with
    `setting(..., plan=True)`: the same names, help and parsing as `fleetgen run`'s)."""
    rows = table(PlanRequest, group="plan", scope="job", fingerprint=False)
    job = [r for r in rows if len(r.path) > 1 and r.plan]
    ordered = [*(r for r in job if r.name == "model"), *(r for r in rows if len(r.path) == 1)]
    return [dataclasses.replace(r, group="plan") for r in [*ordered, *(r for r in job if r.name != "model")]]


@dataclass(frozen=True)
class PlanRequest:
    """What `fleetgen plan` (and `fleetgen.plan`) is asked: a model, the device budgets, and the job's
    settings to plan it for; unset ones are the model family's defaults, as in a job (but 1024 pixels
    a side for image families, and up to 8 images per call)."""

    budgets: tuple[str, ...] = setting(
        (), "a device budget, e.g. 24GiB; repeat for more", flags=("--gpu-memory",), metavar="SIZE"
    )
    gpu: str | None = setting(
        None,
        lambda: (
            f"a card whose dense bf16 throughput and host link to assume ({', '.join(GPUS)}); its memory is the "
            "budget unless --gpu-memory is given (default: 100 TFLOP/s and 20 GB/s)"
        ),
    )
    bandwidth: float | None = setting(None, "host→device GB/s to assume (default: the --gpu's, else 20)")
    references: int = setting(1, "edit models: input images per image to plan for")
    placement: str | None = setting(
        None,
        "predict this plan instead of choosing one: COMPONENT=MODE,... with MODE as plans and worker records spell "
        "it (resident, leaf_level+stream, block_level(4), block_level(1)+disk, ...); components not named stay "
        "resident",
        metavar="COMPONENT=MODE,...",
    )
    batch: int | None = setting(
        None, "predict at this batch size (default: the fastest that fits, up to --max-batch)", at_least=1
    )
    workers_per_node: int = setting(
        1,
        "workers (one a GPU) on a node, sharing its host RAM and host link: --host-memory is then the node's, and "
        "the plan shows host RAM per node with --host-copy's copy of the weights once (node) or per worker",
        at_least=1,
    )
    source: Source = nested(Source, group="plan", scope="job", fingerprint=False)
    generation: GenerationSettings = nested(GenerationSettings, group="plan", scope="job", fingerprint=True)
    fit: Fit = nested(Fit, group="plan", scope="worker", fingerprint=False, factory=lambda: Fit(max_batch=8))

    @classmethod
    def of(cls, model: str, **options) -> PlanRequest:
        check_names(list(options), plan_settings(), "fleetgen.plan")
        return build(cls, {"model": model, **options})

    @property
    def model(self) -> str:
        return self.source.model


def plan_workload(request: PlanRequest | str, **options) -> tuple[Workload, Family]:
    """The workload to plan for — the job's own derivation (`GenerationSettings.workload`) over the
    settings a job with these options would resolve: the family's defaults, its task (whose input
    images the VAE encodes and, for edit models, whose `references` join the denoiser's sequence).
    `request`: a `PlanRequest`, or the model with the request's `options`."""
    r = request if isinstance(request, PlanRequest) else PlanRequest.of(request, **options)
    g = r.generation
    root = resolve(r.model)
    family, _ = identify_dir(root)
    cls = json.loads((root / "model_index.json").read_text()).get("_class_name", "")
    chosen, _ = choose_task(family, g.task, cls)
    if r.references < 1 or (chosen.images and r.references > chosen.images):
        raise ConfigError(f"`--references` must be 1 to {chosen.images or 1} for {family.name} {chosen.name}.")
    frames = (g.num_frames or family.frames) if chosen.video else 0
    why = family.frames_rule(frames) if frames else None
    if g.num_frames and not chosen.video:
        why = f"{family.name} {chosen.name} makes images, not clips"
    if why:
        raise ConfigError(f"`--num-frames`: {why}.")
    size = family.sizes[0] if chosen.video and family.sizes else "1024x1024"
    settings = replace(
        g,
        steps=family.steps if g.steps is None else g.steps,
        guidance=family.guidance if g.guidance is None else g.guidance,
        width=g.width or int(size.split("x")[0]),
        height=g.height or int(size.split("x")[1]),
        family=family.name,
        task=chosen.name,
        num_frames=frames or None,
    )
    fit = r.fit
    return settings.workload(fit.max_batch, fit.offload, references=r.references, phases=fit.phases), family


def pipeline_profile(model: str, dtype: str, vae_upcast: bool, formats: tuple[str, ...]) -> PipelineProfile:
    """A shipped architecture's stored profile (no torch, no diffusers: offload/profiles.py), else the
    profile of the pipeline built from its configs on the `meta` device."""
    if model in NAMES:
        stored = stored_profile(resolve(model), dtype, vae_upcast, formats)
        if stored is not None:
            return stored
    from fleetgen.offload.profile import profile_modules
    from fleetgen.workers.pipeline.load import DTYPES

    return profile_modules(model, build_on_meta(model), DTYPES[dtype], vae_upcast, formats, pipeline_settings(model))


@dataclass(frozen=True)
class RowsAsk:
    """What `plan_rows` is asked: a model's plans for device `budgets` (sizes like `24GiB`) with `host_memory`
    (the node's where `node` says several workers share it; default 80 % of this machine's available RAM), at
    `dtype`, for `work`; the host link and the device's rate to assume; `extra`: the family's VAE upcast and
    the job's scorers (held beside the pipeline: planned in what they leave); `given`: placements to predict
    instead of choosing; `batch`: the batch to predict at."""

    model: str
    budgets: tuple[str, ...]
    host_memory: int | str | None
    dtype: str
    work: Workload
    bandwidth: float = ASSUMED_BANDWIDTH
    flops: float = ASSUMED_FLOPS
    extra: PlanExtras = field(default_factory=lambda: PlanExtras())
    given: dict | None = None
    batch: int | None = None
    node: NodeShare = field(default_factory=lambda: NodeShare())


def plan_rows(ask: RowsAsk) -> tuple[dict, list[dict]]:
    """(the profile summary, one row per budget: the plan or the reason nothing fits)."""
    mapping = ask.work.quantize.mapping
    formats = CHOOSABLE if ask.work.quantize.auto else tuple(sorted(set(mapping.values())))
    profile = pipeline_profile(ask.model, ask.dtype, ask.extra.vae_upcast, formats)
    check_components(mapping, list(profile.components), ask.model)
    missing = sorted(set(ask.given or ()) - set(profile.components))
    if missing:
        raise ConfigError(
            f"`--placement`: no component {', '.join(missing)} in {ask.model}; it has {', '.join(profile.components)}."
        )
    host = ask.host_memory
    host = parse_size(host, "--host-memory") if isinstance(host, str) else host or int(host_available_bytes() * 0.8)
    work = dataclasses.replace(ask.work, quantize=ask.work.quantize.pinned())
    scorers = ask.extra.scores.reserved_bytes(profile.dtype_bytes)
    at_load = {c for c, f in mapping.items() if f != "none" and spec(f).at_load}
    node = ask.node.held(profile, at_load, host)
    link = node.link(ask.bandwidth)
    rows = []
    for text in ask.budgets:
        budget = parse_size(text, "--gpu-memory")
        name = f"a {format_size(budget)} GPU"
        device = DeviceSpec(budget, node.own_host, link, ask.flops, True, name=name, beside=scorers, shared=node.shared)
        try:
            row = {"gpu_memory": text, **plan(profile, device, work, ask.given, ask.batch).to_dict()}
            if node.share.workers > 1 or node.shared or node.fell_back:
                row["node"] = node.row(row, link)
            rows.append(row)
        except OffloadError as err:
            rows.append(_refused(text, str(err), node))
    return _summary(ask, profile, host, scorers), rows


def _refused(budget: str, error: str, node: NodeHold) -> dict:
    binds = "host RAM" if "(host RAM binds)" in error else "device memory"
    if binds == "host RAM" and node.share.workers > 1 and not node.shared:
        error += (
            f" (each worker's share: {format_size(node.host)} on the node / {node.share.workers} workers; "
            "`--host-copy node` holds the weights once per node)"
        )
    return {"gpu_memory": budget, "binds": [binds], "error": error}


def _summary(ask: RowsAsk, profile: PipelineProfile, host: int, scorers: int) -> dict:
    scores = ask.extra.scores
    scoring = {"names": list(scores.names), "bytes": scorers, "seconds_per_image": scores.seconds_per_image(ask.flops)}
    return {
        "model": ask.model,
        "frames": ask.work.frames,
        "dtype": ask.dtype,
        "host_memory_bytes": host,
        # from_pretrained loads every component to host RAM, at the run dtype unless its format applies at load
        "load_host_bytes": profile.total_bytes,
        "quantize": ask.work.quantize.label,
        "bandwidth_bytes_per_s": ask.bandwidth,
        "flops": ask.flops,
        # each image's scoring: its scorers' weights (and an image's activations) held, their forward passes
        "scorers": scoring if scores else None,
        "components": _components(profile),
    }


# Host→device bytes/s a node's host memory serves to all of its GPUs at once: eight H100s reading pinned
# host memory together measured ~207 GB/s in all (~27 GB/s each, ~55 GB/s for one alone): each of a
# node's N streaming workers is planned at most this / N.
NODE_HOST_BANDWIDTH = 207e9


@dataclass(frozen=True)
class NodeShare:
    """The workers of one node, and where their host copy of the weights lives (`--host-copy`, its default)."""

    workers: int = 1
    host_copy: str = Fit.host_copy

    def held(self, profile: PipelineProfile, at_load: set[str], host: int) -> NodeHold:
        """What the node holds for `profile` with `host` bytes of RAM: the node's one copy of the components
        that can be shared (not those in a format applied at load), else — where writing it beside the first
        worker's load does not fit, as that worker would find (`node_copy_refusal`) — a copy per worker."""
        shared = (
            frozenset(c for c in profile.components if c not in at_load) if self.host_copy == "node" else frozenset()
        )
        largest = max((profile.components[c].bytes for c in shared), default=0)
        why = node_copy_refusal(profile.total_bytes, largest, host) if shared else None
        if why:
            mine = replace(self, host_copy="worker")
            return NodeHold(mine, frozenset(), 0, profile.total_bytes, host, f"a copy per worker: {why}")
        held = sum(profile.components[c].bytes for c in shared)
        # loading: the first worker writes the node's copy a component at a time from its own, freeing each as it
        # is written (its load and the largest component at once); the others map it
        return NodeHold(self, shared, held, profile.total_bytes + largest, host, None)


@dataclass(frozen=True)
class NodeHold:
    """A node's host RAM for one model (`NodeShare.held`): the node's copy (`shared`, `held` bytes; none where
    each worker keeps its own), the loading peak, the node's RAM, and why it fell back to a copy per worker."""

    share: NodeShare
    shared: frozenset[str]
    held: int
    loading: int
    host: int
    fell_back: str | None

    @property
    def own_host(self) -> int:
        """Each worker's own host RAM (offloaded copies, staging): the node's, less its copy, split."""
        return (self.host - self.held) // self.share.workers

    def link(self, bandwidth: float) -> float:
        """Each worker's share of the node's host link."""
        return min(bandwidth, NODE_HOST_BANDWIDTH / self.share.workers) if self.share.workers > 1 else bandwidth

    def row(self, row: dict, link: float) -> dict:
        """Host RAM per node for a row's plan: the node's copy once (or none) and each worker's own; the loading
        peak (the first worker writing the node's copy; else every worker loading its own)."""
        own = row["host_bytes"]
        # a plan that holds everything on the device for good leaves the node's copy once loaded
        kept = self.held if row.get("phases") or any(m != "resident" for m in row["modes"].values()) else 0
        return {
            "workers": self.share.workers,
            "host_copy": self.share.host_copy,
            "shared_bytes": kept,
            "own_bytes_per_worker": own,
            "host_bytes": kept + self.share.workers * own,
            "host_budget_bytes": self.host,
            "load_peak_bytes": self.loading if self.held else self.share.workers * row["load_host_bytes"],
            "bandwidth_per_worker": link,
            **({"note": self.fell_back} if self.fell_back else {}),
        }


@dataclass(frozen=True)
class PlanExtras:
    """What `plan_rows` plans beside the workload: the family's VAE decoding in float32 (SDXL), and the
    job's scorers on the device."""

    vae_upcast: bool = False
    scores: ScoreSpec = ScoreSpec()


def _components(profile) -> dict:
    return {
        n: {
            "class": c.cls,
            "params": c.params,
            "bytes": c.bytes,
            "per_step": c.per_step,
            "blocks": len(c.blocks),
            **({"bytes_as": {f: v.bytes for f, v in profile.variants[n].items()}} if n in profile.variants else {}),
        }
        for n, c in profile.components.items()
    }


@dataclass(frozen=True)
class Plans:
    """What `fleetgen plan` shows: the pipeline as profiled, and per device budget its plan or why
    nothing fits."""

    summary: dict  # the model, family, dtype, host budget, assumed device figures, components
    rows: list[dict]  # per budget: the plan (OffloadPlan.to_dict()) or `error`, and what binds

    @property
    def all_fit(self) -> bool:
        return all("error" not in r for r in self.rows)

    def to_dict(self) -> dict:
        return {**self.summary, "plans": self.rows}

    def text(self) -> str:
        buf = io.StringIO()
        print_plans(self.summary, self.rows, False, buf)
        return buf.getvalue()


def plan_budgets(request: PlanRequest) -> Plans:
    """`fleetgen plan`: the plan each of the request's budgets (`--gpu-memory`, sizes as typed, e.g.
    `24GiB`) would get. Its `gpu`: a card of offload/devices.py, whose throughput and link the plans
    assume (and whose memory is the budget when `gpu_memory` is not given); `dtype`: default the
    family's; `bandwidth`: host→device GB/s to assume (default the card's, else 20 GB/s)."""
    card = device_table(request.gpu) if request.gpu else None
    if not request.budgets and card is None:
        raise ConfigError("Give `--gpu-memory` (a budget, e.g. 24GiB) or `--gpu` (a card, e.g. H100).")
    budgets = list(request.budgets) if request.budgets else [f"{card.memory_gib}GiB"]
    flops = card.flops if card else ASSUMED_FLOPS
    bandwidth = request.bandwidth * 1e9 if request.bandwidth else (card.bandwidth if card else ASSUMED_BANDWIDTH)
    work, family = plan_workload(request)
    dtype = family.dtype if request.source.dtype == "auto" else request.source.dtype
    given = parse_placement(request.placement)
    if request.batch:
        work = replace(work, max_batch=max(work.max_batch, request.batch))
    summary, rows = plan_rows(
        RowsAsk(
            request.model,
            tuple(budgets),
            request.fit.host_memory,
            dtype,
            work,
            bandwidth,
            flops,
            extra=PlanExtras(family.upcasts_vae, request.generation.score),
            given=given,
            batch=request.batch,
            node=NodeShare(request.workers_per_node, request.fit.host_copy),
        )
    )
    summary["family"] = family.name
    summary["gpu"] = card.name if card else None
    return Plans(summary, rows)


def parse_placement(text: str | None) -> dict | None:
    """`--placement transformer=leaf_level+stream,text_encoder_2=block_level(4)` as {component: Placement}."""
    from fleetgen.offload.cost import Placement

    if not text:
        return None
    given = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, mode = part.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"`--placement`: `{part}` is not COMPONENT=MODE (e.g. transformer=leaf_level+stream).")
        try:
            given[name.strip()] = Placement.parse(mode)
        except ValueError as err:
            raise ConfigError(f"`--placement` {name.strip()}: {err}.") from None
    return given


def _scorers_line(scoring: dict | None) -> str:
    if not scoring:
        return ""
    return (
        f"scorers {', '.join(scoring['names'])}: {format_size(scoring['bytes'])} on the device once the pipeline has "
        "decoded (beside a per-batch plan throughout; beside a phased plan's decode phase only), about "
        f"{scoring['seconds_per_image'] * 1e3:.1f} ms per image\n"
    )


def print_plans(summary: dict, rows: list[dict], as_json: bool, out=None) -> None:
    out = out or sys.stdout  # looked up per call: a default bound at import outlives a redirected stdout
    if as_json:
        json.dump({**summary, "plans": rows}, out, indent=2)
        out.write("\n")
        return
    comps = summary["components"]
    out.write(
        f"{summary['model']} ({summary.get('family', 'unknown')} family) at {summary['dtype']}: "
        + ", ".join(
            f"{n} {c['class']} {c['params'] / 1e9:.2f} B params ({format_size(c['bytes'])})" for n, c in comps.items()
        )
        + "\n"
    )
    out.write(
        f"host RAM {format_size(summary['host_memory_bytes'])} (loading holds {format_size(summary['load_host_bytes'])}, "
        "then the offloaded copies); assumed host→device "
        f"{summary['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, {summary['flops'] / 1e12:.0f} TFLOP/s (a large matmul)"
        + (
            f" (an {summary['gpu']}: offload/devices.py)"
            if summary.get("gpu")
            else " (defaults; `--gpu NAME` for a card's)"
        )
        + "\n"
    )
    out.write(_scorers_line(summary.get("scorers")) + "\n")
    table = _plans_table(list(comps), rows, clips=bool(summary.get("frames")))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")
    out.write("\n")
    for r in rows:
        out.write(f"{r['gpu_memory']}: {r.get('reason') or r['error']}\n")
        if r.get("node"):
            out.write(f"{r['gpu_memory']}: {_node_line(r['node'])}\n")


def _plans_table(names: list[str], rows: list[dict], clips: bool) -> list[list[str]]:
    """`fleetgen plan`'s table: a header, then a row per budget (`clips`: a video model, per clip and
    clips per hour)."""
    header = [
        "gpu",
        "runs",  # per batch, or phased a chunk at a time (offload/phasing.py): resident then means in its phase
        *names,
        "batch",
        "peak",
        "loading",
        "pinned",
        "moved/clip" if clips else "moved/img",
        "clips/h" if clips else "rel img/s",
        "binds",
    ]
    table = [header]
    for r in rows:
        binds = ", ".join(r.get("binds") or []) or "neither"
        if "error" in r:
            error = r["error"]
            what = next((w.lower() for w in ("Nothing loads", "does not fit") if error.startswith(w)), "nothing fits")
            table.append([r["gpu_memory"], "", what, *[""] * (len(header) - 4), binds])
            continue
        formats = r.get("formats") or {}
        table.append(
            [
                r["gpu_memory"],
                f"phased/{r['chunk_images']}" if r.get("phases") else "per batch",
                *[" ".join(filter(None, [formats.get(n), r["modes"][n]])) for n in names],
                str(r["batch_size"]),
                format_size(r["peak_bytes"]),
                format_size(r["load_host_bytes"]),
                format_size(r["pinned_bytes"]),
                format_size(r["moved_bytes_per_image"]),
                f"{3600 / r['predicted_seconds_per_image']:.1f}" if clips else f"{r['predicted_relative_speed']:.2f}",
                binds,
            ]
        )
    return table


def _node_line(n: dict) -> str:
    held = f"{format_size(n['shared_bytes'])} (the node's copy of the weights, once) + " if n["shared_bytes"] else ""
    line = (
        f"a node of {n['workers']} worker(s), host copy per {n['host_copy']}: host RAM {held}{n['workers']} x "
        f"{format_size(n['own_bytes_per_worker'])} (each worker's own) = {format_size(n['host_bytes'])} of "
        f"{format_size(n['host_budget_bytes'])}; loading peaks at {format_size(n['load_peak_bytes'])}; host link "
        f"{n['bandwidth_per_worker'] / 1e9:.1f} GB/s a worker"
    )
    return line + (f" ({n['note']})" if n.get("note") else "")
