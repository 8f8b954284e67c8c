"""Does the worker keep its device busy? Time outside the pipeline call, with a stand-in device.

A stand-in pipeline takes a fixed time per call (it sleeps, as a host thread waits for a GPU) and
returns 1024x1024 images with photo-like content (a gradient plus noise), so encoding and hashing
cost what they cost for real images. One worker generates a shard of such images into a local
output, once with encoding/hashing/storing inline on the worker's thread, once on its writer
thread (`workers/worker.py`, `WRITE_AHEAD` batches), alternating. Reported per run: images/s and
the share of the worker's time spent outside pipeline calls.

    python bench/worker_overlap.py [--images 48] [--call 1.0] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIDE = 1024
BATCH = 4


class StandIn:
    """A pipeline call of fixed duration returning photo-like images (what a GPU returns)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        rng = np.random.default_rng(0)
        ramp = np.linspace(0, 200, SIDE, dtype=np.float32)
        base = (ramp[None, :, None] + ramp[:, None, None] * 0.2) * np.ones((1, 1, 3), np.float32)
        self.frames = [
            Image.fromarray(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)) for _ in range(BATCH)
        ]

    def __call__(
        self,
        prompt,
        num_inference_steps=1,
        guidance_scale=0.0,
        width=SIDE,
        height=SIDE,
        generator=None,
        output_type="pil",
        negative_prompt=None,
    ):
        time.sleep(self.seconds)

        class Out:
            images = self.frames[: len(prompt)]

        return Out()


def run(model: str, prompts: str, out: str, call: float, depth: int) -> dict:
    from jobs.sharding import plan_shards, read_footer, resolve_columns
    from workers.shard import Columns
    from workers.spec import GenerationSettings, WorkerSpec
    from workers.worker import Worker
    from workers.writer import Writer

    files = [read_footer(prompts)]
    settings = GenerationSettings(steps=1, guidance=0.0, width=SIDE, height=SIDE)
    worker = Worker(
        WorkerSpec(
            "w0", model, out, settings, resolve_columns(files, Columns()), max_batch=BATCH, device="cpu", threads=1
        )
    )
    worker.fitted.pipe = StandIn(call)
    worker._writer = Writer(depth)
    (shard,) = plan_shards(files, 10_000)
    started = time.perf_counter()
    result = worker.run_shard(shard)
    total = time.perf_counter() - started
    inside = worker.stats["generate_seconds"]
    worker.close()
    return {
        "depth": depth,
        "images": result.ok,
        "seconds": round(total, 3),
        "images_per_s": round(result.ok / total, 3),
        "outside_share": round((total - inside) / total, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--call", type=float, default=1.0, help="seconds per pipeline call of 4 images")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    from tests.conftest import write_prompts
    from workers.tiny_model import write_tiny_model
    from workers.writer import WRITE_AHEAD

    tmp = Path(tempfile.mkdtemp(prefix="fleetgen-bench-overlap-"))
    model = str(write_tiny_model(tmp / "tiny"))
    prompts = str(write_prompts(tmp / "p.parquet", [f"image {i}" for i in range(args.images)]))
    runs = []
    for r in range(args.rounds):
        for depth in (0, WRITE_AHEAD):
            runs.append({"round": r, **run(model, prompts, str(tmp / f"out-{r}-{depth}"), args.call, depth)})
            print(json.dumps(runs[-1]), flush=True)
    inline = [x for x in runs if x["depth"] == 0]
    overlap = [x for x in runs if x["depth"] != 0]
    summary = {
        "call_seconds": args.call,
        "batch": BATCH,
        "side": SIDE,
        "images": args.images,
        "outside_share_inline": statistics.median(x["outside_share"] for x in inline),
        "outside_share_overlapped": statistics.median(x["outside_share"] for x in overlap),
        "speedup": round(
            statistics.median(o["images_per_s"] / i["images_per_s"] for i, o in zip(inline, overlap, strict=True)), 3
        ),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
