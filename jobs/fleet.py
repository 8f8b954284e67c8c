"""The fleet as it changes: the pool's events followed into progress lines, `OUT/fleet.json`
(written by the driver, read by `fleetgen status`) and the summary's per-worker table.

One entry per worker (its state now, where it runs, how often it started, its plan, what it made)
and the latest events (placed, ready, failed, lost, restarting, released), so a user can watch
nodes come and go.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from fleetgen.errors import StorageError
from fleetgen.workers.output.layout import FLEET
from fleetgen.workers.output.storage import Output

if TYPE_CHECKING:
    from fleetgen.jobs.summary import Run

SUMMARY_FIELDS = (
    "worker",
    "images",
    "images_redone",
    "seconds",
    "starts",
    "device",
    "gpu_type",
    "host",
    "device_memory",
    "budget",
    "modes",
    "quantized",
    "batch",
    "reason",
    "warnings",
    "failed",
)  # the summary's per-worker table
EVENTS_KEPT = 200  # latest fleet events in fleet.json; the driver's log has them all
WRITE_EVERY = 2.0  # seconds: at most one write per this, plus one at the end


class FleetRecord:
    """The fleet's state, written to `OUT/fleet.json` by a thread of its own: the driver's loop never
    waits on the store for a status record (under an outage one write can take many seconds). A
    write the store does not take is said once, tried again at the next change, and never stops
    the job."""

    def __init__(self, output: Output, say: Callable[[str], None] | None = None):
        self.output = output
        self.say = say or (lambda message: None)  # the job's log: a write the store did not take
        self.failing = False
        self.workers: dict[str, dict] = {}
        self.events: list[dict] = []
        self._version = self._written = 0  # changes noted / the change last written
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def note(self, worker: str, event: str, state: str, detail: str = "", **fields) -> None:
        now = time.time()
        with self._lock:
            w = self.workers.setdefault(
                worker, {"worker": worker, "starts": 0, "images": 0, "images_redone": 0, "seconds": 0.0}
            )
            w.update(state=state, since=now, **{k: v for k, v in fields.items() if v is not None})
            if event == "ready":
                w["starts"] += 1
            self.events = [*self.events, {"time": now, "worker": worker, "event": event, "detail": detail}][
                -EVENTS_KEPT:
            ]
            self._version += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="fleetgen-fleet-record", daemon=True)
            self._thread.start()

    def made(self, worker: str, images: int, seconds: float) -> None:
        with self._lock:
            w = self.workers[worker]
            w["images"] += images
            w["seconds"] += seconds

    def redone(self, worker: str, images: int) -> None:
        with self._lock:
            self.workers[worker]["images_redone"] += images

    def table(self) -> list[dict]:
        """The summary's per-worker table: workers that started or could not, with their speed and
        share of the images."""
        with self._lock:
            rows = []
            for w in self.workers.values():
                if w["starts"]:  # started: its plan and device, and why it failed later if it did
                    rows.append({k: w.get(k) for k in SUMMARY_FIELDS if k != "failed" or w.get("failed")})
                elif w.get("failed"):  # never started
                    rows.append({k: w[k] for k in ("worker", "images", "images_redone", "seconds", "starts", "failed")})
        total = sum(w["images"] for w in rows) or 1
        for w in rows:
            w["images_per_second"] = round(w["images"] / w["seconds"], 3) if w["seconds"] else None
            w["share"] = round(w["images"] / total, 3)
        return sorted(rows, key=lambda w: int(w["worker"][1:]))

    def close_all(self, reason: str) -> None:
        """Workers still up when the pool shuts down."""
        for name, w in list(self.workers.items()):
            if w["state"] not in ("released", "failed", "lost"):
                self.note(name, "closed", "closed", reason)

    def _write_loop(self) -> None:
        while not self._closed:
            self._wake.wait(WRITE_EVERY)
            self._wake.clear()
            if not self._closed:
                self._write()

    def _write(self) -> None:
        with self._lock:
            version = self._version
            if version == self._written:
                return
            data = json.dumps(
                {"updated": time.time(), "workers": self.workers, "events": self.events}, indent=1
            ).encode()
        try:
            self.output.put(FLEET, data)
        except StorageError as err:
            if not self.failing:
                self.say(f"{FLEET} not written ({err}); tried again at the next change")
            self.failing = True
            return
        if self.failing:
            self.say(f"{FLEET} written again")
        self._written, self.failing = version, False

    def flush(self, force: bool = True) -> None:
        """The latest state written now (the end of a run), on the caller's thread; `force=False`:
        leave it to the record's own thread."""
        if not force:
            return
        self.close()
        self._write()

    def close(self) -> None:
        """The record's thread ends, without another write (the output is not this run's to write)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()


def follow(events: Iterable, run: Run, fleet: FleetRecord) -> None:
    """Turn the pool's events into progress, the fleet record, the run's failures and commits: each
    event type has its handler (`_Follower`)."""
    follower = _Follower(run, fleet)
    handlers = follower.handlers()
    for event in events:
        handlers.get(type(event), follower.ignore)(event)


class _Follower:
    """What each event of the pool (cluster/events.py) does to a run."""

    def __init__(self, run: Run, fleet: FleetRecord):
        self.run, self.fleet, self.progress = run, fleet, run.progress
        self.lengths = {s.id: s.length for s in run.todo}
        # rows shown per shard, so that retries do not count twice; an earlier run's parts shown already
        self.counted = {k: run.in_parts.get(k, 0) for k in self.lengths}

    def handlers(self) -> dict[type, Callable]:
        from fleetgen.cluster import events as e  # plain data, no Ray

        return {
            e.Tick: self.tick,
            e.WorkerPlaced: self.placed,
            e.WorkerReady: self.ready,
            e.WorkerFailed: self.failed,
            e.WorkerLost: self.lost,
            e.WorkerUnreachable: self.unreachable,
            e.WorkerReleased: self.released,
            e.Waiting: self.waiting,
            e.BatchDone: self.batch_done,
            e.ShardSpeculated: self.speculated,
            e.ShardResult: self.shard_done,
            e.PartCommitted: self.part_done,
            e.ImagesRedone: self.redone,
            e.ShardFailed: self.shard_failed,
        }

    def ignore(self, event) -> None:
        pass

    def tick(self, event) -> None:
        self.progress.update()  # redrawn every interval even while no batch finishes

    def placed(self, event) -> None:
        p = event.placement
        where = f"{p['host']} ({p['node_ip']})" + (f", GPU {','.join(p['gpu_ids'])}" if p["gpu_ids"] else "")
        where += f" [{p['gpu_type']}]" if p.get("gpu_type") else ""
        self.fleet.note(
            event.worker, "placed", "loading", where, host=p["host"], node_ip=p["node_ip"], gpu_type=p.get("gpu_type")
        )
        self.progress.log(f"{event.worker} placed on {where}; loading the model")

    def ready(self, event) -> None:
        self.progress.start_clock()
        plan, info = event.info["plan"], event.info
        placement = info.get("placement") or {}
        self.fleet.note(
            event.worker,
            "ready",
            "ready",
            info["device"]["name"],
            device=info["device"]["name"],
            gpu_type=placement.get("gpu_type"),
            host=placement.get("host"),
            device_memory=info["probe"]["total_bytes"],
            budget=plan["budget_bytes"] or None,
            modes=plan["modes"],
            quantized=info.get("quantized") or {},
            batch=plan["batch_size"],
            reason=plan["reason"],
            warnings=info.get("warnings") or [],
        )
        again = " again (restarted)" if self.fleet.workers[event.worker]["starts"] > 1 else ""
        self.progress.log(
            f"{event.worker} ready{again} on {info['device']['name']} "
            f"(loaded in {info['load_seconds']:.1f} s): {plan['reason']}"
        )
        for warning in info.get("warnings") or []:
            self.progress.log(f"WARNING {event.worker}: {warning}")

    def failed(self, event) -> None:
        where = f" on {event.placement['host']}" if event.placement else ""
        self.fleet.note(event.worker, "failed", "failed", event.error, failed=event.error)
        self.progress.log(f"{event.worker}{where} cannot run, the job goes on without it: {event.error}")

    def lost(self, event) -> None:
        then = "Ray restarts it when capacity allows" if event.restarting else "dropped (died too often)"
        self.fleet.note(event.worker, "lost", "restarting" if event.restarting else "lost", event.error)
        self.progress.log(f"{event.worker} lost ({event.error}); its shard goes back on the queue; {then}")

    def unreachable(self, event) -> None:
        self.fleet.note(event.worker, "unreachable", "unreachable", event.error)
        self.progress.log(
            f"{event.worker} unreachable while running {event.shard_id} ({event.error}); the shard "
            "waits until the worker answers or is known dead, so that it never runs twice at once"
        )

    def released(self, event) -> None:
        self.fleet.note(event.worker, "released", "released", event.reason)
        self.progress.log(f"{event.worker} released: {event.reason}")

    def waiting(self, event) -> None:
        self.progress.log(
            f"waiting {event.seconds:.0f} s for {event.pending} worker(s) to be placed "
            f"(each asks {event.asks}); an autoscaler may be starting nodes" + (f". {event.hint}" if event.hint else "")
        )

    def batch_done(self, event) -> None:
        rows = min(event.rows, self.lengths[event.shard_id] - self.counted[event.shard_id])
        self.counted[event.shard_id] += rows
        self.progress.update(images=event.images, rows=rows, frames=event.frames)  # row errors: at the commit

    def speculated(self, event) -> None:
        self.progress.speculated += 1
        self.progress.log(
            f"straggler: {event.shard_id} has run {event.running_seconds:.0f} s; also given to "
            f"idle {event.worker} (first commit wins)"
        )

    def shard_done(self, event) -> None:
        if event.version is not None:
            self.run.committed[event.shard_id] = event
        self.fleet.made(event.worker, event.ok, event.seconds)
        # as the summary counts them: error rows of committed manifests (filtered images are not errors)
        errors = event.counts["error"] if event.counts else 0
        rest = self.lengths[event.shard_id] - self.counted[event.shard_id]
        self.progress.update(shards=1, rows=rest, errors=errors)
        self.counted[event.shard_id] = self.lengths[event.shard_id]

    def part_done(self, event) -> None:
        """A part of a running shard committed: its images are the worker's (its row errors: at the commit)."""
        self.fleet.made(event.worker, event.images, 0.0)

    def redone(self, event) -> None:
        self.fleet.redone(event.worker, event.images)

    def shard_failed(self, event) -> None:
        self.run.failures.append({"shard": event.shard_id, "error": event.error, "attempts": event.attempts})
        self.progress.update(failed=1)
        self.progress.log(f"shard {event.shard_id} failed after {event.attempts} attempt(s): {event.error}")


def fleet_lines(fleet: dict | None, events: int = 5) -> list[str]:
    """What `fleetgen status` prints about the fleet."""
    if not fleet:
        return []
    counts: dict[str, int] = {}
    for w in fleet["workers"].values():
        counts[w["state"]] = counts.get(w["state"], 0) + 1
    lines = ["fleet: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))]
    for e in fleet["events"][-events:]:
        detail = f": {e['detail']}" if e["detail"] else ""
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['worker']} {e['event']}{detail}")
    return lines
