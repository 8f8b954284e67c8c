"""What the driver and `status` cost on a big job, from its start to its first dispatch and with
every shard committed.

The input is R rows in files of 1 M rows (pyarrow's default row groups: one 1 Mi-row group per
file, like a big prompt set's parts), with an `id` column; every file has the same rows (hard
links of one file: footers and row groups as real, ids repeating across files, which is allowed:
keys are shard-scoped). Each shard of 256 rows but the last has a committed manifest as a worker
writes it (counts in the footer; no images), and OUT/counts.parquet indexes them as the job's
earlier run left it. Then, each as a fresh process, with wall time and the driver's peak RSS:
  first dispatch   `fleetgen run` with one shard left: seconds until the driver hands work to the
                   pool ("N shard(s) to generate"), until the first worker is ready (local Ray
                   started, tiny model loaded), and the whole run
  rerun            `fleetgen run` again: every shard committed, no worker starts
  status           `fleetgen status OUT` with the counts index; without it (footers only) up to
                   `--footers-up-to` rows
  report           `fleetgen report OUT` (a sample of 24 manifests; the images are links here)
  verify           `fleetgen verify OUT` up to `--footers-up-to` rows: it reads every manifest (the
                   synthetic shards have no images, so it reports every one missing)
  before           with `--before DIR`, the all-committed rerun and `status` of an earlier checkout on
                   the same output (with the index)

    python bench/scale.py [--rows 1000000 10000000 100000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROWS_PER_SHARD = 256
_FAST = ["--steps", "2", "--guidance", "5", "--width", "64", "--height", "64", "--device", "cpu"]


FILE_ROWS = 1_000_000


def write_input(root: Path, rows: int) -> Path:
    """`rows` rows in files of FILE_ROWS (hard links of one file, the last one cut short)."""
    folder = root / "in"
    folder.mkdir()
    n = min(rows, FILE_ROWS)
    ids = np.arange(n).astype(str)
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "prompt": pa.array(np.char.add("a photo of thing number ", ids), pa.string()),
        }
    )
    first = folder / "part-00000.parquet"
    pq.write_table(table, first)
    for i in range(1, rows // FILE_ROWS):
        (folder / f"part-{i:05d}.parquet").hardlink_to(first)
    if rows > FILE_ROWS and rows % FILE_ROWS:
        pq.write_table(table.slice(0, rows % FILE_ROWS), folder / f"part-{rows // FILE_ROWS:05d}.parquet")
    return folder


def write_manifests(out: Path, folder: Path) -> tuple[int, str]:
    """A committed manifest per shard but the last (footer counts, like a worker's), and the counts
    index an earlier run would have left. Returns (shards, the last shard's id)."""
    from fleetgen.jobs.sharding import list_input_files, plan_shards, read_footers
    from fleetgen.jobs.state import list_manifests, write_counts_index
    from fleetgen.workers.output.commit import ATTEMPT_KEY, COUNTS_KEY
    from fleetgen.workers.output.layout import MANIFEST_SCHEMA
    from fleetgen.workers.output.storage import Output

    shards = plan_shards(read_footers(list_input_files(str(folder))), ROWS_PER_SHARD)
    (out / "shards").mkdir(parents=True)
    template = pa.Table.from_pylist(
        [
            {
                "id": f"{i:09d}",
                "row_id": f"{i:09d}",
                "status": "ok",
                "prompt": "p",
                "sha256": "0" * 64,
                "size": 1000,
                "image": f"images/x/{i}.png",
            }
            for i in range(ROWS_PER_SHARD)
        ],
        schema=MANIFEST_SCHEMA,
    )
    blobs: dict[int, bytes] = {}
    for shard in shards[:-1]:
        n = shard.length
        if n not in blobs:
            counts = {"rows": n, "images": n, "ok": n, "error": 0, "filtered": 0}
            table = template.slice(0, n).replace_schema_metadata(
                {ATTEMPT_KEY: b"bench", COUNTS_KEY: json.dumps(counts)}
            )
            buf = io.BytesIO()
            pq.write_table(table, buf)
            blobs[n] = buf.getvalue()
        (out / "shards" / f"{shard.id}.parquet").write_bytes(blobs[n])
    output = Output(str(out))
    counts = {
        s.id: {"rows": s.length, "images": s.length, "ok": s.length, "error": 0, "filtered": 0} for s in shards[:-1]
    }
    write_counts_index(output, counts, list_manifests(output))
    return len(shards), shards[-1].id


def timed(cmd: list[str], cwd: str | None = None, marks: dict[str, str] | None = None) -> dict:
    """Wall time and peak RSS of a child process (the driver alone: Ray's processes are its own),
    sampled every 20 ms (its rusage would count this process's own memory at the fork); with
    `marks`, the seconds until a line containing each mark was printed."""
    import psutil

    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    child, peak, seen, lines = psutil.Process(proc.pid), 0, {}, []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            for name, mark in (marks or {}).items():
                if name not in seen and mark in line:
                    seen[name] = round(time.perf_counter() - started, 2)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            peak = max(peak, child.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    reader.join()
    seconds = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{cmd} failed: {''.join(lines)[-2000:]}")
    return {
        "seconds": round(seconds, 2),
        "peak_rss_mib": round(peak / 2**20),
        **seen,
        "last_line": lines[-1].strip()[:200] if lines else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument(
        "--footers-up-to",
        type=int,
        default=10_000_000,
        help="time `status` without the index (one footer read per manifest) up to this many rows",
    )
    parser.add_argument(
        "--before", help="a checkout of an earlier fleetgen: its rerun and `status` are timed on the same output"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    from fleetgen.workers.tiny import write_tiny_model

    fleetgen = [sys.executable, "-m", "fleetgen"]
    results = []
    with tempfile.TemporaryDirectory(prefix="fleetgen-bench-scale-") as tmp:
        model = str(write_tiny_model(Path(tmp) / "tiny"))
        for rows in args.rows:
            root = Path(tmp) / f"r{rows}"
            root.mkdir()
            started = time.perf_counter()
            folder = write_input(root, rows)
            out = root / "out"
            shards, last = write_manifests(out, folder)
            setup = time.perf_counter() - started
            run = [*fleetgen, "run", "--input", str(folder), "--output", str(out), "--model", model, *_FAST]
            result = {
                "rows": rows,
                "shards": shards,
                "setup_seconds": round(setup, 1),
                "first_dispatch": timed(
                    run, marks={"to_dispatch": "shard(s) to generate", "to_first_worker_ready": " ready "}
                ),
            }
            assert (out / "shards" / f"{last}.parquet").exists(), ("the last shard was not generated", result)
            result["rerun"] = timed(run)
            result["status"] = timed([*fleetgen, "status", str(out)])
            if args.before:  # python -m fleetgen run from that checkout imports its modules
                result["rerun_before"] = timed(run, cwd=args.before)
                result["status_before"] = timed([*fleetgen, "status", str(out)], cwd=args.before)
            result["report"] = timed([*fleetgen, "report", str(out)])
            if rows <= args.footers_up_to:  # verify reads every manifest (and finds every image missing here)
                result["verify"] = timed([*fleetgen, "verify", str(out)])
            if rows <= args.footers_up_to:
                (out / "counts.parquet").unlink()
                result["status_without_index"] = timed([*fleetgen, "status", str(out)])
            results.append(result)
            print(json.dumps(result), flush=True)
            shutil.rmtree(root)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
