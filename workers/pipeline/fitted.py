"""A pipeline fitted to its device: load → plan → apply → warm up → call, and after an OOM a
smaller batch or a leaner plan re-applied (workers/pipeline/recovery.py). The job's settings say what it must run (their one
workload, `GenerationSettings.workload`), the worker's `Fit` within what; the worker
(workers/worker.py) asks it for pictures and never touches hooks, plans or memory itself."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch

from fleetgen.errors import FleetgenError, OffloadError
from fleetgen.offload import DeviceSpec, OffloadPlan, Workload, pipeline_modules, profile_pipeline
from fleetgen.offload.profile import live_bytes
from fleetgen.offload.quantize import held, load_config, quantize
from fleetgen.offload.weight_formats import describe, pinned_gguf, runnable, spec, unavailable
from fleetgen.workers.families.table import FAMILIES, GENERIC, Family
from fleetgen.workers.output.made import Made
from fleetgen.workers.pipeline import trials
from fleetgen.workers.pipeline.applied import Applied
from fleetgen.workers.pipeline.caching import cache_refusal
from fleetgen.workers.pipeline.calls import Calls, as_task, warm_up_input
from fleetgen.workers.pipeline.host_copy import HostCopy
from fleetgen.workers.pipeline.load import (
    activate_adapters,
    load_adapters,
    load_pipeline,
    pipe_size_multiple,
    resolve_device,
    resolve_dtype,
)
from fleetgen.workers.pipeline.phases import decode_all
from fleetgen.workers.pipeline.plans import choose_plan, components_dtypes_kept, device_spec, plan_before_loading
from fleetgen.workers.pipeline.probe import model_shapes, probe
from fleetgen.workers.pipeline.recovery import Recovering
from fleetgen.workers.pipeline.segment import segment_key
from fleetgen.workers.rows.batches import Adapter, Look, WorkItem
from fleetgen.workers.spec import Fit, GenerationSettings, Source


class FittedPipeline(Recovering):
    """A pipeline on its device, planned for the job's `settings` within this worker's `fit`:
    `generate(batch)` makes pictures and steps down (a smaller batch, then a leaner plan, kept) when
    the device runs out of memory."""

    def __init__(
        self,
        source: Source,
        settings: GenerationSettings,
        fit: Fit | None = None,
        tag: str = "worker",
        pipe=None,
        output=None,
    ):
        """`pipe`: a pipeline already built (bench/gpu_check.py's random weights at real sizes)
        instead of loading `source.model`; `close()` leaves it as it came (no offloading hooks).
        `output`: the job's output (workers/output/storage.py), where workers of one device kind share
        the plan their trials measured fastest (workers/pipeline/trials.py)."""
        self.source, self.settings, self.fit, self.tag = source, settings, fit or Fit(), tag
        self.workload = settings.workload(
            self.fit.max_batch, self.fit.offload, self.fit.plan_size, phases=self.fit.phases
        )
        self.family: Family = FAMILIES.get(settings.family, GENERIC)
        self.task = settings.task_spec()
        self.device = resolve_device(source.device)
        self.dtype = resolve_dtype(source.dtype, self.device, self.family.dtype)
        self._given = pipe is not None
        self.applied: Applied | None = None  # what the plan put on the pipeline (workers/pipeline/applied.py)
        self.step_downs: list[dict] = []
        self._pending: list[tuple] = []  # (phases, batch key, its Made records, to pictures): for `decode()`
        self.seconds = 0.0  # wall time in pipeline calls
        self.warm_seconds: float | None = None  # the warm-up's seconds for its one image (CUDA, compiled)
        self.choice: dict = {"chosen_by": "model"}  # how the plan was chosen (workers/pipeline/trials.py)
        at_load = self._formats_at_load()
        # one host copy per node (workers/pipeline/host_copy.py); a pipeline given is its caller's own
        self.host_copy = HostCopy("worker" if pipe is not None else self.fit.host_copy, self._copy_key(at_load), tag)
        self.pipe = (
            pipe if pipe is not None else self.host_copy.load(lambda given: self._load(at_load, given), set(at_load))
        )
        try:
            self._start(at_load, output)
        except BaseException:
            self.host_copy.close()  # the node's copy let go by a worker that cannot start
            raise
        self.batch_size = self.plan.batch_size if self.task.batched else 1  # one row per call: its references

    def _start(self, at_load: dict[str, str], output) -> None:
        """The loaded pipeline prepared, profiled, probed and planned; the plan applied, and chosen by
        trials where they run."""
        settings, source = self.settings, self.source
        self._prepare(at_load)
        self.calls = Calls(self.pipe, self.family, self.task, settings.true_cfg_scale)
        self.profile = profile_pipeline(
            self.pipe, source.model, vae_upcast=self.family.upcasts_vae, formats=self._formats
        ).holding(self.quantized)
        w = self.workload
        self.probe = probe(self.device, self.dtype, model_shapes(self.profile, w.width, w.height, w.frames))
        self._denoisers = {n: m for n, m in pipeline_modules(self.pipe).items() if self.profile.components[n].per_step}
        self._check_cache()
        self.plan = choose_plan(self.profile, self.loaded_workload(), self.budget())
        self._quantize(self.plan.formats)
        self.applied = Applied(
            self.pipe, self.profile, settings, self.fit, self._denoisers, len(self.adapters), self.tag, self._given
        )
        self.applied.to_host = self.host_copy.to_host
        try:
            self._apply()
            self.choice = trials.choose(self, trials.Shared(output, trials.kind_of(self)) if output else None)
        except BaseException:
            # A pipeline that cannot start leaves a pipeline it was given as it came (no hooks, on the CPU):
            # the next plan applied to it must not find this one's hooks.
            self.applied.off()
            raise
        self.host_copy.settle(self.plan, self.device)

    def _formats_at_load(self) -> dict[str, str]:
        """The storage formats applied as the weights load: the job's, or under `auto` those planned
        from the model's configs before loading. A format this worker cannot run fails here, in one
        line, before anything loads."""
        quantize, cuda = self.settings.quantize, self.device.type == "cuda"
        for name in sorted(set(quantize.mapping.values())):
            why = unavailable(name, cuda)
            if why:
                raise OffloadError(f"{self.tag}: `--quantize` {describe(quantize.mapping)}: {why}.")
        at_load = {c: f for c, f in quantize.mapping.items() if spec(f).at_load}
        if at_load and self._given:
            raise OffloadError(f"{self.tag}: {describe(at_load)} applies at load; a given pipeline is loaded already.")
        if quantize.auto and not self._given and runnable(cuda, at_load=True) != runnable(cuda):
            device = device_spec(
                self.device,
                probe(self.device, self.dtype),
                self.fit.gpu_memory,
                self.fit.host_memory,
                runnable(cuda, at_load=True),
            )
            at_load = plan_before_loading(self.source, self.workload, device, self.dtype, self.family.upcasts_vae)
        for value in (f for f in at_load.values() if spec(f).name == "gguf"):
            try:  # the bytes the job was fingerprinted with, on this node too
                pinned_gguf(value)
            except FleetgenError as err:
                raise OffloadError(f"{self.tag}: {err}") from None
        return at_load

    def _copy_key(self, at_load: dict[str, str]) -> str:
        """The node segment of these weights: the model, as loaded (dtype, formats at load)."""
        s = self.source
        return segment_key(
            dict(
                model=s.model,
                revision=s.revision,
                variant=s.variant,
                dtype=str(self.dtype),
                at_load=sorted(at_load.items()),
                trust_remote_code=s.trust_remote_code,
            )
        )

    def _load(self, at_load: dict[str, str], given: dict | None = None):
        """The pipeline from its source; `given`: components already made (from the node's segment)."""
        s = self.source
        gguf = {c: f for c, f in at_load.items() if spec(f).name == "gguf"}
        return load_pipeline(
            s.model,
            self.dtype,
            s.trust_remote_code,
            revision=s.revision,
            variant=s.variant,
            worker=self.tag,
            quantization_config=load_config(at_load, self.dtype),
            gguf=gguf,
            components=given,
        )

    def _prepare(self, at_load: dict[str, str]) -> None:
        """The loaded pipeline as the job's task, its formats as held, its adapters loaded (before
        profiling and offloading: their bytes are planned for and offloaded with their layers), and
        the formats the plan may still choose."""
        self.pipe = as_task(self.pipe, self.task, self.tag)
        self.pipe.set_progress_bar_config(disable=True)
        if self.task.video and hasattr(getattr(self.pipe, "vae", None), "enable_slicing"):
            self.pipe.vae.enable_slicing()  # one clip's decode at a time, on every worker (the planner counts so)
        # {component: format} as applied: at load, or already held by a pipeline given quantized
        self.quantized: dict[str, str] = {**held(pipeline_modules(self.pipe)), **at_load}
        self.adapters = load_adapters(self.pipe, self.source.adapters, self.tag)
        self._active: tuple[Adapter, ...] | None = None
        self.size_multiple = pipe_size_multiple(self.pipe, self.family.size_floor)
        # After-load formats are applied once planned, so that the plan chooses them: the profile
        # counts the pipeline in each of them.
        quantize, cuda = self.settings.quantize, self.device.type == "cuda"
        self._formats = (
            runnable(cuda) if quantize.auto else tuple(set(quantize.mapping.values()) - set(at_load.values()))
        )

    def _check_cache(self) -> None:
        cache = self.settings.cache
        for module in self._denoisers.values() if cache.method != "none" else ():
            why = cache_refusal(type(self.pipe), type(module), self.workload.cfg_calls, cache.method)
            if why:
                raise OffloadError(f"{self.tag}: `--cache {cache.label}`: {why}.")

    def loaded_workload(self) -> Workload:
        """The job's workload as this worker plans it: after loading, with the formats its live
        modules hold (no plan can take those back)."""
        return replace(self.workload, loaded=True, fixed=tuple(sorted(self.quantized.items())))

    def budget(self) -> DeviceSpec | None:
        """The budgets a plan fits; None for a CPU worker with no `--gpu-memory` under `--offload
        auto|none` (all resident, workers/pipeline/plans.py `choose_plan`)."""
        if self.device.type == "cpu" and self.fit.gpu_memory is None and self.fit.offload in ("auto", "none"):
            return None
        return self.planned_device()

    def planned_device(self) -> DeviceSpec:
        """The device as the plans see it, with what the job's scorers hold on it (`--score`: beside a
        per-batch plan; a phase of their own after a phased plan's decode phase)."""
        found = device_spec(self.device, self.probe, self.fit.gpu_memory, self.fit.host_memory, self._formats)
        found = replace(found, beside=self.settings.score.reserved_bytes(self.profile.dtype_bytes))
        shared = self.host_copy.shared
        if not shared:
            return found
        # the node's copy: counted once per node; a budget that is a share of the node's RAM pays that share of it
        # (a budget the probe read, MemAvailable, has it off already)
        paid = int(self.fit.node_share * sum(self.host_copy.segment.bytes_of(n) for n in shared))
        return replace(found, shared=frozenset(shared), host_budget=max(found.host_budget - paid, 0))

    def _apply(self) -> None:
        """Offloading, the step cache, the attention kernel and compilation, in that order
        (workers/pipeline/applied.py); then the warm-up, where kernels, graphs, the allocator and
        prefetch order settle."""
        w = self.workload
        self.host_copy.pin(self.plan)
        self.applied.on(self.plan, self.device, self.dtype, self.profile.image_tokens(w.width, w.height, w.frames))
        if self.device.type == "cuda" or self.compiled:
            # compiled: batch 1 and any larger batch are a graph each (workers/pipeline/compiling.py), both made here
            for images in (1, 2) if self.compiled and self.plan.batch_size > 1 and self.task.batched else (1,):
                self._warm_up(self._look(1), images)

    # What is on the pipeline now (workers/pipeline/applied.py).
    placed = property(lambda self: self.applied.placed)
    offload_stats = property(lambda self: self.applied.offload_stats)
    phases = property(lambda self: self.applied.phases)
    cache = property(lambda self: self.applied.cache)
    compiled = property(lambda self: self.applied.compiled)
    attention = property(lambda self: self.applied.attention)

    @property
    def chunk_images(self) -> int:
        """Images the worker hands `encode` at a time: a phased plan's chunk, else one batch."""
        return self.plan.chunk if self.phases is not None else self.batch_size

    def encode(self, batches: list[tuple[list[WorkItem], dict]]) -> None:
        """Phase 1 of a phased plan for a chunk of batches (one look; each with its loaded inputs, as
        `generate` takes them): their prompts (and an image encoder's images) encoded, the encoders
        alone on the device; nothing per batch."""
        if self.phases is None or not batches:
            return
        self._activate(batches[0][0][0].look)
        calls = {_key(b): self.calls.of(b, inputs) for b, inputs in batches}
        self.phases.encode(list(calls), lambda key: self._capture(key, calls[key]))

    def _capture(self, key: tuple, call) -> None:
        with components_dtypes_kept(self.pipe), self.phases.capturing(key):
            self.pipe(**call())

    def _run(self, key: tuple, call):
        """One pipeline call (`call()`: its arguments): whole per batch; phased, answered from phase 1,
        and with a decode phase, its decode recorded for phase 3 (the call's pictures are placeholders)."""
        if self.phases is None:
            return self.pipe(**call())
        deferred = self.phases.deferring(key) if self.phases.decode_apart else contextlib.nullcontext()
        with self.phases.replaying(key, lambda k: self._capture(k, call)), deferred:
            return self.pipe(**call())

    @property
    def deferred(self) -> bool:
        """Whether pictures come from `decode()` (a phased plan's decode phase), not from `generate`."""
        return self.phases is not None and self.phases.decode_apart

    def decode(self) -> dict[str, str]:
        """Phase 3: every batch `generate` deferred, decoded with the VAE alone on the device, its
        pictures set on its `Made` records (workers/pipeline/phases.py `decode_all`); {image id: error}
        for those whose decode failed."""
        if not self._pending:
            return {}
        if self.phases is not None:
            self.phases.enter(len(self.phases.resident) - 1)
        started = time.perf_counter()
        failed = decode_all(self._pending, self.device)
        seconds = time.perf_counter() - started
        self.seconds += seconds
        made = [m for *_, ms, _ in self._pending for m in ms]
        for m in made:
            m.seconds += seconds / len(made)
        self._pending = []
        return failed

    def leave_phases(self) -> None:
        """A phased plan's components all off the device (after a chunk's decode phase): the scorers' turn."""
        if self.phases is not None:
            self.phases.enter(None)

    def _quantize(self, formats: dict[str, str]) -> None:
        """Apply the plan's after-load formats not applied yet (a step-down under `auto` may add one)."""
        new = {c: f for c, f in formats.items() if c not in self.quantized}
        modules = pipeline_modules(self.pipe)
        self.quantized.update(quantize(modules, new, self.dtype))
        # what the live modules hold, as measured (workers/<w>.json): the plan's counts were predicted
        self.weight_bytes = {n: live_bytes(m, self.profile.dtype_bytes) for n, m in modules.items()}

    def settled(self) -> None:
        """What a warm-up (or a plan trial) did is no shard's: its cache skips, encodes, transfers and peak."""
        if self.cache is not None:
            self.cache.take()  # the warm-up's skips are no image's
        if self.phases is not None:
            self.phases.reset()  # nor its encodes
        self.offload_stats.reset()  # nor its transfers (the stats' bytes ÷ the shards' seconds)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def switch(self, new_plan: OffloadPlan, warm: bool = True) -> None:
        """Run `new_plan` from now on (a plan measured faster, or another worker's of this kind): applied,
        then warmed up (its transfers and peak not counted as the shards')."""
        self._reapply(new_plan)
        self.plan = new_plan
        self.batch_size = new_plan.batch_size if self.task.batched else 1
        if warm:
            self._warm_up(self._look(1))

    def _look(self, steps: int) -> Look:
        """The job's shapes (the planned size, its frames) at `steps` denoising steps: a warm-up's or a trial's."""
        w = self.workload
        frames = (("num_frames", w.frames),) if w.frames else ()
        return Look(w.width, w.height, steps, self.settings.guidance, extra=frames)

    def _blank_call(self, label: str, images: int, look: Look) -> dict:
        """A call's arguments for `images` placeholder prompts (and blank input images), nothing seeded."""
        blank = [[warm_up_input(r, look.width, look.height) for r in self.calls.roles()]] * images
        return self.calls.kwargs([label] * images, [None] * images, look, generator=None, inputs=blank)

    def timed_call(self, images: int, steps: int) -> float:
        """Seconds of one pipeline call of `images` at the job's shapes and `steps` denoising steps, with
        the current plan; nothing kept (a plan trial's: workers/pipeline/trials.py)."""
        kwargs = self._blank_call("plan trial", images, self._look(steps))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        with components_dtypes_kept(self.pipe), torch.no_grad():
            self.pipe(**kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def _reapply(self, new_plan: OffloadPlan) -> None:
        """Another plan: compilation, cache and offload hooks off, the weights in the new plan's formats,
        then offload → cache → compile back on (workers/pipeline/applied.py)."""
        self.applied.off(offload=False)
        self.applied.unplace()
        self.host_copy.rebind(self.pipe)  # the weights the removal brought back as copies: the node's again
        self._quantize(new_plan.formats)  # a format `auto` adds to lean further
        self.host_copy.pin(new_plan)
        self.applied.again(new_plan, self.device, self.dtype)

    def _call(self, batch: list[WorkItem], inputs: dict | None = None) -> list[Made]:
        """`inputs`: {image id: its loaded inputs} (workers/rows/inputs.py), for tasks that take images."""
        look = batch[0].look
        started = time.perf_counter()
        self._activate(look)
        with components_dtypes_kept(self.pipe), self._cache_context():
            out = self._run(_key(batch), self.calls.of(batch, inputs))
        if self.deferred:  # pictures from `decode()`, the chunk's phase 3
            pictures, flags = [None] * len(batch), [None] * len(batch)
        else:
            pictures = self.calls.pictures(out, look)
            # A safety checker (SD 1.x) blacks out what it flags: such pictures are None.
            flags = getattr(out, "nsfw_content_detected", None) or [None] * len(batch)
        seconds = time.perf_counter() - started
        self.seconds += seconds
        quantized = describe(self.quantized)
        skipped = self.cache.take() if self.cache is not None else None
        made = [
            Made(
                im.id,
                im.row,
                None if flagged else picture,
                flagged,
                len(batch),
                seconds / len(batch),
                quantized,
                skipped,
            )
            for im, picture, flagged in zip(batch, pictures, flags, strict=True)
        ]
        if self.deferred:
            self._pending.append((self.phases, _key(batch), made, lambda out: self.calls.pictures(out, look)))
        return made

    def _activate(self, look: Look) -> None:
        if look.adapters != self._active:  # between batches only: a batch shares its look
            activate_adapters(self.pipe, self.adapters, look.adapters)
            self._active = look.adapters

    def _cache_context(self):
        return self.cache.context() if self.cache is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.applied is not None:
            self.applied.off()
        self.pipe = None
        self.host_copy.close()


def _key(batch: list[WorkItem]) -> tuple[str, ...]:
    return tuple(im.id for im in batch)
