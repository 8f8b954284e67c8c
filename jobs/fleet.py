"""The fleet as it changes: `OUT/fleet.json`, written by the driver, read by `fleetgen status`.

One entry per worker (its state now, where it runs, how often it started) and the latest events
(placed, ready, failed, lost, restarting, released), so a user can watch nodes come and go.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from fleetgen.errors import StorageError
from workers.layout import FLEET
from workers.storage import Output

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
            w = self.workers.setdefault(worker, {"worker": worker, "starts": 0})
            w.update(state=state, since=now, **{k: v for k, v in fields.items() if v is not None})
            if event == "ready":
                w["starts"] += 1
            self.events = [*self.events, {"time": now, "worker": worker, "event": event, "detail": detail}][-EVENTS_KEPT:]
            self._version += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="fleetgen-fleet-record", daemon=True)
            self._thread.start()

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
            data = json.dumps({"updated": time.time(), "workers": self.workers, "events": self.events},
                              indent=1).encode()
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
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._write()


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
