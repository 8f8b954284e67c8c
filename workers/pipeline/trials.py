"""Plans chosen by measurement (`--plan-trials auto|on|off`): where the speed model ranks plans closer
than its own error, the worker times them on its device — each candidate's placements and batch with
the job's shapes, a pipeline call of one step and one of `1 + STEPS`, nothing written — and keeps the
fastest measured. The first worker of a device kind (its name, budgets and the job's shapes) measures;
the others of that kind, and a rerun of the job, reuse its answer from the output
(`plans/<kind>.json`). Plans keep pixels: only placements and batch sizes are compared, never formats.

What a worker records (`plan.chosen_by`: model | measured | shared, `plan.trials`, their cost and
cap) is workers/info.py's; the trials themselves run on the fitted pipeline (workers/pipeline/fitted.py)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetgen.errors import FleetgenError, StorageError, one_line
from fleetgen.offload.cost import Placement
from fleetgen.offload.planner import candidates, given_plan
from fleetgen.offload.speed import STORED
from fleetgen.workers.output.layout import PLANS
from fleetgen.workers.pipeline.plans import is_out_of_memory

if TYPE_CHECKING:
    from fleetgen.offload import OffloadPlan
    from fleetgen.workers.output.storage import Output
    from fleetgen.workers.pipeline.fitted import FittedPipeline

CHOICES = ("auto", "on", "off")
SHARE = 0.05  # of a shard's expected time: what the trials may take
STEPS = 2  # steps the second timing call runs beyond the first's one
CANDIDATES = 3
WAIT_SECONDS = 120.0  # how long a worker waits for another of its kind to finish measuring, at least


def model_error() -> float:
    """The speed model's error as a ratio (1.34: plans predicted within 34 % of each other are a tie):
    its leave-one-model-out mean absolute log error on the rows it was fitted on (offload/speed.json)."""
    try:
        errors = json.loads(STORED.read_text())["errors"]["leave_one_model_out"]
        return math.exp(errors["mean_abs_log_error"])
    except (OSError, KeyError, ValueError):
        return 1.3


@dataclass
class Trial:
    plan: OffloadPlan
    measured: float | None = None  # seconds per image
    error: str | None = None
    seconds: float = 0.0  # what timing it cost: its warm-up and its two calls

    def to_dict(self) -> dict:
        return {
            "modes": self.plan.modes,
            "batch_size": self.plan.batch_size,
            "phased": bool(self.plan.phases),
            "predicted_seconds_per_image": self.plan.seconds_per_image,
            "measured_seconds_per_image": self.measured,
            "seconds": round(self.seconds, 4),
            **({"error": self.error} if self.error else {}),
        }


class Shared:
    """One device kind's answer in the job's output: `plans/<kind>.json`, claimed first by the worker
    that measures (`plans/<kind>.claim`, created atomically) so that one worker per kind does."""

    def __init__(self, output: Output, kind: dict):
        digest = hashlib.sha256(json.dumps(kind, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.output, self.kind = output, kind
        self.key, self.claim_key = f"{PLANS}/{digest}.json", f"{PLANS}/{digest}.claim"

    def read(self) -> dict | None:
        try:
            return json.loads(self.output.get(self.key)) if self.output.exists(self.key) else None
        except (StorageError, ValueError):
            return None

    def claim(self, worker: str) -> bool:
        try:
            return self.output.create(self.claim_key, json.dumps({"worker": worker, "at": time.time()}).encode())
        except StorageError:
            return True  # the store cannot say: measure (a second measurement costs time, not pixels)

    def wait(self, seconds: float) -> dict | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = self.read()
            if found is not None:
                return found
            time.sleep(0.5)
        return None

    def write(self, answer: dict) -> None:
        try:
            self.output.put(self.key, json.dumps({"kind": self.kind, **answer}, indent=1).encode())
        except StorageError as err:
            print(f"[fleetgen] {self.key} not written ({err}): other workers of this kind measure again", flush=True)


def kind_of(f: FittedPipeline) -> dict:
    """What makes two workers the same device kind for a plan: the device, its budgets, the job's
    shapes and the model as this worker holds it."""
    d = f.planned_device()
    quarter = 2**28  # budgets read from free memory differ by a few MiB between cards of one kind
    return {
        "device": d.name,
        "budget_gib": round(d.budget / quarter) / 4,
        # the host budget as given: read from the RAM available, it changes from one minute to the next
        "host_memory": f.fit.host_memory,
        "model": f.profile.model,
        "dtype": str(f.dtype),
        "workload": repr(f.loaded_workload()),
    }


def refusal(f: FittedPipeline) -> str | None:
    """Why this worker does not time plans (None: it may)."""
    if f.fit.plan_trials == "off":
        return "`--plan-trials off`"
    if f.budget() is None:
        return "a CPU worker without `--gpu-memory` runs all resident"
    if f.plan.phases:
        return "the model's plan is phased; phased plans are not timed"
    if f.compiled is not None:
        return "compiled denoisers would compile a graph per candidate"
    if f.cache is not None:
        return "a step cache makes a few steps' time no guide to a whole call's"
    if not f.task.batched:
        return "one row per call: only the model's placements to compare"
    return None


def choose(f: FittedPipeline, shared: Shared | None) -> dict:
    """Time the candidates where they are worth it, keep the fastest measured (re-applied on `f`);
    what the worker records as `plan.chosen_by`, `plan.trials` and the trials' cost."""
    why = refusal(f)
    if why:
        return {"chosen_by": "model", "trials_skipped": why}
    work, device = f.loaded_workload(), f.planned_device()
    ranked = [p for p in candidates(f.profile, device, work, f.plan, CANDIDATES) if p.formats == f.plan.formats]
    band = model_error()
    close = [p for p in ranked if p.cost_per_image <= f.plan.cost_per_image * band]
    if f.fit.plan_trials == "auto" and len(close) < 2:
        return {"chosen_by": "model", "trials_skipped": f"no other plan predicted within {band:.2f}x of the model's"}
    pool = close if f.fit.plan_trials == "auto" else ranked
    if shared is not None:
        found = shared.read()
        if found is None and not shared.claim(f.tag):
            found = shared.wait(max(WAIT_SECONDS, _cap(f, pool[0])))
        if found is not None:
            return _reuse(f, found, device, work)
    answer = _measure(f, pool)
    if shared is not None:  # what it kept, measured or (the cap cut the trials short) the model's: none waits in vain
        shared.write({"chosen": _chosen(f.plan), "trials": answer["trials"], "measured_by": f.tag})
    return answer


