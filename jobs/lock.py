"""One driver per output location: `OUT/_LOCK` names its owner and carries a heartbeat.

A second driver on the same output refuses, naming the first. A lock whose heartbeat is older
than `STALE` seconds belongs to a driver that died (SIGKILL, lost node) and is taken over; a lock
of a driver on this same host whose process no longer exists is taken over at once.
A free output is claimed by creating the lock only if absent (atomic on every store fleetgen
commits on: `Output.create`), so of two drivers starting together exactly one wins. A stale lock is
replaced by a write that is read back: of two drivers taking one over together, the one whose write
landed last wins, the other refuses.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from fleetgen.errors import StorageError
from fleetgen.workers.output.layout import LOCK
from fleetgen.workers.output.storage import Output

HEARTBEAT = 10.0  # seconds between heartbeats
STALE = 60.0  # seconds without a heartbeat after which a lock is taken over
SETTLE = 0.5  # seconds between writing the lock and reading it back


def live_lock(output: Output) -> dict | None:
    """The lock of a driver whose heartbeat is fresh (a running job), else None."""
    try:
        held = json.loads(output.get(LOCK))
    except (FileNotFoundError, ValueError):
        return None
    return held if time.time() - held.get("heartbeat", 0) < STALE else None


def _gone(held: dict) -> bool:
    """Whether the lock's driver ran on this host and its process is gone (other hosts: unknown,
    the heartbeat decides)."""
    pid = held.get("pid")
    if held.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # exists, another user's
    return False


class OutputLock:
    def __init__(
        self, output: Output, say: Callable[[str], None] | None = None, on_lost: Callable[..., None] | None = None
    ):
        self.output = output
        self.say = say or (lambda message: None)  # where the heartbeat tells of an outage (the job's log)
        # called once, with the reason, when the heartbeat has failed for STALE seconds or finds the lock
        # taken over by another driver (`taken_over`): the job stops
        self.on_lost = on_lost
        self.token = uuid.uuid4().hex
        self.owner = f"{socket.gethostname()} pid {os.getpid()}"
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps(
            {
                "token": self.token,
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": self.started,
                "heartbeat": time.time(),
            }
        ).encode()

    def _current(self, attempts: int | None = None) -> dict | None:
        try:
            return json.loads(self.output.get(LOCK, attempts=attempts))
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:
            return None  # a torn write of a dead driver: take it over

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale lock was taken over."""
        note = None
        held = self._current()
        if held and held.get("token") != self.token:
            age = time.time() - held.get("heartbeat", 0)
            if _gone(held):
                note = f"took over the lock of {held.get('owner')}: that process no longer exists on this host"
            elif age < STALE:
                raise StorageError(
                    f"{self.output.url} is in use by another fleetgen driver ({held.get('owner')}, started "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(held.get('started', 0)))}, last heartbeat "
                    f"{age:.0f} s ago). Wait for it to finish, or if it is gone, delete {self.output.key_url(LOCK)}."
                )
            else:
                note = f"took over a stale lock of {held.get('owner')} (no heartbeat for {age:.0f} s)"
        free = held is None and self.output.atomic_create
        if free and not self.output.create(LOCK, self._record()):
            held = self._current()
            if held:  # another driver's create landed first
                raise StorageError(f"{self.output.url} was claimed at the same moment by {held.get('owner')}.")
            free = False  # a torn lock of a dead driver: replaced below
        if not free:
            self.output.put(LOCK, self._record())
            time.sleep(SETTLE)
        held = self._current()
        if not held or held.get("token") != self.token:
            raise StorageError(f"{self.output.url} was claimed at the same moment by {held and held.get('owner')}.")
        self._thread = threading.Thread(target=self._beat, name="fleetgen-lock-heartbeat", daemon=True)
        self._thread.start()
        return note

    def _beat(self) -> None:
        """Every HEARTBEAT seconds. A store outage shorter than STALE costs nothing: the lock is
        only ever taken over once its heartbeat is STALE seconds old, and commits never rely on it
        (they are create-if-absent). The log says when beats fail and when they are back; after
        STALE seconds without one, `on_lost` is told (the driver then stops the job cleanly). Each beat
        first reads the lock: one that names another driver was taken over (this driver's heartbeat
        was STALE to it: a partition, a paused process). It is never written back: the heartbeat
        stops and `on_lost` is told, `taken_over=True` (its workers stop committing too: the fence in
        workers/output/commit.py)."""
        failing_since, lost = None, False
        while not self._stop.wait(HEARTBEAT):
            try:
                held = self._current(attempts=1)
                if held and held.get("token") != self.token:
                    reason = f"another fleetgen driver ({held.get('owner')}) took this output over"
                    self.say(f"{reason}; this run stops and leaves the output to it")
                    if self.on_lost is not None:
                        self.on_lost(reason, taken_over=True)
                    return
                self.output.put(LOCK, self._record(), attempts=1)  # the next beat is the retry
            except StorageError as err:
                if failing_since is None:
                    failing_since = time.monotonic()
                    self.say(
                        f"lock heartbeat failed ({err}); retrying every {HEARTBEAT:g} s — the lock holds "
                        f"for {STALE:g} s without one"
                    )
                elif not lost and time.monotonic() - failing_since >= STALE:
                    lost = True
                    reason = (
                        f"the output store has not taken a write for {time.monotonic() - failing_since:.0f} s ({err})"
                    )
                    self.say(f"{reason}; another driver may take this output over now")
                    if self.on_lost is not None:
                        self.on_lost(reason)
                continue
            if failing_since is not None:
                self.say(f"lock heartbeat back after {time.monotonic() - failing_since:.0f} s")
                failing_since, lost = None, False

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this driver's. A store that does not
        answer leaves it behind, said in the log: a rerun on this host takes it over at once (its
        process is gone), elsewhere after STALE seconds."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        try:
            held = self._current()
            if held and held.get("token") == self.token:
                self.output.remove(LOCK)
        except StorageError as err:
            self.say(f"{self.output.key_url(LOCK)} left behind ({err}); a rerun takes it over")

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
