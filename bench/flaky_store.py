"""Whole jobs against a flaky S3: a real S3 server (moto) behind tests/faulty_store.py, a local Ray,
the tiny model. Per scenario: requests the store saw, how many were faulted (and how), the extra
requests and wall time against a clean run of the same job, and what a check of the output found
(rows, missing, duplicates, stray objects, sha256 against the clean run, `verify --deep`).

    python bench/flaky_store.py [--rows 64] [--seeds 1,2,3] [--client-retries default|none] [--json out.json]

Scenarios: a clean run; a run at 5 % faulted requests for each seed (SlowDown 503, 500, resets
before and after the request is applied, latency, drawn alike); 30 % for a 3 s burst after the
first commit; every shard's first commit answer lost (applied, then the connection reset); the
store down after the first commit until the job stops (exit 1), then a rerun. `--client-retries
none` turns botocore's own retries off, so every fault reaches fleetgen's policy (as the tests do).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--client-retries", choices=["default", "none"], default="default")
    ap.add_argument("--scenarios", default="5pct,burst,lost-commit,outage")
    ap.add_argument("--json")
    args = ap.parse_args()
    wanted = set(args.scenarios.split(","))

    from tests.faulty_store import FaultyStore, Rule

    port = _free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(3)
    store = FaultyStore(f"http://127.0.0.1:{port}", delay=0.2).start()
    env = {
        "AWS_ENDPOINT_URL": store.endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "FLEETGEN_STORAGE_BACKOFF": "0.1",
    }
    if args.client_retries == "none":
        env["FSSPEC_S3"] = json.dumps({"config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}})
    os.environ.update(env)
    import fsspec.config

    if args.client_retries == "none":
        fsspec.config.conf["s3"] = json.loads(env["FSSPEC_S3"])
    import ray
    import s3fs

    import fleetgen.jobs.lock
    from bench.chaos import check, manifest_rows
    from fleetgen.cli import main as cli
    from fleetgen.jobs.config import JobConfig, validate
    from fleetgen.jobs.driver import run_job
    from fleetgen.workers.tiny import write_tiny_model
    from tests.conftest import FAST, write_prompts

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model = str(write_tiny_model(tmp / "model"))
            prompts = write_prompts(tmp / "p.parquet", [f"flaky store prompt {i}" for i in range(args.rows)])
            fs = s3fs.S3FileSystem()

            def job(name: str, **kw) -> JobConfig:
                fs.mkdir(name)
                return validate(
                    JobConfig.of(
                        input=str(prompts),
                        output=f"s3://{name}/out",
                        model=model,
                        rows_per_shard=8,
                        max_batch=4,
                        workers=2,
                        max_attempts=5,
                        **{**FAST, **kw},
                    )
                )

            def first_commit(bucket: str) -> None:
                direct = s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{port}", skip_instance_cache=True)
                while not direct.glob(f"{bucket}/out/shards/*.parquet"):
                    time.sleep(0.05)
                    direct.invalidate_cache()

            def record(name: str, started: float, outcome: str, out: str, clean_ids: dict, extra: dict | None = None):
                seconds = time.monotonic() - started
                counts = dict(store.counts)
                store.reset()
                found = check(out, clean_ids)
                row = {
                    "scenario": name,
                    "outcome": outcome,
                    "seconds": round(seconds, 1),
                    "requests": counts.pop("requests", 0),
                    "faulted": sum(counts.values()),
                    "faults": counts,
                    **(extra or {}),
                    **found,
                }
                results.append(row)
                print(json.dumps(row), flush=True)
                return row

            store.reset()
            started = time.monotonic()
            clean_run = run_job(job("bench-clean"), progress_stream=io.StringIO())
            clean = {r["id"]: r["sha256"] for r in manifest_rows("s3://bench-clean/out")}
            base = record(
                "clean", started, "complete" if clean_run.complete else "INCOMPLETE", "s3://bench-clean/out", clean
            )

            def versus(row: dict) -> None:
                row["extra_requests"] = row["requests"] - base["requests"]
                row["time_vs_clean"] = round(row["seconds"] / base["seconds"], 2)

            for seed in [int(s) for s in args.seeds.split(",")] if "5pct" in wanted else []:
                name = f"bench-5pct-{seed}"
                store.reset(rate=0.05, seed=seed)
                started = time.monotonic()
                summary = run_job(job(name), progress_stream=io.StringIO())
                versus(
                    record(
                        f"5 % faults, seed {seed}",
                        started,
                        "complete" if summary.complete else "INCOMPLETE",
                        f"s3://{name}/out",
                        clean,
                    )
                )

            def burst():
                first_commit("bench-burst")
                store.reset(rate=0.3, seed=7)
                time.sleep(3)
                store.rate = 0.0

            if "burst" in wanted:
                thread = threading.Thread(target=burst, daemon=True)
                thread.start()
                started = time.monotonic()
                summary = run_job(job("bench-burst"), progress_stream=io.StringIO())
                thread.join()
                versus(
                    record(
                        "30 % for 3 s",
                        started,
                        "complete" if summary.complete else "INCOMPLETE",
                        "s3://bench-burst/out",
                        clean,
                    )
                )

            if "lost-commit" in wanted:
                store.reset()
                store.add_rule(
                    Rule("reset_after", method="PUT", path="/shards/", header="If-None-Match", times=args.rows // 8)
                )
                started = time.monotonic()
                summary = run_job(job("bench-lost-commit"), progress_stream=io.StringIO())
                versus(
                    record(
                        "every commit's answer lost",
                        started,
                        "complete" if summary.complete else "INCOMPLETE",
                        "s3://bench-lost-commit/out",
                        clean,
                    )
                )
            if "outage" in wanted:
                fleetgen.jobs.lock.HEARTBEAT, fleetgen.jobs.lock.STALE = (
                    0.5,
                    10.0,
                )  # the lock's lease, shortened from 60 s
                fs.mkdir("bench-outage")
                cli_args = [
                    "run",
                    "--input",
                    str(prompts),
                    "--output",
                    "s3://bench-outage/out",
                    "--model",
                    model,
                    "--steps",
                    "2",
                    "--guidance",
                    "5",
                    "--width",
                    "64",
                    "--height",
                    "64",
                    "--device",
                    "cpu",
                    "--rows-per-shard",
                    "8",
                    "--workers",
                    "2",
                    "--max-attempts",
                    "5",
                ]

                def outage():
                    first_commit("bench-outage")
                    store.down = True

                thread = threading.Thread(target=outage, daemon=True)
                thread.start()
                started = time.monotonic()
                code = cli(cli_args)
                thread.join()
                down_seconds = time.monotonic() - started
                store.down = False
                time.sleep(
                    fleetgen.jobs.lock.STALE
                )  # this process's lock, left behind by the outage: its lease runs out
                rerun_started = time.monotonic()
                rerun = cli(cli_args)
                versus(
                    record(
                        "store down until the job stops, then a rerun",
                        started,
                        f"exit {code}, rerun exit {rerun}",
                        "s3://bench-outage/out",
                        clean,
                        {
                            "outage_run_seconds": round(down_seconds, 1),
                            "rerun_seconds": round(time.monotonic() - rerun_started, 1),
                        },
                    )
                )
    finally:
        ray.shutdown()
        store.stop()
        moto.terminate()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
