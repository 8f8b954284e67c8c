"""This worker's plans: the plan for its device, a leaner one after an out-of-memory error, and
what counts as one; each component's dtype kept across a pipeline call."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from fleetgen.errors import OffloadError, one_line
from fleetgen.offload import DeviceSpec, OffloadPlan, PipelineProfile, Workload, plan, resident_plan
from fleetgen.offload.reasons import batch_cap
from fleetgen.offload.weight_formats import QuantizeSpec, spec

HOST_SHARE = 0.8  # of available host RAM a worker may fill with offloaded copies
# How CUDA libraries word an allocation failure they raise as a plain RuntimeError (cuBLAS and cuDNN
# workspaces, pinning host memory): the same step-down as `torch.OutOfMemoryError`.
OOM_WORDS = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",
)


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(w in str(err) for w in OOM_WORDS)
    )


def _dtype(module: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


@contextmanager
def components_dtypes_kept(pipe):
    """Every component keeps its dtype whatever happens in a pipeline call. SDXL's pipeline casts
    its float16 VAE to float32 for the decode and back only when the decode succeeds: after an OOM
    there, every later call would fail ("Input type (c10::Half) and bias type (float)") and the
    profile would read 4-byte weights."""
    modules = {n: m for n, m in getattr(pipe, "components", {}).items() if isinstance(m, torch.nn.Module)}
    before = {n: _dtype(m) for n, m in modules.items()}
    try:
        yield
    finally:
        for name, module in modules.items():
            if before[name] is not None and _dtype(module) != before[name]:
                module.to(dtype=before[name])


def at_load_formats(model_dir: str, dtype: torch.dtype, device: DeviceSpec, work: Workload, vae_upcast: bool):
    """Under `--quantize auto` on a worker that can apply formats as weights load (bitsandbytes on
    CUDA): the pipeline planned from its configs on the `meta` device, before any weight is read,
    with the loading peak counted — {component: format} of that plan's at-load formats, which the
    worker then loads with. Where nothing fits even so, none: the worker's own plan says why."""
    from fleetgen.offload import profile_modules
    from fleetgen.offload.architectures import build_on_meta, pipeline_settings

    modules, settings = build_on_meta(model_dir), pipeline_settings(model_dir)
    prof = profile_modules(model_dir, modules, dtype, vae_upcast, device.formats, settings)
    try:
        chosen = plan(prof, device, replace(work, quantize=QuantizeSpec(auto=True), loaded=False))
    except OffloadError:
        return {}
    return {c: f for c, f in chosen.formats.items() if spec(f).at_load}


def plan_before_loading(source, work: Workload, device: DeviceSpec, dtype: torch.dtype, vae_upcast: bool):
    """`auto` where formats can apply at load: plan from the model's configs before its weights
    are read, so a worker never loads bf16 it cannot hold (`at_load_formats`); `device` offers the
    formats this worker can apply at load. {component: format}; none where there are no configs."""
    configs = model_configs(source)
    if configs is None:
        return {}  # no configs to plan from: planned after loading, as before
    return at_load_formats(configs, dtype, device, work, vae_upcast)


def model_configs(source) -> str | None:
    """A directory with the model's configs (model_index.json, each component's config.json): a local
    model's own; a hub model's JSON files alone, fetched at the job's pinned revision into the node's
    hub cache (its weights follow once the plan says in which format to load them). None: no configs."""
    from pathlib import Path

    from fleetgen.workers.families.model_dir import is_hub_id

    if is_hub_id(source.model):
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(source.model, revision=source.revision, allow_patterns=["*.json"])
        except Exception as err:  # noqa: BLE001 - the download of the whole snapshot says what is wrong
            print(f"[fleetgen] configs of {source.model} not fetched ({one_line(err)}): planned after loading")
            return None
    path = Path(source.model).expanduser()
    return str(path) if (path / "model_index.json").exists() else None


