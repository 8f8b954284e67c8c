"""A pipeline fitted to its device: load → plan → apply → warm up → call, and after an OOM a
smaller batch or a leaner plan re-applied. One `Workload` says what it must run; the worker
(workers/worker.py) asks it for pictures and never touches hooks, plans or memory itself."""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass

import torch

from fleetgen.caches import parse_cache
from fleetgen.errors import FleetgenError, OffloadError, one_line
from fleetgen.offload import OffloadPlan, OffloadStats, apply, pipeline_modules, profile_pipeline
from fleetgen.offload.apply import unapply
from fleetgen.offload.profile import live_bytes
from fleetgen.offload.quantize import held, load_config, quantize
from fleetgen.offload.weight_formats import describe, is_auto, parse_quantize, pinned_gguf, runnable, spec, unavailable
from fleetgen.workers.families.detect import FAMILIES, GENERIC, Family, Task
from fleetgen.workers.output.fields import extra_settings
from fleetgen.workers.output.video import clips_of
from fleetgen.workers.pipeline.attention import choose_attention, reset_attention, set_attention
from fleetgen.workers.pipeline.caching import AppliedCache, cache_refusal, names_contexts
from fleetgen.workers.pipeline.calls import as_task, call_kwargs, prepare_call, task_kwargs, warm_up_input
from fleetgen.workers.pipeline.compiling import AppliedCompile, is_compile_error
from fleetgen.workers.pipeline.load import (
    activate_adapters,
    load_adapters,
    load_pipeline,
    pipe_size_multiple,
    resolve_device,
    resolve_dtype,
)
from fleetgen.workers.pipeline.plans import (
    choose_plan,
    components_dtypes_kept,
    is_out_of_memory,
    leaner_plan,
    plan_before_loading,
)
from fleetgen.workers.pipeline.probe import probe
from fleetgen.workers.rows.batches import Adapter, Image, Look
from fleetgen.workers.rows.seeds import generators
from fleetgen.workers.spec import Source, Workload


@dataclass
class Picture:
    """One image out of a pipeline call."""

    image: Image  # what was asked
    picture: object | None  # the decoded image (a video task's: a Clip); None when the safety checker flagged it
    nsfw: bool | None  # the safety checker's flag; None where the pipeline has none
    batch: int  # images in the call that made it
    seconds: float  # its share of the call's wall time
    quantized: str = "none"  # the storage formats its components had (offload/quantize.py `describe`)
    cache_skipped: float | None = None  # share of the denoiser's block evaluations its call's step cache skipped


