"""Where `make test`'s time goes: each test's start, end, pytest worker and the machine's busy and idle
CPU while it ran (from /proc/stat; Linux). A pytest plugin, then a summary:

    FLEETGEN_TIMELINE=/tmp/timeline.jsonl .venv/bin/python -m pytest -q -n 2 --dist loadgroup -p bench.suite_timeline
    .venv/bin/python bench/suite_timeline.py /tmp/timeline.jsonl

The summary gives each pytest worker's groups (its tests' summed seconds, first start and last end), the
machine's idle share over the run, and the tests during which most CPU went idle (waits: leases, stores,
nodes). The CPU figures are the whole machine's while a test ran, so tests that overlap share them.
BENCHMARKS.md ("The suite's lanes and Ray's niceness") was made with it."""

from __future__ import annotations

import json
import os
import sys
import time

_started: tuple[float, tuple[int, int]] | None = None


def _cpu() -> tuple[int, int]:
    """(busy, idle) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return user + nice + system + iowait + irq + softirq, idle


def pytest_runtest_logstart(nodeid, location):
    global _started
    _started = (time.time(), _cpu())


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get("FLEETGEN_TIMELINE")
    if not path or _started is None:
        return
    (t0, (busy0, idle0)), (busy1, idle1) = _started, _cpu()
    row = {
        "w": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "id": nodeid,
        "t0": t0,
        "t1": time.time(),
        "busy": busy1 - busy0,
        "idle": idle1 - idle0,
    }
    with open(path, "a") as f:  # one short line per write: the workers' lines never interleave
        f.write(json.dumps(row) + "\n")


def summary(rows: list[dict], top: int = 15) -> str:
    """The lanes, the idle share and the tests with the most idle CPU, as text."""
    hz = os.sysconf("SC_CLK_TCK")
    rows = [r for r in rows if r["w"] != "main"] or rows
    start, end = min(r["t0"] for r in rows), max(r["t1"] for r in rows)
    lines = [f"{len(rows)} tests in {end - start:.0f} s"]
    for w in sorted({r["w"] for r in rows}):
        groups: dict[str, list] = {}
        for r in (r for r in rows if r["w"] == w):
            grouped = "@" in r["id"] and not r["id"].endswith("]")  # xdist's `@group`, not a parameter's @
            g = groups.setdefault(r["id"].rsplit("@", 1)[1] if grouped else "(no group)", [0, 0.0, end, start])
            g[0] += 1
            g[1] += r["t1"] - r["t0"]
            g[2], g[3] = min(g[2], r["t0"]), max(g[3], r["t1"])
        lines.append(
            f"{w}: "
            + "; ".join(
                f"{k} {n} tests {s:.0f} s ({a - start:.0f}-{b - start:.0f})"
                for k, (n, s, a, b) in sorted(groups.items())
            )
        )
    # the machine's idle over the run: each moment counted once (one lane's tests do not overlap)
    lane = [r for r in rows if r["w"] == min(r["w"] for r in rows)]
    busy, idle = sum(r["busy"] for r in lane), sum(r["idle"] for r in lane)
    if busy + idle:
        lines.append(f"idle CPU while {lane[0]['w']}'s tests ran: {100 * idle / (busy + idle):.0f} %")
    lines.append(f"the {top} tests with the most idle CPU (cpu-seconds idle / busy, machine-wide):")
    for r in sorted(rows, key=lambda r: -r["idle"])[:top]:
        lines.append(f"  {r['t1'] - r['t0']:6.1f} s  idle {r['idle'] / hz:5.1f}  busy {r['busy'] / hz:6.1f}  {r['id']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary([json.loads(line) for line in open(sys.argv[1])]))
