"""A worker's notice to stop: SIGTERM to its process (a Kubernetes pod's notice, a spot node's; SIGKILL
follows after the grace period). A worker running a shard in parts finishes the batch in flight,
commits what it has made as a part (workers/output/parts.py) and ends its attempt `stopped`; the
driver puts the rest of the shard back on the queue and lets the worker go. A worker with no shard
in flight, or whose shard commits whole (`--commit-interval 0`), leaves as the process would have
without us (the handler that was there before, else the default: exit)."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

NOTICE = threading.Event()  # set once the process is told to stop
_busy = threading.Event()  # an attempt that commits in parts is running: it takes the notice
_previous: list = []  # the handler SIGTERM had before `install`


def install() -> bool:
    """Take SIGTERM in this process (once; only the main thread may). False where it cannot."""
    if _previous:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _previous.append(signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGTERM, _handler)
    return True


def _handler(signum, frame) -> None:
    NOTICE.set()
    if not _busy.is_set():
        _leave(signum, frame)


def _leave(signum, frame) -> None:
    """What SIGTERM did before `install`: the previous handler, else the default (the process ends)."""
    previous = _previous[0] if _previous else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def taking_notice(parts: bool):
    """While an attempt runs: with `parts`, a notice is the attempt's to take (it commits and ends);
    without, it ends the process as before. A notice that came while idle ends it at once."""
    if NOTICE.is_set():  # told to stop before this attempt began: nothing of it is to be started
        _leave(signal.SIGTERM, None)
    if not parts:
        yield
        return
    _busy.set()
    try:
        yield
    finally:
        _busy.clear()


def told_to_stop() -> bool:
    return NOTICE.is_set()
