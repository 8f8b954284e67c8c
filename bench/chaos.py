"""Kill workers at random moments during a job and check nothing is lost or duplicated.

    python bench/chaos.py [--rows 160] [--kills 4] [--seed 0] [--json out.json]

Runs the job once clean and once while a killer thread SIGKILLs a random worker process (the pid
each worker writes to OUT/workers/<name>.json) at random moments; then compares: every id present
exactly once, no stray objects, sha256 of every image equal to the clean run. Uses a local Ray.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Killer(threading.Thread):
    """SIGKILLs a random live worker `kills` times, once images have started to appear: each kill a
    random `gap` (seconds) after a worker was last seen alive, so that a kill never waits out a gap
    while every worker is restarting (a job whose work is short could end in it). Records what it
    killed, and how many shards had been committed then."""

    POLL = 0.05  # seconds between looks for a live worker while none is

    def __init__(self, out: Path, kills: int, gap: tuple[float, float] = (0.5, 2.0), seed: int = 0):
        super().__init__(daemon=True)
        self.out, self.kills, self.gap, self.rng = out, kills, gap, random.Random(seed)
        self.killed: list[dict] = []
        self.done = threading.Event()

    def _live(self) -> dict[str, int]:
        """The workers' pids (OUT/workers/<name>.json, written by each process once loaded), less the killed."""
        pids = {}
        for f in (self.out / "workers").glob("*.json"):
            try:
                pids[f.stem] = json.loads(f.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                continue
        killed = {k["pid"] for k in self.killed}
        return {w: p for w, p in pids.items() if p not in killed}

    def run(self) -> None:
        from fleetgen.jobs.state import committed_shards
        from fleetgen.workers.output.storage import Output

        while not self.done.is_set() and not any((self.out / "images").rglob("*.*")):
            time.sleep(self.POLL)
        while len(self.killed) < self.kills:
            while not self._live():
                if self.done.wait(self.POLL):
                    return
            if self.done.wait(self.rng.uniform(*self.gap)):
                return
            pids = self._live()
            if not pids:
                continue
            worker = self.rng.choice(sorted(pids))
            try:
                os.kill(pids[worker], signal.SIGKILL)
            except ProcessLookupError:
                continue
            shards = len(committed_shards(Output(str(self.out))))
            self.killed.append(
                {"worker": worker, "pid": pids[worker], "at": time.monotonic(), "time": time.time(), "shards": shards}
            )


class Signaller(threading.Thread):
    """Sends `sig` to worker w0 of a one-shard job (files output, local) once `parts` parts of the shard
    are committed and `since` images made after them are stored in its staging; records the rows its
    parts held then, the images made since, and whether the shard's manifest was there yet. With
    `parts` 0 (whole-shard commits): once `since` images are stored. `stored`: and once the images in
    parts and since are that many at least (a kill at the same point of a job, whatever it commits).
    tests/e2e/test_parts_jobs.py, bench/parts.py."""

    def __init__(self, out, sig: int, parts: int, since: int = 0, stored: int = 0):
        super().__init__(daemon=True)
        self.out, self.sig, self.parts, self.since, self.stored = out, sig, parts, since, stored
        self.sent: dict | None = None
        self.seen = None  # (rows in parts, images since) at the last look
        self.done = threading.Event()

    def run(self) -> None:
        from fleetgen.workers.output.parts import chain_end
        from fleetgen.workers.output.storage import Output

        output = Output(str(self.out))
        while not self.done.wait(0.01):
            if len(list((self.out / "parts" / "shard-00000").glob("*.parquet"))) < self.parts:
                continue
            try:  # a listing may meet a file renamed or removed as it reads
                rows = chain_end(output, "shard-00000")
                since = len(list((self.out / "_attempts" / "shard-00000").rglob("*.png"))) - rows
                pid = json.loads((self.out / "workers" / "w0.json").read_text())["pid"]
            except (OSError, ValueError):
                continue
            self.seen = (rows, since)
            if since < self.since or rows + since < self.stored:
                continue
            os.kill(pid, self.sig)
            committed = (self.out / "shards" / "shard-00000.parquet").exists()
            self.sent = {"pid": pid, "rows": rows, "since": since, "committed": committed}
            return


def manifest_rows(out: Path | str) -> list[dict]:
    """Every committed manifest's rows, local or on an object store."""
    from fleetgen.jobs.state import list_manifests, read_manifests
    from fleetgen.workers.output.storage import Output

    output = Output(str(out))
    manifests = read_manifests(output, sorted(list_manifests(output)), ["id", "status", "sha256", "image"])
    return [r for rows in manifests.values() for r in rows]


# What fleetgen keeps under OUT besides the images and data objects its manifests name.
_BOOKKEEPING = (
    "job.json",
    "summary.json",
    "_SUCCESS",
    "fleet.json",
    "README.md",
    "counts.parquet",
    "wids-index.json",
    "report.html",
)


def check(out: Path | str, clean: dict[str, str]) -> dict:
    """The manifests against a clean run's, and every stored object against the manifests
    (`fleetgen verify --deep`): every row exactly once, no object that no manifest names (staging
    included), no half-written temporary file. Local paths and object stores alike."""
    from fleetgen.jobs.verify import verify
    from fleetgen.workers.output.storage import TMP_MARK, Output

    rows = manifest_rows(out)
    verified = verify(str(out), deep=True)
    ids = [r["id"] for r in rows]
    keys = Output(str(out)).find("")
    named = {r["image"] for r in rows if r["image"]}
    stray = [
        k
        for k in keys
        if k not in named and k not in _BOOKKEEPING and TMP_MARK not in k and not k.startswith(("shards/", "workers/"))
    ]
    return {
        "rows": len(rows),
        "missing": len(set(clean) - set(ids)),
        "duplicates": len(ids) - len(set(ids)),
        "stray_objects": len(stray),
        "sha_mismatches": sum(clean.get(r["id"]) != r["sha256"] for r in rows),
        "tmp_files": sum(TMP_MARK in k for k in keys),  # half-written files of killed writers, anywhere
        "verify_deep": "clean" if verified.clean else verified.counts,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=160)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from fleetgen.jobs.config import JobConfig, validate
    from fleetgen.jobs.driver import run_job
    from fleetgen.workers.tiny import write_tiny_model
    from tests.conftest import FAST, write_prompts

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model = str(write_tiny_model(tmp / "model"))
            prompts = str(write_prompts(tmp / "p.parquet", [f"chaos prompt {i}" for i in range(args.rows)]))

            def job(out: Path):
                return validate(
                    JobConfig.of(
                        input=prompts,
                        output=str(out),
                        model=model,
                        rows_per_shard=8,
                        max_batch=4,
                        workers=2,
                        max_attempts=10,
                        max_restarts=args.kills + 1,
                        **FAST,
                    )
                )

            clean_run = run_job(job(tmp / "clean"), progress_stream=io.StringIO())
            clean = {r["id"]: r["sha256"] for r in manifest_rows(tmp / "clean")}
            killer = Killer(tmp / "chaos", args.kills, seed=args.seed)
            killer.start()
            chaos_run = run_job(job(tmp / "chaos"), progress_stream=io.StringIO())
            killer.done.set()
            killer.join()
            result = {
                "rows": args.rows,
                "kills": len(killer.killed),
                "complete": chaos_run.complete,
                "clean_seconds": clean_run.seconds,
                "chaos_seconds": chaos_run.seconds,
                "seconds_per_kill": (chaos_run.seconds - clean_run.seconds) / max(1, len(killer.killed)),
                **check(tmp / "chaos", clean),
            }
    finally:
        ray.shutdown()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