class FittedPipeline:
    """A pipeline on its device, planned for `workload`: `generate(batch)` makes pictures and steps
    down (a smaller batch, then a leaner plan, kept) when the device runs out of memory."""

    def __init__(self, source: Source, workload: Workload, tag: str = "worker", pipe=None):
        """`pipe`: a pipeline already built (bench/gpu_check.py's random weights at real sizes)
        instead of loading `source.model`; `close()` leaves it as it came (no offloading hooks)."""
        self.source, self.workload, self.tag = source, workload, tag
        self._call_args = {f.name: f.call_arg for f in extra_settings()}  # per-row settings the look carries
        self.family: Family = FAMILIES.get(source.family, GENERIC)
        self.device = resolve_device(source.device)
        self.dtype = resolve_dtype(source.dtype, self.device, self.family.dtype)
        self._given = pipe is not None
        mapping = parse_quantize(source.quantize)
        cuda = self.device.type == "cuda"
        for name in sorted(set(mapping.values())):  # a format this worker cannot run: one line, before loading
            why = unavailable(name, cuda)
            if why:
                raise OffloadError(f"{tag}: `--quantize` {describe(mapping)}: {why}.")
        at_load = {c: f for c, f in mapping.items() if spec(f).at_load}
        if at_load and pipe is not None:
            raise OffloadError(f"{tag}: {describe(at_load)} applies at load; a given pipeline is loaded already.")
        if is_auto(source.quantize) and pipe is None and runnable(cuda, at_load=True) != runnable(cuda):
            at_load = plan_before_loading(source, workload, self.family, self.device, self.dtype)
        gguf = {c: f for c, f in at_load.items() if spec(f).name == "gguf"}
        for value in gguf.values():  # the bytes the job was fingerprinted with, on this node too
            try:
                pinned_gguf(value)
            except FleetgenError as err:
                raise OffloadError(f"{tag}: {err}") from None
        self.pipe = (
            pipe
            if pipe is not None
            else load_pipeline(
                source.model,
                self.dtype,
                source.trust_remote_code,
                revision=source.revision,
                variant=source.variant,
                worker=tag,
                quantization_config=load_config(at_load, self.dtype),
                gguf=gguf,
            )
        )
        self.task = self.family.task(source.task) or Task(source.task, "")
        self.pipe = as_task(self.pipe, self.task, tag)
        self.pipe.set_progress_bar_config(disable=True)
        if self.task.video and hasattr(getattr(self.pipe, "vae", None), "enable_slicing"):
            self.pipe.vae.enable_slicing()  # one clip's decode at a time, on every worker (the planner counts so)
        # {component: format} as applied: at load, or already held by a pipeline given quantized
        self.quantized: dict[str, str] = {**held(pipeline_modules(self.pipe)), **at_load}
        # Adapters before profiling and offloading: their bytes are planned for and offloaded with their layers.
        self.adapters = load_adapters(self.pipe, source.adapters, tag)
        self._active: tuple[Adapter, ...] | None = None
        self.size_multiple = pipe_size_multiple(self.pipe, self.family.size_floor)
        # The pipeline as loaded, counted in every storage format it may be given (after-load formats
        # are applied once planned, so that the plan chooses them): the planner's profile.
        self._formats = (
            runnable(cuda) if is_auto(source.quantize) else tuple(set(mapping.values()) - set(at_load.values()))
        )
        self.profile = profile_pipeline(
            self.pipe, source.model, vae_upcast=self.family.upcasts_vae, formats=self._formats
        ).holding(self.quantized)
        self.probe = probe(self.device, self.dtype)
        w = workload
        self._fit = {
            "offload": w.offload,
            "width": w.width,
            "height": w.height,
            "steps": w.steps,
            "cfg": self.family.doubles_batch(w.guidance, w.true_cfg_scale),
            "host_memory": w.host_memory,
            "quantize": source.quantize,
            "formats": self._formats,
            "input_images": w.input_images,
            "in_sequence": w.in_sequence,
            "frames": w.num_frames,
            "cfg_calls": self.family.extra_calls(w.guidance, w.true_cfg_scale),
            "cache": w.cache,
        }
        self.cache_spec = parse_cache(w.cache)
        self._denoisers = {n: m for n, m in pipeline_modules(self.pipe).items() if self.profile.components[n].per_step}
        for module in self._denoisers.values() if self.cache_spec.method != "none" else ():
            why = cache_refusal(type(self.pipe), type(module), self._fit["cfg_calls"], self.cache_spec.method)
            if why:
                raise OffloadError(f"{tag}: `--cache {self.cache_spec.label}`: {why}.")
        self.plan = choose_plan(
            self.profile,
            self.device,
            self.probe,
            max_batch=1 if self.cache_spec.per_call else w.max_batch,
            gpu_memory=w.gpu_memory,
            fixed=self.quantized,
            **self._fit,
        )
        self._quantize(self.plan.formats)
        self.placed = self.cache = self.compiled = self.attention = self.offload_stats = None
        self.step_downs: list[dict] = []
        self.seconds = 0.0  # wall time in pipeline calls
        try:
            self.placed = apply(self.pipe, self.plan, self.profile, self.device, tag=tag)
            self.offload_stats = OffloadStats(pipeline_modules(self.pipe), self.device)
            self._apply_cache()
            tokens = self.profile.image_tokens(w.width, w.height, w.num_frames)  # `auto` measures kernels at them
            self.attention = choose_attention(w.attention, self._denoisers, self.device, self.dtype, tokens)
            set_attention(self._denoisers, self.attention.backend)
            self._apply_compile()
            if self.device.type == "cuda" or self.compiled:  # kernels, graphs, allocator and prefetch order settle
                frames = (("num_frames", w.num_frames),) if w.num_frames else ()
                # compiled: batch 1 and any larger batch are a graph each (workers/pipeline/compiling.py), both made here
                for images in (1, 2) if self.compiled and self.plan.batch_size > 1 and self.task.batched else (1,):
                    self._warm_up(Look(w.width, w.height, 1, w.guidance, extra=frames), images)
        except BaseException:
            # A pipeline that cannot start leaves a pipeline it was given as it came (no hooks, on the CPU):
            # the next plan applied to it must not find this one's hooks.
            self._take_off()
            raise
        self.batch_size = self.plan.batch_size if self.task.batched else 1  # one row per call: its references

    def _quantize(self, formats: dict[str, str]) -> None:
        """Apply the plan's after-load formats not applied yet (a step-down under `auto` may add one)."""
        new = {c: f for c, f in formats.items() if c not in self.quantized}
        modules = pipeline_modules(self.pipe)
        self.quantized.update(quantize(modules, new, self.dtype))
        # what the live modules hold, as measured (workers/<w>.json): the plan's counts were predicted
        self.weight_bytes = {n: live_bytes(m, self.profile.dtype_bytes) for n, m in modules.items()}

    def generate(self, batch: list[Image], inputs: dict | None = None) -> tuple[list[Picture], dict[str, str]]:
        """Run one pipeline call; if it raises, run its images one at a time so that one bad row
        costs only itself. Returns what was made and `{image id: error message}`.

        Recovery runs after the `try` statement, never inside the `except`: an exception's traceback
        holds the frames of the failed call and every tensor they made, so inside the handler
        `empty_cache()` frees nothing and the retry would start with the failed attempt's memory
        still allocated (PyTorch FAQ, "My out of memory exception handler can't allocate memory")."""
        oom = failure = None
        compile_failed = False
        try:
            return self._call(batch, inputs), {}
        except Exception as err:  # noqa: BLE001 - any pipeline failure is retried row by row
            if is_out_of_memory(err):
                oom = one_line(err)
            else:
                failure = f"{type(err).__name__}: {err}"
            compile_failed = self._compiling() and is_compile_error(err)
        if compile_failed:  # said in workers/<w>.json; the batch runs again, uncompiled
            self.compiled.disable(failure[:300])
            return self.generate(batch, inputs)
        if oom is not None:
            if not self._step_down(len(batch), oom):
                return [], {r.id: f"OutOfMemoryError at batch 1 with the leanest plan: {oom}" for r in batch}
            parts = [batch[j : j + self.batch_size] for j in range(0, len(batch), self.batch_size)]
        elif len(batch) == 1:
            return [], {batch[0].id: failure}
        else:
            parts = [[im] for im in batch]
        made, failed = [], {}
        for part in parts:
            m, f = self.generate(part, inputs)
            made += m
            failed.update(f)
        return made, failed

    def _warm_up(self, look: Look, images: int = 1) -> None:
        """`images` through the pipeline, so that kernels, graphs, the allocator and the streams'
        prefetch order settle before anything is timed. An OOM here steps the plan down, as in a shard."""
        while True:
            oom = None
            try:
                blank = [[warm_up_input(r, look.width, look.height) for r in self._roles()]] * images
                with components_dtypes_kept(self.pipe), self._cache_context():
                    self.pipe(**self._kwargs(["warm up"] * images, [None] * images, look, generator=None, inputs=blank))
                if self.cache is not None:
                    self.cache.take()  # the warm-up's skips are no image's
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                return
            except Exception as err:  # noqa: BLE001 - an OOM and a failed compile are handled; the rest is raised
                if self._compiling() and is_compile_error(err):
                    self.compiled.disable(f"{type(err).__name__}: {err}"[:300])  # said, then warmed up again uncompiled
                    continue
                if not is_out_of_memory(err):
                    raise
                oom = one_line(err)
            # outside the `except`: the failed call's frames, and the memory they hold, are gone
            if images > 1:
                return  # the batch's graph is made by the shard's first batch, whose OOM steps the batch down
            if not self._step_down(1, oom):
                raise OffloadError(f"{self.tag}: out of memory warming up with the leanest plan: {oom}")

    def _step_down(self, size: int, err: str) -> bool:
        """After an out-of-memory error (`err`, its message): a smaller batch, else a leaner plan;
        kept from then on. False when there is nothing leaner."""
        gc.collect()  # hook registries and pipeline outputs form reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if size > 1:
            before, self.batch_size = self.batch_size, max(1, min(self.batch_size, size) // 2)
            self.step_downs.append(
                {
                    "from": f"batch {before}",
                    "to": f"batch {self.batch_size}",
                    "reason": f"out of memory at batch {size}",
                }
            )
            return True
        try:
            leaner = leaner_plan(self.profile, self.plan, self.device, self.probe, fixed=self.quantized, **self._fit)
        except FleetgenError:
            return False
        self._reapply(leaner)
        self.step_downs.append(
            {
                "from": self.plan.to_dict()["modes"],
                "to": leaner.to_dict()["modes"],
                "reason": f"out of memory at batch 1: {err[:200]}",
            }
        )
        self.plan = leaner
        return True

    def _apply_cache(self, carried: AppliedCache | None = None) -> None:
        """The job's step cache, after offloading (workers/pipeline/caching.py: so that skipped blocks stay
        where they are); `carried`: the one it replaces, whose counts run on."""
        if self.cache_spec.method != "none":
            own = not names_contexts(type(self.pipe))
            self.cache = AppliedCache(self.cache_spec, self._denoisers, self.dtype, own, carried, self.workload.steps)

    def _apply_compile(self, carried: AppliedCompile | None = None) -> None:
        """`--compile`, last (workers/pipeline/compiling.py): the compiled regions call through the offload and
        cache hooks; `carried`: the compilation it replaces after a re-apply, whose counts run on."""
        if self.workload.compile and (carried is None or carried.disabled is None):
            self.compiled = AppliedCompile(self._denoisers, carried, adapters=len(self.adapters))

    def _compiling(self) -> bool:
        return self.compiled is not None and self.compiled.disabled is None

    def _reapply(self, new_plan: OffloadPlan) -> None:
        """Another plan: compilation, cache and offload hooks off, then offload → cache → compile back
        on, in that order."""
        cached, compiled = self.cache, self.compiled
        self._take_off(offload=False)
        unapply(self.pipe, self.placed)  # every hook, the stream ones included
        self._quantize(new_plan.formats)  # a format `auto` adds to lean further
        self.placed = apply(self.pipe, new_plan, self.profile, self.device, tag=self.tag)
        self.offload_stats = OffloadStats(pipeline_modules(self.pipe), self.device)
        self._apply_cache(cached)
        self._apply_compile(compiled)

    def _take_off(self, offload: bool = True) -> None:
        """Compilation, the cache and the offload counters off; with `offload`, the attention kernel
        and offloading too (a pipeline given is left as it came: no hooks, on the CPU)."""
        if self.compiled is not None:
            self.compiled.close()
        if self.cache is not None:
            self.cache.close()
        if self.offload_stats is not None:
            self.offload_stats.close()
        if not offload:
            return
        if self.attention is not None:
            reset_attention(self._denoisers, self.attention.backend)
        if self._given:
            unapply(self.pipe, self.placed)
        elif self.placed is not None:
            self.placed.close()

    def _roles(self) -> list[str]:
        return (["image"] if self.task.takes_images else []) + (["mask"] if self.task.mask else [])

    def _kwargs(self, prompts: list[str], negatives: list[str | None], look: Look, generator, inputs=None) -> dict:
        """`inputs`: per image, its input pictures (the mask last), as workers/rows/inputs.py loaded them."""
        extra = {self._call_args[name]: value for name, value in look.extra if self._call_args.get(name)}
        extra.update(task_kwargs(self.task, look.width, look.height, inputs))
        prepare_call(self.pipe, self.family, guidance=look.guidance, width=look.width, height=look.height)
        return call_kwargs(
            self.pipe,
            self.family,
            prompts,
            negatives,
            steps=look.steps,
            guidance=look.guidance,
            width=look.width,
            height=look.height,
            true_cfg_scale=self.workload.true_cfg_scale,
            generator=generator,
            extra=extra,
        )

    def _call(self, batch: list[Image], inputs: dict | None = None) -> list[Picture]:
        """`inputs`: {image id: its loaded inputs} (workers/rows/inputs.py), for tasks that take images."""
        look = batch[0].look
        started = time.perf_counter()
        if look.adapters != self._active:  # between batches only: a batch shares its look
            activate_adapters(self.pipe, self.adapters, look.adapters)
            self._active = look.adapters
        with components_dtypes_kept(self.pipe), self._cache_context():
            out = self.pipe(
                **self._kwargs(
                    [im.prompt for im in batch],
                    [im.negative_prompt for im in batch],
                    look,
                    generators([im.seed for im in batch]),
                    [[(x.picture, x.ref.role) for x in (inputs or {}).get(im.id, ())] for im in batch],
                )
            )
        extra = dict(look.extra)
        pictures = self._clips(out, extra) if self.task.video else out.images
        made = {getattr(p, "size", None) for p in pictures}
        if made != {(look.width, look.height)}:  # a pipeline that rescales: its records would say otherwise
            sizes = ", ".join(sorted(f"{w}x{h}" for w, h in made if w) or ["no images"])
            raise FleetgenError(f"{type(self.pipe).__name__} made {sizes} where {look.width}x{look.height} was asked")
        # A safety checker (SD 1.x) blacks out what it flags: such pictures are None.
        flags = getattr(out, "nsfw_content_detected", None) or [None] * len(batch)
        seconds = time.perf_counter() - started
        self.seconds += seconds
        quantized = describe(self.quantized)
        skipped = self.cache.take() if self.cache is not None else None
        return [
            Picture(im, None if flagged else picture, flagged, len(batch), seconds / len(batch), quantized, skipped)
            for im, picture, flagged in zip(batch, pictures, flags, strict=True)
        ]

    def _clips(self, out, extra: dict) -> list:
        """A video pipeline's output as clips (LTX-2's with their sound, at its vocoder's rate)."""
        audio = out.audio if self.family.audio else None
        rate = self.pipe.vocoder.config.output_sampling_rate if self.family.audio else 0
        fps = extra.get("fps") or self.family.fps
        return clips_of(out.frames, extra.get("num_frames"), fps, type(self.pipe).__name__, audio, rate)

    def _cache_context(self):
        return self.cache.context() if self.cache is not None else contextlib.nullcontext()

    def close(self) -> None:
        self._take_off()
        self.pipe = None
