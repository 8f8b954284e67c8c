"""What a fitted pipeline (workers/pipeline/fitted.py) does when a call fails: a batch whose call
raises runs again a row at a time, an out-of-memory error steps down the ladder (a smaller batch, then a
leaner plan, kept from then on), a failed compile runs again uncompiled. `Recovering` is
`FittedPipeline`'s base: the pipeline's calls, plan and applied hooks are its own."""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import torch

from fleetgen.errors import FleetgenError, OffloadError, one_line
from fleetgen.offload import OffloadPlan
from fleetgen.workers.output.made import Made
from fleetgen.workers.pipeline import trials
from fleetgen.workers.pipeline.compiling import is_compile_error
from fleetgen.workers.pipeline.plans import components_dtypes_kept, is_out_of_memory, leaner_plan
from fleetgen.workers.rows.batches import Look, WorkItem


class Recovering:
    """Retry row by row, step down after an OOM, run uncompiled after a failed compile: the part of
    `FittedPipeline` that decides what a failure costs."""

    def generate(self, batch: list[WorkItem], inputs: dict | None = None) -> tuple[list[Made], dict[str, str]]:
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
            compile_failed = self.applied.compiling() and is_compile_error(err)
        if compile_failed:  # said in workers/<w>.json; the batch runs again, uncompiled
            self.compiled.disable(failure[:300])
            return self.generate(batch, inputs)
        if oom is not None:
            if not self._step_down(len(batch), oom):
                return [], {r.id: f"OutOfMemoryError at batch 1 with the leanest plan: {oom}" for r in batch}
        elif len(batch) == 1:
            return [], {batch[0].id: failure}
        made, failed, rest = [], {}, batch
        while rest:  # after an OOM at the batch size as it stands then (a part's own OOM may step it down again)
            size = self.batch_size if oom is not None else 1
            m, f = self.generate(rest[:size], inputs)
            made += m
            failed.update(f)
            rest = rest[size:]
        return made, failed

    def _warm_up(self, look: Look, images: int = 1) -> None:
        """`images` through the pipeline, so that kernels, graphs, the allocator and the streams'
        prefetch order settle before anything is timed. An OOM here steps the plan down, as in a shard."""
        while True:
            oom = None
            try:

                def call():
                    return self._blank_call("warm up", images, look)

                started = time.perf_counter()
                with components_dtypes_kept(self.pipe), self._cache_context():
                    self._run(("warm up",) * images, call)
                    if self.deferred:  # its decode too, with the VAE alone on the device
                        self.phases.enter(len(self.phases.resident) - 1)
                        self.phases.decoded(("warm up",) * images)
                        self.phases.pending.clear()
                self.warm_seconds = (time.perf_counter() - started) / images
                self.settled()
                return
            except Exception as err:  # noqa: BLE001 - an OOM and a failed compile are handled; the rest is raised
                if self.applied.compiling() and is_compile_error(err):
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
            failed = min(self.batch_size, size)
            measured = trials.smaller_measured(self.choice, self.plan, failed)
            before, self.batch_size = self.batch_size, measured or max(1, failed // 2)
            why = f"out of memory at batch {size}" + ("; the fastest smaller batch measured" if measured else "")
            self.step_downs.append({"from": f"batch {before}", "to": f"batch {self.batch_size}", "reason": why})
            return True
        try:
            leaner = self._leaner()
        except FleetgenError:
            return False
        self._reapply(leaner)
        self.step_downs.append(
            {"from": _rung(self.plan), "to": _rung(leaner), "reason": f"out of memory at batch 1: {err[:200]}"}
        )
        self.plan = leaner
        return True

    def _leaner(self) -> OffloadPlan:
        """The next plan down the ladder. Phased: one whose phase that ran out is placed leaner, else
        (where the other phase's floor is reached first) the per-batch ladder from here."""
        work, device = self.loaded_workload(), self.planned_device()
        if self.phases is None:
            return leaner_plan(self.profile, self.plan, work, device)
        try:
            return leaner_plan(self.profile, self.plan, work, device, self.plan.phases[self.phases.failed])
        except FleetgenError:
            return leaner_plan(self.profile, self.plan, replace(work, phases="off"), device)

    def recover(self) -> None:
        """After an out-of-memory error outside a shard (a plan trial's): what it held let go."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _rung(plan: OffloadPlan) -> dict[str, str]:
    """A plan as a step-down records it: each component's placement, with the phases and the storage
    formats where it has them (a leaner plan may keep every placement and phase its encoders, or add a format)."""
    rung = dict(plan.modes)
    if plan.phases:
        rung["phases"] = " | ".join("+".join(p) for p in plan.phases)
    if plan.formats:
        rung["formats"] = ",".join(f"{c}={f}" for c, f in sorted(plan.formats.items()))
    return rung
