"""The fleet as it changes: `OUT/fleet.json`, written by the driver, read by `fleetgen status`.

One entry per worker (its state now, where it runs, how often it started) and the latest events
(placed, ready, failed, lost, restarting, released), so a user can watch nodes come and go.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from fleetgen.errors import StorageError
from workers.layout import FLEET
from workers.storage import Output

EVENTS_KEPT = 200  # latest fleet events in fleet.json; the driver's log has them all
WRITE_EVERY = 2.0  # seconds: at most one write per this, plus one at the end


class FleetRecord:
    def __init__(self, output: Output, say: Callable[[str], None] | None = None):
        self.output = output
        self.say = say or (lambda message: None)  # the job's log: a write the store did not take
        self.failing = False
        self.workers: dict[str, dict] = {}
        self.events: list[dict] = []
        self._written = float("-inf")
        self._dirty = False

    def note(self, worker: str, event: str, state: str, detail: str = "", **fields) -> None:
        now = time.time()
        w = self.workers.setdefault(worker, {"worker": worker, "starts": 0})
        w.update(state=state, since=now, **{k: v for k, v in fields.items() if v is not None})
        if event == "ready":
            w["starts"] += 1
        self.events = [*self.events, {"time": now, "worker": worker, "event": event, "detail": detail}][-EVENTS_KEPT:]
        self._dirty = True
        self.flush(force=False)

    def close_all(self, reason: str) -> None:
        """Workers still up when the pool shuts down."""
        for name, w in self.workers.items():
            if w["state"] not in ("released", "failed", "lost"):
                self.note(name, "closed", "closed", reason)

    def flush(self, force: bool = True) -> None:
        """Write when something changed (at most every WRITE_EVERY seconds unless forced). A status
        record: a write the store does not take (after the storage retries) is said once and tried
        again at the next change; it never stops the job."""
        if not self._dirty or (not force and time.monotonic() - self._written < WRITE_EVERY):
            return
        self._written = time.monotonic()
        try:
            self.output.put(FLEET, json.dumps({"updated": time.time(), "workers": self.workers,
                                               "events": self.events}, indent=1).encode())
        except StorageError as err:
            if not self.failing:
                self.say(f"{FLEET} not written ({err}); tried again at the next change")
            self.failing = True
            return
        if self.failing:
            self.say(f"{FLEET} written again")
        self._dirty = self.failing = False


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
