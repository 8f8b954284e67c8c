"""Scoring in the generating pass (fleetgen/scores.py, workers/pipeline/scoring.py): its share of a
worker's time, and what the planner predicts it costs beside a real pipeline.

    python bench/scoring.py cpu [--rows 16] [--steps 4]
    python bench/scoring.py plans [--host-memory 64GiB]

`cpu`: one shard of a tiny SD job on this CPU with the tiny random-weight scorers (clip, aesthetic,
nsfw: real classes), the same worker code as a job: the worker's wall time, the time its scorers took
and their share. Tiny scorers beside a tiny pipeline: the share says what the pass adds per call on
this machine, not what CLIP L/14 costs beside FLUX.

`plans`: `fleetgen plan` for FLUX.1-dev at 24 GiB on an H100 and an RTX 4090, phased where predicted
faster (`--phases auto`) and per batch (`off`), without scorers and with `--score clip,aesthetic` (CLIP
ViT-L/14 twice: the aesthetic head reads its own copy): the device
bytes the scorers hold, the batch and predicted speed the pipeline keeps, the predicted scoring time per
image. Predictions only: no GPU, no weights.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu(rows: int, steps: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.scores import parse_scores
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import GenerationSettings, WorkerSpec
    from fleetgen.workers.tiny import write_tiny_model
    from fleetgen.workers.tiny.scorers import write_tiny_scorer
    from fleetgen.workers.worker import Worker

    root = Path(tempfile.mkdtemp(prefix="fleetgen-scoring-"))
    model = write_tiny_model(root / "tiny")
    scorers = ",".join(f"{k}={write_tiny_scorer(root / k, k)}" for k in ("clip", "aesthetic", "nsfw"))
    path = root / "p.parquet"
    pq.write_table(pa.table({"prompt": [f"a lighthouse at dusk, number {i}" for i in range(rows)]}), path)
    files = [read_footer(str(path))]
    print(f"tiny SD at 64x64, {steps} steps, {rows} images, batch 4, one torch thread; scorers clip, aesthetic, nsfw")
    print("| scorers | worker s | scoring s | share |")
    print("|---|---|---|---|")
    for label, score in (("none", "none"), ("clip, aesthetic, nsfw", scorers)):
        settings = GenerationSettings(
            task="text-to-image", family="sd", steps=steps, guidance=5.0, width=64, height=64, score=parse_scores(score)
        )
        spec = WorkerSpec.of(
            "w0",
            str(model),
            str(root / label.replace(", ", "-")),
            settings,
            resolve_columns(files, Columns()),
            device="cpu",
            threads=1,
            max_batch=4,
        )
        worker = Worker(spec)
        started = time.perf_counter()
        try:
            worker.run_shard(plan_shards(files, rows)[0])
            seconds = time.perf_counter() - started
            scoring = (worker.describe().get("scoring") or {}).get("seconds", 0.0)
        finally:
            worker.close()
        print(f"| {label} | {seconds:.2f} | {scoring:.2f} | {scoring / seconds:.0%} |")


def plans(host: str) -> None:
    from fleetgen.jobs.planning import PlanRequest, plan_budgets

    print(f"FLUX.1-dev at 24 GiB, host {host}")
    print(
        "| card | --phases | scorers | scorers hold | runs | batch | peak | moved/img | predicted s/img | scoring s/img |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    runs_of = [
        (c, ph, sc)
        for c in ("H100", "RTX-4090")
        for ph in ("auto", "off")
        for sc in ("none", "clip,aesthetic=head.pth")
    ]
    for card, phases, score in runs_of:
        out = plan_budgets(PlanRequest("flux.1-dev", score=score, phases=phases), ["24GiB"], host, gpu=card)
        row, scoring = out.rows[0], out.summary.get("scorers") or {}
        runs = f"phased/{row['chunk_images']}" if row.get("phases") else "per batch"
        print(
            f"| {card} | {phases} | {score.split('=')[0]} | {scoring.get('bytes', 0) / 2**30:.2f} GiB | {runs} | "
            f"{row['batch_size']} | {row['peak_bytes'] / 2**30:.1f} GiB | "
            f"{row['moved_bytes_per_image'] / 2**30:.1f} GiB | {row['predicted_seconds_per_image']:.2f} | "
            f"{scoring.get('seconds_per_image', 0):.4f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cpu")
    c.add_argument("--rows", type=int, default=16)
    c.add_argument("--steps", type=int, default=4)
    pl = sub.add_parser("plans")
    pl.add_argument("--host-memory", default="64GiB")
    args = p.parse_args()
    if args.what == "cpu":
        cpu(args.rows, args.steps)
    else:
        plans(args.host_memory)


if __name__ == "__main__":
    main()
