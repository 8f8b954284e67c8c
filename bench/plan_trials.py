"""What plan trials (`--plan-trials`) cost on CPU, as a share of a job's shard, and what they chose.

    python bench/plan_trials.py [--rows 64] [--size tiny|small] [--steps 8] [--side 64]

One worker in this process (no Ray) on the built-in model, told it has a GPU budget (so it plans as a
GPU worker would), makes one shard of `--rows` prompts with `--plan-trials on`, then a second worker
the same shard with `--plan-trials off`: the trials' seconds (and their cap) against the shard's,
the plan each kept, and images/s of both, in one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns  # noqa: E402
from fleetgen.workers.rows.shard import Columns  # noqa: E402
from fleetgen.workers.spec import GenerationSettings, WorkerSpec  # noqa: E402
from fleetgen.workers.tiny import write_tiny_model  # noqa: E402
from fleetgen.workers.worker import Worker  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--budget", default="256MiB")
    ap.add_argument("--json")
    args = ap.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(tempfile.mkdtemp(prefix="fleetgen-trials-"))
    model = write_tiny_model(root / "model", size=args.size)
    path = root / "p.parquet"
    pq.write_table(pa.table({"prompt": [f"a lighthouse number {i}" for i in range(args.rows)]}), path)
    files = [read_footer(str(path))]
    shard = plan_shards(files, args.rows)[0]
    settings = GenerationSettings(
        family="sd", task="text-to-image", steps=args.steps, guidance=5.0, width=args.side, height=args.side, seed=0
    )
    rows = []
    for trials in ("on", "off"):
        started = time.perf_counter()
        worker = Worker(
            WorkerSpec.of(
                f"w-{trials}",
                str(model),
                str(root / f"out-{trials}"),
                settings,
                resolve_columns(files, Columns()),
                device="cpu",
                max_batch=4,
                gpu_memory=args.budget,
                plan_trials=trials,
                shard_images=args.rows,
                threads=2,
            )
        )
        start_seconds = time.perf_counter() - started
        result = worker.run_shard(shard)
        plan = worker.describe()["plan"]
        rows.append(
            {
                "trials": trials,
                "start_s": round(start_seconds, 2),
                "shard_s": round(result.seconds, 2),
                "images": result.ok,
                "images_per_s": round(result.ok / result.seconds, 3),
                "batch": plan["batch_size"],
                "chosen_by": plan["chosen_by"],
                "timed": len(plan.get("trials", [])),
                "trial_s": round(plan.get("trial_seconds") or 0.0, 2),
                "cap_s": round(plan.get("cap_seconds") or 0.0, 2),
                "predicted_s_per_img": round(plan["predicted_seconds_per_image"], 4),
                "measured": [
                    (t["batch_size"], round(t["measured_seconds_per_image"] or 0, 4)) for t in plan.get("trials", [])
                ],
            }
        )
        worker.close()
    on, off = rows
    print(f"{args.size} model, {args.side}x{args.side}, {args.steps} steps, a shard of {args.rows} rows, {args.budget}")
    for r in rows:
        print(json.dumps(r))
    share = on["trial_s"] / (on["shard_s"] + on["trial_s"])
    print(
        f"trials: {on['trial_s']} s for {on['timed']} plans (cap {on['cap_s']} s) = {share:.1%} of the shard with "
        f"them; images/s with trials' plan / the model's: {on['images_per_s'] / off['images_per_s']:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "trial_share": share}, indent=1))


if __name__ == "__main__":
    main()
