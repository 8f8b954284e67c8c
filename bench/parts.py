"""Commits inside a shard (workers/output/parts.py): what a killed worker costs, and what a part costs.

Redone: a one-shard job of `--rows` rows (the tiny model, `--steps` steps, batches of 2, one worker,
a local Ray) whose worker is SIGKILLed once `--kill-after` of its images are stored (committed in parts
or waiting in its staging); the images the job made twice (`summary.json`'s `images_redone`), with whole-shard commits (`--commit-interval 0`)
and with parts every `--interval` seconds, in one run.

Part cost: one shard of `--shard-rows` rows made in this process (no Ray) on each store (a local
folder, S3 (moto), GCS (fake-gcs-server), Azure (Azurite), behind tests/faulty_store.py with every
answer `--latency` seconds late), committed whole and then in parts at every batch: the store's
requests and the shard's wall time, and what each part added.

    python bench/parts.py [--rows 48] [--kill-after 13,20,27] [--interval 1] [--stores local,s3,gcs,azure] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def redone(model: str, tmp: Path, rows: int, steps: int, kill_after: int, interval: float) -> dict:
    """A job whose worker is SIGKILLed once `kill_after` images are stored: what it made twice."""
    from bench.chaos import Signaller
    from fleetgen.jobs.driver import run_job
    from tests.conftest import make_job, write_prompts

    prompts = write_prompts(tmp / "p.parquet", [f"a parts benchmark prompt {i}" for i in range(rows)])
    out = tmp / f"redone-{kill_after}-{interval}"
    # at the same point of the job either way: once `kill_after` images are stored, in parts or not
    signaller = Signaller(out, signal.SIGKILL, parts=0, stored=kill_after)
    signaller.start()
    job = make_job(
        prompts, model, out, rows_per_shard=rows, max_batch=2, steps=steps, commit_interval=interval, cpu_threads=1
    )
    start = time.perf_counter()
    summary = run_job(job, progress_stream=io.StringIO())
    signaller.done.set()
    signaller.join()
    assert summary.complete and summary.images_ok == rows, summary
    sent = signaller.sent or {}
    return {
        "commit_interval_s": interval,
        "killed_at_stored": kill_after,
        "rows_in_parts_at_kill": sent.get("rows", 0),
        "stored_since_last_part_at_kill": sent.get("since"),
        "images_redone": summary.images_redone,
        "job_s": round(time.perf_counter() - start, 1),
    }


def part_cost(store, model: str, tmp: Path, rows: int, latency: float) -> dict:
    """One shard on `store`, whole then in parts at every batch (of 2): requests and seconds each."""
    from fleetgen.workers.output.storage import Output
    from tests.conftest import setup_job

    prompts = [f"a parts store prompt {i}" for i in range(rows)]
    out = {}
    for mode, interval in (("whole", 0.0), ("parts", 1e-6)):
        url = store.location(f"parts-{mode}")
        (tmp / mode).mkdir(exist_ok=True)
        worker, shards = setup_job(
            tmp / mode, model, url, "files", prompts, max_batch=2, shard_rows=rows, commit_interval=interval
        )
        shard = shards[0]
        if store.proxy is not None:
            store.proxy.reset()
            store.proxy.delay = latency
            store.rule("latency", times=10**9)
        start = time.perf_counter()
        result = worker.run_shard(shard)
        took = time.perf_counter() - start
        requests = store.proxy.counts["requests"] if store.proxy is not None else None
        if store.proxy is not None:
            store.proxy.reset()
        worker.close()
        assert result.counts["ok"] == shard.length and Output(url).exists("shards/shard-00000.parquet")
        out[mode] = (took, requests, shard.length)
    parts = out["parts"][2] // 2 - 1  # a part per batch of 2 but the last, which the manifest commits
    whole, split = out["whole"], out["parts"]
    return {
        "store": store.name,
        "rows": whole[2],
        "parts": parts,
        "whole_s": round(whole[0], 2),
        "in_parts_s": round(split[0], 2),
        "per_part_s": round((split[0] - whole[0]) / parts, 3),
        "whole_requests": whole[1],
        "in_parts_requests": split[1],
        "per_part_requests": round((split[1] - whole[1]) / parts, 1) if whole[1] is not None else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-after", default="13,20,27", help="kill points, images stored (comma-separated)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--shard-rows", type=int, default=16, help="rows of the shard whose parts are timed")
    ap.add_argument("--latency", type=float, default=0.03)
    ap.add_argument("--stores", default="local,s3,gcs,azure")
    ap.add_argument("--json")
    args = ap.parse_args()

    import ray

    from fleetgen.workers.tiny import write_tiny_model
    from tests.stores import Store, planned, quiet_clients, start_local_ray

    quiet_clients()
    tmp = Path(tempfile.mkdtemp(prefix="fleetgen-bench-parts-"))
    model = str(write_tiny_model(tmp / "tiny"))
    results: dict = {"redone": [], "part_cost": []}
    start_local_ray()
    try:
        for kill_after in map(int, args.kill_after.split(",")):
            for interval in (0.0, args.interval):
                row = redone(model, tmp, args.rows, args.steps, kill_after, interval)
                results["redone"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        ray.shutdown()
    names = args.stores.split(",")
    stores = {n: planned(n) for n in names if n != "local"}
    for s in stores.values():
        s.set_env()
    if "local" in names:
        stores = {"local": Store("local", "file", root=tmp / "local"), **stores}
    try:
        for s in stores.values():
            if s.name != "local":
                s.start()
            (tmp / s.name).mkdir()
            row = part_cost(s, model, tmp / s.name, args.shard_rows, args.latency)
            results["part_cost"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        for s in stores.values():
            if s.name != "local":
                s.stop()
    print("\n| killed once stored | commit | rows in parts at the kill | images redone |")
    print("|---|---|---|---|")
    for r in results["redone"]:
        what = f"parts every {r['commit_interval_s']:g} s" if r["commit_interval_s"] else "whole shard"
        print(f"| {r['killed_at_stored']} | {what} | {r['rows_in_parts_at_kill']} | {r['images_redone']} |")
    print("\n| store | shard whole | in parts | per part | requests whole | in parts | per part |")
    print("|---|---|---|---|---|---|---|")
    for r in results["part_cost"]:
        print(
            f"| {r['store']} | {r['whole_s']} s | {r['in_parts_s']} s | {r['per_part_s']} s | {r['whole_requests']} "
            f"| {r['in_parts_requests']} | {r['per_part_requests']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
