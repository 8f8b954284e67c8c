"""What fleetgen costs over a plain diffusers loop, on this machine's CPU.

Same model, prompts, seeds, batch size and torch threads through
  (a) plain: a fresh Python process running `DiffusionPipeline(...)` in a loop and saving PNGs;
  (b) fleetgen: `fleetgen run --workers 1` (local Ray, one actor) into a fresh output directory.
Each image's completion time is its file's mtime, for both. Steady-state images/s counts the
images after the first batch over the time after it; time to first image runs from the command's
start. Runs alternate (a, b, a, b, ...) and the ratio is taken per pair, so machine noise hits both.

    python bench/overhead.py [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# model size -> (images, batch, steps); 64x64 is the tiny models' native size
CASES = {"tiny": (48, 4, 8), "small": (12, 2, 8)}
THREADS = 2  # the whole machine, for both sides


def plain(model: str, prompts: str, out: str, batch: int, steps: int) -> None:
    """Side (a), run in its own process: the loop a user would write without fleetgen."""
    import pyarrow.parquet as pq
    import torch
    from diffusers import DiffusionPipeline

    torch.set_num_threads(THREADS)
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    rows = pq.read_table(prompts).to_pylist()
    Path(out).mkdir(parents=True)
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        gens = [torch.Generator().manual_seed(j) for j in range(i, i + len(chunk))]
        images = pipe(
            prompt=[r["prompt"] for r in chunk],
            num_inference_steps=steps,
            guidance_scale=5.0,
            width=64,
            height=64,
            generator=gens,
        ).images
        for r, image in zip(chunk, images, strict=True):
            image.save(f"{out}/{r['id']}.png")


def _rates(files: list[Path], started: float, batch: int) -> tuple[float, float]:
    times = sorted(f.stat().st_mtime for f in files)
    steady = (len(times) - batch) / (times[-1] - times[batch - 1])
    return steady, times[0] - started


def _timed(cmd: list[str], out: Path, pattern: str, batch: int, env: dict) -> tuple[float, float]:
    started = time.time()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _rates(list(out.glob(pattern)), started, batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fleetgen.jobs.demo import write_prompts
    from fleetgen.workers.tiny import write_tiny_model

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for size, (n, batch, steps) in CASES.items():
            model = str(write_tiny_model(tmp / size, size=size))
            prompts = str(write_prompts(tmp / f"{size}.parquet", n=n, row_group_size=n))
            runs = []
            for r in range(args.repeats):
                a_out, b_out = tmp / f"{size}-plain-{r}", tmp / f"{size}-fleet-{r}"
                a = _timed(
                    [sys.executable, __file__, "--plain", model, prompts, str(a_out), str(batch), str(steps)],
                    a_out,
                    "*.png",
                    batch,
                    env,
                )
                b = _timed(
                    [
                        "fleetgen",
                        "run",
                        "--input",
                        prompts,
                        "--output",
                        str(b_out),
                        "--model",
                        model,
                        "--steps",
                        str(steps),
                        "--guidance",
                        "5",
                        "--width",
                        "64",
                        "--height",
                        "64",
                        "--workers",
                        "1",
                        "--cpu-threads",
                        str(THREADS),
                        "--max-batch",
                        str(batch),
                        "--rows-per-shard",
                        str(n),
                        "--device",
                        "cpu",
                    ],
                    b_out,
                    "images/*/*.png",
                    batch,
                    env,
                )
                runs.append(
                    {
                        "plain_ips": a[0],
                        "fleetgen_ips": b[0],
                        "ratio": b[0] / a[0],
                        "plain_first_s": a[1],
                        "fleetgen_first_s": b[1],
                    }
                )
                print(f"{size} run {r}: " + "  ".join(f"{k}={v:.3f}" for k, v in runs[-1].items()), flush=True)
            results[size] = {
                "images": n,
                "batch": batch,
                "steps": steps,
                "runs": runs,
                "median_ratio": statistics.median(x["ratio"] for x in runs),
            }
            print(f"{size}: median steady-state ratio fleetgen/plain = {results[size]['median_ratio']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--plain":
        model, prompts, out, batch, steps = sys.argv[2:7]
        plain(model, prompts, out, int(batch), int(steps))
    else:
        main()
