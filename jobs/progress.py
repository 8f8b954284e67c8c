"""Progress on screen: a live bar on a terminal, a plain line every few seconds elsewhere (as under
`ray job submit`, whose log is not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    BAR = 24  # characters

    def __init__(
        self,
        shards_total: int,
        rows_total: int,
        shards_done: int = 0,
        rows_done: int = 0,
        stream: TextIO | None = None,
        interval: float = 5.0,
        tty: bool | None = None,
        unit: str = "image",
    ):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval if not self.tty else 0.25  # seconds between redraws
        self.shards_total, self.rows_total = shards_total, rows_total
        self.shards_done, self.rows_done = shards_done, rows_done
        self._rows_at_start = rows_done  # rows/s for the ETA counts this run's rows only
        self.failed = self.errors = self.made = 0  # made: images (or clips) made by this run
        self.unit = unit  # "clip" for video tasks: seconds per clip and frames/s instead of images/s
        self.frames = 0  # frames of the clips made by this run
        self.speculated = 0  # straggling shards given to a second worker
        self.started = time.monotonic()
        self._last = float("-inf")  # the first update draws

    def start_clock(self) -> None:
        """Rates count from here (the first worker ready), not from model loading."""
        if not self.made:
            self.started = time.monotonic()

    def update(
        self, images: int = 0, errors: int = 0, shards: int = 0, failed: int = 0, rows: float = 0, frames: int = 0
    ) -> None:
        self.made += images
        self.frames += frames
        self.errors += errors
        self.rows_done += rows
        self.shards_done += shards
        self.failed += failed
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._draw(final=False)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.made / elapsed
        rows_rate = (self.rows_done - self._rows_at_start) / elapsed  # rows, not images: a row may make several
        left = self.rows_total - self.rows_done
        eta = _duration(left / rows_rate) if rows_rate > 0 and left > 0 else "-"
        if self.unit == "clip":  # minutes per clip on one GPU: seconds per clip says more than clips/s
            per = f"{elapsed / self.made:.1f} s/clip" if self.made else "- s/clip"
            speed = f"{self.made} clips  {per}  {self.frames / elapsed:.1f} frames/s"
        else:
            speed = f"{rate:.2f} img/s"
        text = (
            f"shards {self.shards_done}/{self.shards_total}  rows {int(self.rows_done)}/{self.rows_total}  "
            f"{speed}  ETA {eta}"
        )
        if self.errors or self.failed:
            text += f"  ({self.errors} row errors, {self.failed} shards failed)"
        return text

    def _draw(self, final: bool) -> None:
        if self.tty:
            frac = self.rows_done / self.rows_total if self.rows_total else 1.0
            bar = "#" * int(frac * self.BAR) + "." * (self.BAR - int(frac * self.BAR))
            self.stream.write(f"\r[{bar}] {self.line()}\x1b[K" + ("\n" if final else ""))
        else:
            self.stream.write(f"[fleetgen] {self.line()}\n")
        self.stream.flush()

    def log(self, message: str) -> None:
        """A line of its own, above the bar."""
        self.stream.write(("\r\x1b[K" if self.tty else "") + f"[fleetgen] {message}\n")
        self.stream.flush()

    def close(self) -> None:
        self._draw(final=True)