def _chosen(plan: OffloadPlan) -> dict:
    return {"modes": plan.modes, "batch_size": plan.batch_size}


def _reuse(f: FittedPipeline, found: dict, device, work) -> dict:
    """Another worker of this kind measured (or an earlier run of the job): its fastest plan, applied."""
    chosen = found["chosen"]
    given = {n: Placement.parse(m) for n, m in chosen["modes"].items()}
    try:
        plan = given_plan(f.profile, device, work, given, chosen["batch_size"])
    except FleetgenError as err:
        return {"chosen_by": "model", "trials_skipped": f"the shared plan does not fit here: {one_line(err)}"}
    if plan.key != f.plan.key:
        f.switch(plan)
    return {"chosen_by": "shared", "trials": found.get("trials", []), "measured_by": found.get("measured_by")}


def _cap(f: FittedPipeline, plan: OffloadPlan, per_image: float | None = None) -> float:
    """The seconds trials may take: `SHARE` of a shard's expected time, at `per_image` (measured),
    else the warm-up's pace, else the plan's prediction."""
    per_image = per_image or f.warm_seconds or plan.seconds_per_image
    return SHARE * max(f.fit.shard_images, 1) * per_image


def _measure(f: FittedPipeline, pool: list[OffloadPlan]) -> dict:
    """Each candidate timed, the model's first (it is applied: the others are measured against it);
    after it, another only while the trials so far plus its expected cost stay within the cap (`SHARE`
    of a shard at the first's measured pace). The fastest measured is kept."""
    model, cap = f.plan, None
    started, trials = time.perf_counter(), []
    for plan in pool:
        if trials:
            spent = time.perf_counter() - started
            per_image_step = spent / sum(t.plan.batch_size for t in trials)
            if spent + per_image_step * plan.batch_size > cap:
                break
        trials.append(_time(f, plan))
        if cap is None:
            cap = _cap(f, plan, trials[0].measured)
    timed = [t for t in trials if t.measured is not None]
    best = min(timed, key=lambda t: t.measured, default=None)
    keep = best.plan if best is not None else model
    if keep.key != f.plan.key:
        f.switch(keep)
    else:
        f.settled()
    compared = len(timed) > 1 or (timed and len(trials) > 1)  # another plan timed, or failed where it ran
    out = {
        "chosen_by": "measured" if compared else "model",
        "trials": [t.to_dict() for t in trials],
        "trial_seconds": time.perf_counter() - started,
        "cap_seconds": cap,
    }
    if len(trials) < len(pool):
        out["trials_cut"] = f"{len(pool) - len(trials)} of {len(pool)} left untimed by the cap ({SHARE:.0%} of a shard)"
    return out


def _time(f: FittedPipeline, plan: OffloadPlan) -> Trial:
    """`plan` applied (unless it is), warmed up by one step, then timed: one call of one step and one of
    `1 + STEPS` at its batch; per image, the first plus the job's other steps at the difference's pace.
    An out-of-memory error is this candidate's, not the worker's."""
    oom, started = None, time.perf_counter()
    try:
        if plan.key != f.plan.key:
            f.switch(plan, warm=False)
            f.timed_call(1, 1)  # the streams' prefetch order, the allocator: settled before timing
        elif f.warm_seconds is None:  # not warmed up yet (a CPU worker): the first call's own costs
            f.timed_call(1, 1)
        one = f.timed_call(plan.batch_size, 1)
        more = f.timed_call(plan.batch_size, 1 + STEPS)
    except Exception as err:  # noqa: BLE001 - an OOM fails this candidate only; anything else is the worker's
        if not is_out_of_memory(err):
            raise
        oom = one_line(err)
    if oom is not None:
        f.recover()
        return Trial(plan, error=f"out of memory: {oom[:200]}", seconds=time.perf_counter() - started)
    per_step = max(more - one, 0.0) / STEPS
    measured = (one + (f.workload.steps - 1) * per_step) / plan.batch_size
    return Trial(plan, measured=measured, seconds=time.perf_counter() - started)


def smaller_measured(choice: dict, plan: OffloadPlan, failed: int) -> int | None:
    """After an out-of-memory error at batch `failed`: the batch, smaller, that this worker's trials
    measured fastest with the plan's own placements (None: none measured; the batch is halved)."""
    timed = [
        t
        for t in choice.get("trials") or []
        if t.get("measured_seconds_per_image") and t["modes"] == plan.modes and t["batch_size"] < failed
    ]
    best = min(timed, key=lambda t: t["measured_seconds_per_image"], default=None)
    return best["batch_size"] if best else None