STEP_DOWN = 0.75  # after an OOM at batch 1, re-plan for this fraction of the previous budget


def device_spec(
    device: torch.device, probe: dict, gpu_memory: int | None, host_memory: int | None, formats: tuple[str, ...] = ()
) -> DeviceSpec:
    """What this worker's plans fit: its budgets (given, else what the probe measured free; on a CPU
    the host's available RAM), bandwidth and FLOP/s. `formats`: the storage formats it can apply to
    its loaded pipeline (`--quantize auto`)."""
    cuda = device.type == "cuda"
    budget = gpu_memory or (probe["free_bytes"] if cuda else probe["host_available_bytes"])
    return DeviceSpec(
        budget=budget,
        host_budget=host_memory or int(probe["host_available_bytes"] * HOST_SHARE),
        bandwidth=probe["bandwidth"],
        flops=probe["flops"],
        streams=cuda,
        name=torch.cuda.get_device_name(device) if cuda else "cpu",
        formats=formats,
    )


def choose_plan(profile: PipelineProfile, work: Workload, device: DeviceSpec | None) -> OffloadPlan:
    """The plan for `work` (planned after loading: `work.fixed` holds the formats already applied)
    within `device`'s budgets. `device` None: a CPU worker with no `--gpu-memory` and `--offload
    auto|none`, where everything is resident at `--max-batch` (a `--quantize` mapping applied as
    given; `auto` has no budget to fit, so keeps the run dtype)."""
    if device is None:
        resident = resident_plan(
            list(profile.components),
            work.max_batch,
            f"all resident: CPU worker without `--gpu-memory`; batch {work.max_batch} ({batch_cap(work.cache)})",
        )
        return replace(resident, formats={**work.quantize.mapping, **dict(work.fixed)})
    return plan(profile, device, work)


def leaner_plan(
    profile: PipelineProfile,
    current: OffloadPlan,
    work: Workload,
    device: DeviceSpec,
    failed: tuple[str, ...] | None = None,
) -> OffloadPlan:
    """After an out-of-memory error at batch 1: plan for ever smaller budgets until the placement
    changes; `OffloadError` when even the leanest plan does not fit. A step that goes from the
    current placement straight to "nothing fits" (where activations, not weights, fill the budget)
    is bisected for the budgets between, where a leaner placement may still fit. `failed`: under a
    phased plan, the components of the phase that ran out, whose placements must change (leaning
    another phase frees nothing there)."""
    high, work = current.budget or device.budget, replace(work, max_batch=1)

    def at(budget: int) -> OffloadPlan:
        return plan(profile, replace(device, budget=budget), work)

    def changed(p: OffloadPlan) -> bool:
        if failed:
            return any(
                (p.placements[n], p.formats.get(n)) != (current.placements[n], current.formats.get(n)) for n in failed
            )
        # phased with the same placements is leaner too: one phase on the device at a time
        return (p.placements, p.formats, p.phases) != (current.placements, current.formats, current.phases)

    while True:
        budget = int(high * STEP_DOWN)
        try:
            leaner = at(budget)
        except OffloadError:
            low = budget  # nothing fits here; the current placement fits at `high`
            while high - low > max(1, high // 1000):
                middle = (low + high) // 2
                try:
                    leaner = at(middle)
                except OffloadError:
                    low = middle
                    continue
                if changed(leaner):
                    return leaner
                high = middle
            raise
        if changed(leaner):
            return leaner
        high = budget


def predicted_vs_measured(plan: OffloadPlan, seconds: float, images: int, offload: dict) -> dict:
    """What the plan predicted beside what the worker measured (`workers/<w>.json`): seconds per
    image in pipeline calls and the device's peak bytes."""
    return {
        "seconds_per_image": {
            "predicted": plan.seconds_per_image or None,
            "measured": seconds / images if images else None,
        },
        "peak_device_bytes": {"predicted": plan.peak_bytes or None, "measured": offload.get("peak_device_bytes")},
    }
