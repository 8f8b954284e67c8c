"""A shard's commit and a whole tiny job on each store: a local folder, S3 (moto), GCS
(fake-gcs-server) and Azure Blob (Azurite), each a real server on loopback behind tests/faulty_store.py
(faults off), in one run.

    python bench/stores.py [--images 256] [--size 60000] [--latency 0.03] [--rows 32] [--repeats 2] [--json out.json]

Commit: `--images` staged objects of `--size` bytes under a shard's staging, then the winner's
`promote` (moves to their final keys, the check that they arrived, the staging removed), timed with
the moves concurrent (as jobs run) and one by one (as before), on each store, every answer of the
store `--latency` seconds late (a cloud store's round trip; the emulators answer in a millisecond). Job: `fleetgen run` of
`--rows` rows of the tiny model (2 steps, 64x64, one worker) with its prompts read from and its
images written to each store, wall time of `run_job` (a local Ray, started once, shared by the jobs).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # as the tests (tests/conftest.py)


def stage(output, shard: str, attempt: str, images: int, size: int) -> set[str]:
    """`images` objects under the attempt's staging, written concurrently; their final keys."""
    from fleetgen.workers.output.commit import staging

    keys = [f"images/{shard}/{i:05d}.png" for i in range(images)]
    data = os.urandom(size)
    output.each(lambda k: output.put(staging(shard, attempt) + k, data), keys)
    return set(keys)


def time_commit(store, output, images: int, size: int, threads: int, label: str, latency: float) -> float:
    from fleetgen.workers.output import storage
    from fleetgen.workers.output.commit import promote

    shard = f"shard-{label}"
    named = stage(output, shard, "a1", images, size)
    if store.proxy is not None and latency:
        store.proxy.delay = latency
        store.rule("latency", times=10**9)
    saved = storage.MOVE_THREADS
    storage.MOVE_THREADS = threads
    try:
        start = time.perf_counter()
        moved = promote(output, shard, [("a1", None)], named, [f"images/{shard}"])
        took = time.perf_counter() - start
    finally:
        storage.MOVE_THREADS = saved
        if store.proxy is not None:
            store.proxy.reset()
    assert moved == images and len(output.find(f"images/{shard}")) == images
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--size", type=int, default=60_000, help="bytes per image (a 256x256 PNG is ~60-190 kB)")
    ap.add_argument("--latency", type=float, default=0.03, help="seconds each store answer is delayed in the commit")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stores", default="local,s3,gcs,azure")
    ap.add_argument("--json")
    args = ap.parse_args()

    import ray

    from fleetgen.jobs.config import JobConfig, validate
    from fleetgen.jobs.driver import run_job
    from fleetgen.workers.output.storage import Output
    from fleetgen.workers.tiny import write_tiny_model
    from tests.conftest import write_prompts
    from tests.stores import Store, planned, quiet_clients, start_local_ray

    quiet_clients()
    names = args.stores.split(",")
    stores = {n: planned(n) for n in names if n != "local"}
    for s in stores.values():
        s.set_env()
    tmp = Path(tempfile.mkdtemp(prefix="fleetgen-bench-stores-"))
    if "local" in names:
        stores = {"local": Store("local", "file", root=tmp / "local"), **stores}
    rows = []
    try:
        for s in stores.values():
            if s.name != "local":
                s.start()
        model = str(write_tiny_model(tmp / "tiny"))
        prompts = write_prompts(tmp / "p.parquet", [f"a store benchmark prompt {i}" for i in range(args.rows)])
        start_local_ray()
        for r in range(args.repeats):
            for s in stores.values():
                output = Output(s.location(f"commit-{r}"))
                concurrent = time_commit(s, output, args.images, args.size, 32, f"c{r}", args.latency)
                serial = time_commit(s, output, args.images, args.size, 1, f"s{r}", args.latency)
                url = s.location(f"job-{r}")
                source = str(prompts)
                if s.name != "local":
                    source = url.rsplit("/", 1)[0] + "/prompts.parquet"
                    s.filesystem().put_file(str(prompts), source.split("://", 1)[1])
                job = validate(
                    JobConfig.of(
                        input=source,
                        model=model,
                        output=url,
                        steps=2,
                        width=64,
                        height=64,
                        device="cpu",
                        workers=1,
                        rows_per_shard=8,
                        max_batch=4,
                    )
                )
                start = time.perf_counter()
                summary = run_job(job, progress_stream=io.StringIO())
                took = time.perf_counter() - start
                assert summary.complete and summary.images_ok == args.rows, summary
                row = {
                    "store": s.name,
                    "repeat": r + 1,
                    "commit_concurrent_s": round(concurrent, 2),
                    "commit_serial_s": round(serial, 2),
                    "job_s": round(took, 1),
                    "requests": s.proxy.counts["requests"] if s.proxy else None,
                }
                if s.proxy:
                    s.proxy.reset()
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        ray.shutdown()
        for s in stores.values():
            if s.name != "local":
                s.stop()
    print(f"\n| store | repeat | commit of {args.images} (concurrent) | one by one | job of {args.rows} rows |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['store']} | {row['repeat']} | {row['commit_concurrent_s']} s | {row['commit_serial_s']} s "
            f"| {row['job_s']} s |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
