"""What the driver and `status` cost on a big job whose shards are all committed.

A prompt file of R rows (pyarrow's default row groups) is written, and a committed manifest for
each of its R / 256 shards (256 rows each, counts in the footer, as a worker writes them; no
images). Then, each as a fresh process, with wall time and peak RSS:
  rerun        `fleetgen run` of that job: all shards committed, so no worker starts (first run:
               counts from every manifest's footer; it writes OUT/counts.parquet)
  rerun again  the same, with the counts index current
  status       `fleetgen status OUT`, with the index; and without it (footers only); and, with
               `--before DIR`, the `status` of an earlier checkout on the same output

    python bench/scale.py [--rows 1000000 10000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROWS_PER_SHARD = 256
_FAST = ["--steps", "2", "--guidance", "5", "--width", "64", "--height", "64", "--device", "cpu"]


def write_input(path: Path, rows: int) -> None:
    prompts = pa.array(np.char.add("a photo of thing number ", np.arange(rows).astype(str)), pa.string())
    pq.write_table(pa.table({"prompt": prompts}), path)


def write_manifests(out: Path, rows: int) -> int:
    """One committed manifest per shard, like a worker's (footer counts; a template table)."""
    from jobs.sharding import plan_shards, read_footer
    from workers.commit import ATTEMPT_KEY, COUNTS_KEY
    from workers.layout import MANIFEST_SCHEMA

    shards = plan_shards([read_footer(str(out.parent / "in.parquet"))], ROWS_PER_SHARD)
    (out / "shards").mkdir(parents=True)
    template = pa.Table.from_pylist([{"id": f"{i:09d}", "row_id": f"{i:09d}", "status": "ok", "prompt": "p",
                                      "sha256": "0" * 64, "size": 1000, "image": f"images/x/{i}.png"}
                                     for i in range(ROWS_PER_SHARD)], schema=MANIFEST_SCHEMA)
    for shard in shards:
        n = shard.length
        counts = {"rows": n, "images": n, "ok": n, "error": 0, "filtered": 0}
        table = template.slice(0, n).replace_schema_metadata({ATTEMPT_KEY: b"bench", COUNTS_KEY: json.dumps(counts)})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        (out / "shards" / f"{shard.id}.parquet").write_bytes(buf.getvalue())
    return len(shards)


def timed(cmd: list[str], cwd: str | None = None) -> dict:
    """Wall time and peak RSS of a child process, sampled every 20 ms (its rusage would count this
    process's own memory at the fork)."""
    import psutil

    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=cwd)
    child, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, child.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    stdout = proc.stdout.read()
    seconds = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{cmd} failed: {stdout[-2000:]}")
    return {"seconds": round(seconds, 2), "peak_rss_mib": round(peak / 2**20),
            "last_line": stdout.strip().splitlines()[-1][:200] if stdout.strip() else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--before", help="a checkout of an earlier fleetgen: its `status` is timed on the same output")
    parser.add_argument("--json")
    args = parser.parse_args()
    from workers.tiny_model import write_tiny_model

    fleetgen = [sys.executable, "-m", "jobs"]
    results = []
    with tempfile.TemporaryDirectory(prefix="fleetgen-bench-scale-") as tmp:
        model = str(write_tiny_model(Path(tmp) / "tiny"))
        for rows in args.rows:
            root = Path(tmp) / f"r{rows}"
            root.mkdir()
            write_input(root / "in.parquet", rows)
            out = root / "out"
            started = time.perf_counter()
            shards = write_manifests(out, rows)
            setup = time.perf_counter() - started
            run = [*fleetgen, "run", "--input", str(root / "in.parquet"), "--output", str(out), "--model", model, *_FAST]
            result = {"rows": rows, "shards": shards, "setup_seconds": round(setup, 1),
                      "rerun": timed(run), "rerun_again": timed(run), "status": timed([*fleetgen, "status", str(out)])}
            (out / "counts.parquet").unlink()
            result["status_without_index"] = timed([*fleetgen, "status", str(out)])
            if args.before:  # python -m jobs run from that checkout imports its modules
                result["status_before"] = timed([*fleetgen, "status", str(out)], cwd=args.before)
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
