"""Reading a job from its output location alone: `fleetgen status` and `fleetgen report`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fleetgen.errors import FleetgenError
from fleetgen.jobs.fleet import fleet_lines
from fleetgen.jobs.lock import live_lock
from fleetgen.jobs.state import shard_counts
from fleetgen.units import format_size
from fleetgen.workers.output.layout import FLEET, JOB, SUCCESS, SUMMARY, WORKERS
from fleetgen.workers.output.parts import parts_counts
from fleetgen.workers.output.storage import Output
from fleetgen.workers.spec import makes_clips


def _json(out: Output, key: str) -> dict | None:
    try:
        return json.loads(out.get(key))
    except (FileNotFoundError, ValueError):
        return None


@dataclass(frozen=True)
class JobStatus:
    """A job as its output location says it is (`fleetgen status`, `fleetgen.status`)."""

    url: str
    job: dict  # job.json: the resolved config and the fingerprint
    complete: bool  # _SUCCESS: every shard committed
    running: bool  # a driver's heartbeat is fresh
    driver: str | None  # that driver, as its lock names it
    shards_total: int
    shards_committed: int
    rows_total: int
    rows_done: int  # in committed shards and in the parts of shards not yet committed
    rows_in_parts: int  # of them, in parts (workers/output/parts.py): shards running, or left by lost workers
    shards_in_parts: int
    images_ok: int  # clips, for a video task
    images_filtered: int  # flagged by the pipeline's safety checker, not stored
    images_error: int  # error rows
    failures: list  # failed shards of the last run (summary.json)
    workers: list  # each worker's record (workers/<w>.json)
    fleet: dict | None  # fleet.json: the workers as the driver last saw them, and the latest events
    workers_failed: list
    images_redone: dict  # per worker, as the last run's summary counts them: images made again after a loss
    eta_seconds: float | None  # at the running workers' rates
    counts: dict  # every committed shard's counts

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        return status_text(self)


def job_state(url: str) -> JobStatus:
    """What OUT says about its job: counts from the manifests' footers (or the counts index), the
    running driver (if its heartbeat is fresh), per-worker figures, failures, and an ETA from the
    workers' rates. No manifest rows are read (`report` reads a sample)."""
    out = Output(url)
    job = _json(out, JOB)
    if job is None:
        raise FleetgenError(f"{out.url} holds no fleetgen job (no {JOB}).")
    if "fingerprint" not in job:
        raise FleetgenError(f"{out.key_url(JOB)} is not a fleetgen job record (no fingerprint).")
    counts = shard_counts(out)
    parts = parts_counts(out, set(counts))
    total_rows = sum(f["rows"] for f in job["fingerprint"]["input"])
    workers = [w for w in (_json(out, f"{WORKERS}/{name}") for name in out.list(WORKERS, ".json")) if w]
    lock = live_lock(out) or {}
    running = bool(lock)
    rate = sum((w.get("stats") or {}).get("images_per_second") or 0 for w in workers) if running else 0
    rows_in_parts = sum(c["rows"] for c in parts.values())
    rows_done = sum(c["rows"] for c in counts.values()) + rows_in_parts  # a row may make several images
    images = sum(c["images"] for c in [*counts.values(), *parts.values()])
    left = (total_rows - rows_done) * (images / rows_done if rows_done else 1)  # images still to make
    summary = _json(out, SUMMARY) or {}
    per_shard = job["fingerprint"]["generation"]["rows_per_shard"]
    return JobStatus(
        url=out.url,
        job=job,
        complete=out.exists(SUCCESS),
        running=running,
        driver=lock.get("owner") if running else None,
        shards_total=job.get("shards_total") or -(-total_rows // per_shard),
        shards_committed=len(counts),
        rows_total=total_rows,
        rows_done=rows_done,
        rows_in_parts=rows_in_parts,
        shards_in_parts=len(parts),
        images_ok=sum(c["ok"] for c in [*counts.values(), *parts.values()]),
        images_filtered=sum(c["filtered"] for c in [*counts.values(), *parts.values()]),
        images_error=sum(c["images"] - c["ok"] - c["filtered"] for c in [*counts.values(), *parts.values()]),
        failures=summary.get("failures", []),
        workers=workers,
        fleet=_json(out, FLEET),
        workers_failed=summary.get("workers_failed", []),
        images_redone={w["worker"]: w.get("images_redone") or 0 for w in summary.get("workers", [])},
        eta_seconds=left / rate if rate and left else None,
        counts=counts,
    )


def status_text(state: JobStatus) -> str:
    """What `fleetgen status` prints."""
    fp = state.job["fingerprint"]
    clips = makes_clips(fp["generation"])  # a video task: counts are clips
    unit = "clips" if clips else "images"
    if state.complete:
        now = "complete"
    elif state.running:
        now = f"running ({state.driver})"
    else:
        now = "stopped or failed (no driver running; rerun the same command to resume)"
    lines = [
        f"job at {state.url}: model {fp['model']}",
        f"state: {now}",
        f"shards {state.shards_committed}/{state.shards_total} committed, rows {state.rows_done}/"
        f"{state.rows_total}: {state.images_ok} {unit}, {state.images_error} row errors"
        + (f", {state.images_filtered} filtered {_filtered_by(fp)}" if state.images_filtered else ""),
    ]
    if state.rows_in_parts:
        lines.append(
            f"  of them, {state.rows_in_parts} rows committed in parts of {state.shards_in_parts} shard(s) "
            "not yet whole (running, or resumed from there by the next run)"
        )
    if state.eta_seconds:
        lines.append(f"ETA {state.eta_seconds / 60:.1f} min at the workers' current rates")
    if sum(state.images_redone.values()):
        each = ", ".join(f"{w} {n}" for w, n in state.images_redone.items() if n)
        lines.append(f"last run: {sum(state.images_redone.values())} {unit} made twice after lost work ({each})")
    for f in state.failures:
        lines.append(f"failed: {f['shard']} after {f['attempts']} attempt(s): {f['error']}")
    lines += fleet_lines(state.fleet)
    for w in state.workers_failed:
        lines.append(f"worker {w['worker']} could not run: {w['error']}")
    return "\n".join(lines + worker_lines(state.workers, clips))


def worker_lines(workers: list[dict], clips: bool = False) -> list[str]:
    """The plans by device kind, then a line per worker (its records: `OUT/workers/<name>.json`)."""
    unit, lines = "clips" if clips else "images", []
    kinds = plan_kinds(workers)
    if kinds:
        lines.append("plans by device kind:")
        lines += [f"  {k['kind']}: {k['plan']}, batch {k['batch']}; {k['chosen']}; {k['speed']}" for k in kinds]
    for w in workers:
        st = w.get("stats") or {}
        rate = st.get("images_per_second") or 0
        speed = f"{1 / rate:.1f} s/clip" if clips and rate else f"{rate:.2f} {'clips' if clips else 'img'}/s"
        lines.append(
            f"  {w['worker']}: {w['device']['name']}, batch {w.get('batch_size')}, "
            f"{st.get('images', 0)} {unit}, {speed}, "
            f"plan: {', '.join(f'{k} {v}' for k, v in w['plan']['modes'].items())}"
            + (f"; {host_copy_text(w['host_copy'])}" if w.get("host_copy") else "")
        )
    return lines


def fleet_text(url: str) -> str:
    """The workers recorded at `url` (`workers/<name>.json`, a job's or a Ray Data stage's `stats`)."""
    out = Output(url)
    workers = [w for w in (_json(out, f"{WORKERS}/{name}") for name in out.list(WORKERS, ".json")) if w]
    if not workers:
        raise FleetgenError(f"{out.url} holds no worker records ({WORKERS}/*.json).")
    return "\n".join([f"{len(workers)} worker(s) at {out.url}:", *worker_lines(workers)])


def host_copy_text(record: dict) -> str:
    """Whether a worker shared its node's copy of the weights or held its own, and the bytes."""
    own = format_size(record.get("own_bytes") or 0)
    if record.get("shared"):
        how = "wrote" if record.get("role") == "wrote" else "mapped"
        return f"weights: the node's copy ({how} it, {format_size(record['shared_bytes'])}), {own} of its own"
    why = f" ({record['note']})" if record.get("note") else ""
    return f"weights: its own copy, {own}{why}"


def plan_kinds(workers: list[dict]) -> list[dict]:
    """Per device kind (its name and budget): the plan its workers kept, how it was chosen (the speed
    model, trials measured on the device, or another worker's trials: workers/pipeline/trials.py), and
    seconds per image predicted beside measured."""
    groups: dict = {}
    for w in workers:
        budget = w["plan"].get("budget_bytes")
        kind = w["device"]["name"] + (f", {format_size(budget)}" if budget else "")
        groups.setdefault(kind, []).append(w)
    out = []
    for kind, ws in groups.items():
        plan = ws[0]["plan"]
        how = sorted({w["plan"].get("chosen_by", "model") for w in ws})
        timed = next((w["plan"].get("trials") for w in ws if w["plan"].get("trials")), None) or []
        chosen = "chosen by " + " and ".join(how)
        if timed:
            chosen += " (" + "; ".join(_trial(t) for t in timed) + ")"
        elif plan.get("trials_skipped"):
            chosen += f" (not timed: {plan['trials_skipped']})"
        seconds = [(w.get("predicted_vs_measured") or {}).get("seconds_per_image") or {} for w in ws]
        measured = [s["measured"] for s in seconds if s.get("measured")]
        predicted = plan.get("predicted_seconds_per_image")
        speed = (f"predicted {predicted:.3g} s/img" if predicted else "no prediction") + (
            f", measured {sum(measured) / len(measured):.3g}" if measured else ", nothing measured yet"
        )
        out.append(
            {
                "kind": kind,
                "workers": [w["worker"] for w in ws],
                "plan": ", ".join(f"{k} {v}" for k, v in plan["modes"].items() if v != "resident") or "all resident",
                "batch": ws[0].get("batch_size") or plan.get("batch_size"),
                "chosen": chosen,
                "speed": speed,
            }
        )
    return out


def _trial(t: dict) -> str:
    offloaded = ", ".join(f"{k} {v}" for k, v in t["modes"].items() if v != "resident") or "all resident"
    got = f"{t['measured_seconds_per_image']:.3g}" if t.get("measured_seconds_per_image") else t.get("error", "-")
    return f"{offloaded} batch {t['batch_size']}: {t['predicted_seconds_per_image']:.3g} predicted, {got} measured"


def _filtered_by(fp: dict) -> str:
    """What filters a job's images: the pipeline's safety checker, and its `--keep` rule where it has one."""
    keep = fp["generation"].get("keep", "none")
    return "by the safety checker" if keep == "none" else f"by the safety checker or --keep '{keep}'"
