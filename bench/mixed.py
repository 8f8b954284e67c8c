"""A mixed dataset stays fast: per-row sizes and adapters cost (almost) nothing over uniform jobs.

The same 48 rows (prompt, id, seed) are generated three ways by one worker (tiny model, CPU, LoRA
adapters A and B loaded, batch 4):
  (a) mixed: one shard whose rows interleave 3 sizes (64, 96, 128 px wide) and 2 adapters: six
      looks, adjacent rows never share one; fleetgen groups them into batches per look;
  (b) uniform: the same rows as six uniform jobs, one per look (each a shard of one size and one
      adapter); the time is their sum;
  (c) ungrouped (reference): the mixed shard at batch 1, what running rows in input order costs
      when adjacent rows cannot share a pipeline call.
Runs alternate (a, b, c, a, b, c, ...) and ratios are taken per round, so machine noise hits all.

    python bench/mixed.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 48
SIZES = (64, 96, 128)  # widths; height 64
THREADS = 2  # the whole machine
STEPS = 4


def _write(path: Path, rows: list[dict]) -> str:
    pq.write_table(
        pa.Table.from_pylist(
            rows,
            schema=pa.schema(
                [
                    ("id", pa.string()),
                    ("prompt", pa.string()),
                    ("seed", pa.int64()),
                    ("width", pa.int32()),
                    ("lora", pa.string()),
                ]
            ),
        ),
        path,
    )
    return str(path)


def _worker(model: str, out: str, adapters: list[str], batch: int, columns):
    from fleetgen.workers.spec import GenerationSettings, WorkerSpec
    from fleetgen.workers.worker import Worker

    settings = GenerationSettings(
        family="sd", task="text-to-image", steps=STEPS, guidance=5.0, width=64, height=64, output_format="parquet"
    )
    return Worker(
        WorkerSpec.of(
            "w0",
            model,
            out,
            settings,
            columns,
            max_batch=batch,
            device="cpu",
            threads=THREADS,
            adapters=tuple((a, a) for a in adapters),
            plan_size=(max(SIZES), 64),
        )
    )


def _seconds(worker, paths: list[str], out: str) -> float:
    """Wall time to generate and commit every shard of `paths`, into a fresh output."""
    from fleetgen.jobs.sharding import plan_shards, read_footer
    from fleetgen.workers.output.storage import Output

    worker.output = Output(out)
    started = time.perf_counter()
    for shard in plan_shards([read_footer(p) for p in paths], ROWS):
        worker.run_shard(shard)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from fleetgen.jobs.sharding import read_footer, resolve_columns
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.tiny import write_tiny_lora, write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="fleetgen-bench-mixed-"))
    model = str(write_tiny_model(tmp / "tiny"))
    adapters = [str(write_tiny_lora(tmp / "loras" / f"{n}.safetensors", model, seed=i)) for i, n in enumerate("ab")]
    rows = [
        {
            "id": f"r{i:03d}",
            "prompt": f"a lighthouse number {i}",
            "seed": i,
            "width": SIZES[i % 3],
            "lora": adapters[i % 2],
        }
        for i in range(ROWS)
    ]
    mixed = _write(tmp / "mixed.parquet", rows)
    (tmp / "uniform").mkdir()
    looks = sorted({(r["width"], r["lora"]) for r in rows})
    uniform = [
        _write(tmp / "uniform" / f"{n}.parquet", [r for r in rows if (r["width"], r["lora"]) == look])
        for n, look in enumerate(looks)
    ]
    columns = resolve_columns([read_footer(mixed)], Columns.of(width="width", lora="lora"))
    grouped = _worker(model, str(tmp / "o"), adapters, 4, columns)
    single = _worker(model, str(tmp / "o"), adapters, 1, columns)
    _seconds(grouped, [mixed], str(tmp / "warm"))  # first calls at each size settle allocator and kernels

    results = []
    for r in range(args.rounds):
        t_mixed = _seconds(grouped, [mixed], str(tmp / f"mixed-{r}"))
        t_uniform = _seconds(grouped, uniform, str(tmp / f"uniform-{r}"))
        t_single = _seconds(single, [mixed], str(tmp / f"single-{r}"))
        results.append(
            {
                "mixed_s": round(t_mixed, 3),
                "uniform_s": round(t_uniform, 3),
                "ungrouped_s": round(t_single, 3),
                "mixed_vs_uniform": round(t_uniform / t_mixed, 3),
                "ungrouped_vs_uniform": round(t_uniform / t_single, 3),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    summary = {
        "rows": ROWS,
        "looks": len(looks),
        "sizes": SIZES,
        "adapters": len(adapters),
        "steps": STEPS,
        "batch": 4,
        "threads": THREADS,
        "mixed_images_per_s": round(ROWS / statistics.median(r["mixed_s"] for r in results), 2),
        "uniform_images_per_s": round(ROWS / statistics.median(r["uniform_s"] for r in results), 2),
        "mixed_vs_uniform_median": statistics.median(r["mixed_vs_uniform"] for r in results),
        "ungrouped_vs_uniform_median": statistics.median(r["ungrouped_vs_uniform"] for r in results),
        "rounds": results,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
