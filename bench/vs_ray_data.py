"""fleetgen against what users would otherwise write: Ray Data `read_parquet` → `map_batches` with
an actor pool (each actor loads the pipeline and writes PNGs) — same prompts, model, seeds, batch
size, worker count and torch threads, on one local Ray. And fleetgen as that Ray Data stage
(`fleetgen.ray_data.generate`, the same read and blocks; the driver writes each row's PNG as it arrives).

Measured per side: steady-state images/s (images after the first batch over the time after it,
from file mtimes), time to first image, and a run in which one worker process is SIGKILLed once
images appear: does it finish, are images missing or written twice, how long it took.

    python bench/vs_ray_data.py [--rows 64] [--size tiny|small] [--json out.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKERS, BATCH, STEPS = 2, 4, 8
# fleetgen's settings for both of its sides: the job's and the stage's
OPTIONS = {
    "steps": STEPS,
    "guidance": 5.0,
    "width": 64,
    "height": 64,
    "workers": WORKERS,
    "max_batch": BATCH,
    "device": "cpu",
}


class RayDataGenerator:
    """The Ray Data UDF: a callable class, one pipeline per actor; writes `<out>/images/<id>.png`."""

    def __init__(self, model: str, out: str):
        import torch

        from fleetgen.workers.pipeline.load import load_pipeline

        torch.set_num_threads(1)
        self.pipe = load_pipeline(model, torch.float32)
        self.out = Path(out)
        (self.out / "workers").mkdir(parents=True, exist_ok=True)
        (self.out / "images").mkdir(parents=True, exist_ok=True)
        (self.out / "workers" / f"{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid()}))
        self.calls = 0

    def __call__(self, batch: dict) -> dict:
        from fleetgen.workers.output.writer import encode
        from fleetgen.workers.pipeline.calls import generators
        from fleetgen.workers.rows.seeds import derive_seed

        ids = [str(i) for i in batch["id"]]
        images = self.pipe(
            prompt=list(batch["prompt"]),
            num_inference_steps=STEPS,
            guidance_scale=5.0,
            width=64,
            height=64,
            generator=generators([derive_seed(0, i) for i in ids]),
        ).images
        for row_id, image in zip(ids, images, strict=True):
            (self.out / "images" / f"{row_id}.png").write_bytes(encode(image, "png"))
        self.calls += 1
        return {"id": ids}


def ray_data_run(prompts: str, model: str, out: Path) -> dict:
    import pyarrow.parquet as pq
    import ray.data

    rows = pq.ParquetFile(prompts).metadata.num_rows
    started = time.time()
    # Blocks of 2 batches, like fleetgen's shards: without the repartition the one row group is one
    # block, and one actor would do all the work.
    ds = (
        ray.data.read_parquet(prompts)
        .repartition(-(-rows // (BATCH * 2)))
        .map_batches(
            RayDataGenerator, fn_constructor_args=(model, str(out)), batch_size=BATCH, concurrency=WORKERS, num_cpus=1
        )
    )
    ids = [r["id"] for r in ds.iter_rows()]
    return returned(started, ids)


def returned(started: float, ids: list[str]) -> dict:
    """A Ray Data side's result: its rows came back (none twice?)."""
    seconds = time.time() - started
    return {
        "started": started,
        "seconds": seconds,
        "rows_returned": len(ids),
        "rows_returned_twice": len(ids) - len(set(ids)),
        "complete": True,
    }


def stage_run(prompts: str, model: str, out: Path) -> dict:
    """`fleetgen.ray_data.generate` over the same read and blocks; each row's PNG written as it arrives
    (its actors' records at `out`, where the kill scenario finds their pids)."""
    import pyarrow.parquet as pq
    import ray.data

    import fleetgen.ray_data

    rows = pq.ParquetFile(prompts).metadata.num_rows
    started = time.time()
    ds = ray.data.read_parquet(prompts).repartition(-(-rows // (BATCH * 2)))
    ds = fleetgen.ray_data.generate(ds, model, **OPTIONS, batch_rows=BATCH * 2, stats=str(out), progress=io.StringIO())
    (out / "images").mkdir(parents=True, exist_ok=True)
    ids = []
    for row in ds.iter_rows():
        (out / "images" / f"{row['id']}.png").write_bytes(row["image"])
        ids.append(row["id"])
    return returned(started, ids)


def fleetgen_run(prompts: str, model: str, out: Path) -> dict:
    from fleetgen.jobs.config import JobConfig, validate
    from fleetgen.jobs.driver import run_job

    started = time.time()
    s = run_job(
        validate(
            JobConfig.of(
                input=prompts,
                output=str(out),
                model=model,
                **OPTIONS,
                rows_per_shard=BATCH * 2,
                id_column="id",
                max_restarts=3,
            )
        ),
        progress_stream=io.StringIO(),
    )
    return {"started": started, "seconds": time.time() - started, "complete": s.complete}


def measure(files: list[Path], started: float) -> dict:
    times = sorted(f.stat().st_mtime for f in files)
    steady = (len(times) - BATCH) / (times[-1] - times[BATCH - 1]) if len(times) > BATCH else None
    return {"images": len(times), "steady_ips": steady, "first_image_s": times[0] - started if times else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from bench.chaos import Killer
    from fleetgen.jobs.demo import write_prompts
    from fleetgen.workers.tiny import write_tiny_model

    # one CPU more than the workers: Ray Data's read tasks need one while its actors hold theirs
    ray.init(num_cpus=WORKERS + 1, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model = str(write_tiny_model(tmp / "model", size=args.size))
            prompts = str(write_prompts(tmp / "p.parquet", n=args.rows, row_group_size=args.rows))
            sides = {
                "ray_data": (ray_data_run, "images/*.png"),
                "fleetgen": (fleetgen_run, "images/*/*.png"),
                "stage": (stage_run, "images/*.png"),
            }
            for scenario in ("clean", "kill"):
                for side, (run, pattern) in sides.items():
                    out = tmp / f"{side}-{scenario}"
                    killer = Killer(out, kills=1, gap=(0.2, 0.2)) if scenario == "kill" else None
                    if killer:
                        killer.start()
                    try:
                        r = run(prompts, model, out)
                    except Exception as err:  # noqa: BLE001 - a side that fails under the fault is a result
                        r = {"started": time.time(), "complete": False, "error": f"{type(err).__name__}: {err}"[:300]}
                    if killer:
                        killer.done.set()
                        killer.join()
                        r["kills"] = len(killer.killed)
                    files = list(out.glob(pattern))
                    r.update(measure(files, r.pop("started")))
                    r["missing"] = args.rows - len({f.stem for f in files})
                    results[f"{side}/{scenario}"] = r
                    print(
                        f"{side:9s} {scenario:5s} "
                        + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
                        flush=True,
                    )
    finally:
        ray.shutdown()
    for scenario in ("clean", "kill"):
        a = results[f"ray_data/{scenario}"]
        for side in ("fleetgen", "stage"):
            b = results[f"{side}/{scenario}"]
            if a.get("steady_ips") and b.get("steady_ips"):
                print(f"{scenario}: {side}/ray_data steady images/s = {b['steady_ips'] / a['steady_ips']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
