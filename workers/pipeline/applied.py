"""What a plan puts on a pipeline besides its weights' formats, in the order it goes on: offloading (its
hooks, the transfers counted, a phased plan's phases), the step cache, the attention kernel,
compilation. Taken off in reverse. After an OOM step-down the next plan's go on where the last ones
were, their counts carried on (the worker reports its whole run, workers/<w>.json).

Why that order: a cache's skipped blocks stay where offloading put them (workers/pipeline/caching.py),
and the compiled regions call through the offload and cache hooks (workers/pipeline/compiling.py)."""

from __future__ import annotations

import torch

from fleetgen.offload import OffloadPlan, OffloadStats, PipelineProfile, apply, pipeline_modules
from fleetgen.offload.hooks import unapply
from fleetgen.workers.pipeline.attention import AttentionChoice, choose_attention, reset_attention, set_attention
from fleetgen.workers.pipeline.caching import AppliedCache, names_contexts
from fleetgen.workers.pipeline.compiling import AppliedCompile
from fleetgen.workers.pipeline.phases import Phases
from fleetgen.workers.spec import Fit, GenerationSettings


class Applied:
    """The hooks on one pipeline and their counts. `on(plan, tokens)` once; after a step-down, `off(offload=False)`,
    the old placements removed with their weights re-formatted (the fitted pipeline's part), then `again(plan)`;
    `off()` at the end. `given`: the pipeline came built (bench/gpu_check.py) and is left as it came."""

    def __init__(
        self,
        pipe,
        profile: PipelineProfile,
        settings: GenerationSettings,
        fit: Fit,
        denoisers: dict[str, torch.nn.Module],
        adapters: int,
        tag: str,
        given: bool,
    ):
        self.pipe, self.profile, self.settings, self.fit = pipe, profile, settings, fit
        self.denoisers, self.adapters, self.tag, self.given = denoisers, adapters, tag, given
        self.placed = self.offload_stats = self.phases = self.cache = self.compiled = None
        self.attention: AttentionChoice | None = None
        self.to_host = (
            None  # how a phase's component leaves the device (the node's copy: workers/pipeline/host_copy.py)
        )

    def on(self, plan: OffloadPlan, device: torch.device, dtype: torch.dtype, tokens: int) -> None:
        """Offloading, the step cache, the attention kernel (`auto` measures the kernels at `tokens`, an
        image's) and compilation, in that order."""
        self.place(plan, device)
        self._cache(None, dtype)
        self.attention = choose_attention(self.settings.attention.backend, self.denoisers, device, dtype, tokens)
        set_attention(self.denoisers, self.attention.backend)
        self._compile(None)

    def again(self, plan: OffloadPlan, device: torch.device, dtype: torch.dtype) -> None:
        """Another plan's placements, after `off(offload=False)` and the old ones' removal: offload → cache →
        compile back on, each carrying the counts of the one it replaces (the kernel stays)."""
        cached, compiled = self.cache, self.compiled
        self.place(plan, device)
        self._cache(cached, dtype)
        self._compile(compiled)

    def place(self, plan: OffloadPlan, device: torch.device) -> None:
        """The plan's placements applied, its transfers counted; a phased plan's phases set up, with
        what the phases it replaces encoded (workers/pipeline/phases.py)."""
        self.placed = apply(self.pipe, plan, self.profile, device, tag=self.tag)
        modules = pipeline_modules(self.pipe)
        # a re-applied plan's stats carry the counts of the one it replaces (the worker's whole run)
        self.offload_stats = OffloadStats(modules, device).carry(self.offload_stats)
        old, self.phases = self.phases, None
        if plan.phases:
            swapped = lambda name, size: self.offload_stats.swapped(name, size)  # noqa: E731 - the live stats
            self.phases = Phases(self.pipe, plan, modules, device, swapped, self.to_host).carry(old)

    def _cache(self, carried: AppliedCache | None, dtype: torch.dtype) -> None:
        """The job's step cache, after offloading (so that skipped blocks stay where they are); `carried`:
        the one it replaces, whose counts run on."""
        cache = self.settings.cache
        if cache.method != "none":
            own = not names_contexts(type(self.pipe))
            self.cache = AppliedCache(cache, self.denoisers, dtype, own, carried, self.settings.steps)

    def _compile(self, carried: AppliedCompile | None) -> None:
        """`--compile`, last: the compiled regions call through the offload and cache hooks; `carried`: the
        compilation it replaces after a re-apply, whose counts run on (none where it was disabled)."""
        if self.fit.compile and (carried is None or carried.disabled is None):
            self.compiled = AppliedCompile(self.denoisers, carried, adapters=self.adapters)

    def compiling(self) -> bool:
        return self.compiled is not None and self.compiled.disabled is None

    def off(self, offload: bool = True) -> None:
        """Compilation, the cache and the offload counters off; with `offload`, for good: the attention
        kernel and offloading too (a pipeline given is left as it came: no hooks, on the CPU), and the
        pipeline let go (a closed worker holds no model)."""
        if self.compiled is not None:
            self.compiled.close()
        if self.cache is not None:
            self.cache.close()
        if self.offload_stats is not None:
            self.offload_stats.close()
        if not offload:
            return
        if self.attention is not None:
            reset_attention(self.denoisers, self.attention.backend)
        if self.given:
            unapply(self.pipe, self.placed)
        elif self.placed is not None:
            self.placed.close()
        self.pipe = None

    def unplace(self) -> None:
        """Every offloading hook of the current placements off, the stream ones included (before `again`)."""
        unapply(self.pipe, self.placed)
