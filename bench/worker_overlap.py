"""Does the worker keep its device busy? Time outside the pipeline call, with a stand-in device.

A stand-in pipeline takes a fixed time per call (it sleeps, as a host thread waits for a GPU) and
returns 1024x1024 images with photo-like content (a gradient plus noise), so encoding and hashing
cost what they cost for real images. One worker generates a shard of such images into a local
output, once with encoding/hashing/storing inline on the worker's thread, once on its writer
thread (`workers/worker.py`, `WRITE_AHEAD` batches), alternating. Reported per run: images/s and
the share of the worker's time spent outside pipeline calls.

    python bench/worker_overlap.py [--images 48] [--call 1.0] [--rounds 2] [--json out.json]

`--video`: the stand-in returns a clip of 81 frames at 832x480 (Wan's 480p) per call, with
moving photo-like content (a textured gradient panning, what x264's motion search meets in real
footage), encoded to MP4 on the writer thread as a video job's are:

    python bench/worker_overlap.py --video --images 24 --call 2.0
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


FRAMES, VIDEO_SIZE = 81, (832, 480)


class StandIn:
    """A pipeline call of fixed duration returning photo-like images (what a GPU returns), or clips."""

    def __init__(self, seconds: float, video: bool = False):
        self.seconds, self.video = seconds, video
        rng = np.random.default_rng(0)
        if video:
            w, h = VIDEO_SIZE
            ramp = np.linspace(0, 200, w + 4 * FRAMES, dtype=np.float32)[None, :, None]
            texture = (
                ramp + np.linspace(0, 50, h, dtype=np.float32)[:, None, None] + rng.normal(0, 6, (h, w + 4 * FRAMES, 3))
            )
            texture = np.clip(texture, 0, 255).astype(np.uint8)
            self.clip = [Image.fromarray(np.ascontiguousarray(texture[:, 4 * i : 4 * i + w])) for i in range(FRAMES)]
            return
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
        num_frames=None,
    ):
        time.sleep(self.seconds)
        made = [self.clip] * len(prompt) if self.video else self.frames[: len(prompt)]

        class Out:
            images = frames = made

        return Out()


def run(model: str, prompts: str, out: str, call: float, depth: int, video: bool = False) -> dict:
    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.workers.output.writer import Writer
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import GenerationSettings, WorkerSpec
    from fleetgen.workers.worker import Worker

    files = [read_footer(prompts)]
    settings = GenerationSettings(family="sd", task="text-to-image", steps=1, guidance=0.0, width=SIDE, height=SIDE)
    if video:
        w, h = VIDEO_SIZE
        kind = {"task": "text-to-video", "family": "wan", "num_frames": FRAMES, "fps": 16.0}
        settings = GenerationSettings(steps=1, guidance=0.0, width=w, height=h, **kind)
    worker = Worker(
        WorkerSpec.of(
            "w0",
            model,
            out,
            settings,
            resolve_columns(files, Columns()),
            max_batch=1 if video else BATCH,  # a clip per call, as Wan on one GPU makes them
            device="cpu",
            threads=1,
        )
    )
    worker.fitted.pipe = StandIn(call, video)
    worker._writer = Writer(depth)
    (shard,) = plan_shards(files, 10_000)
    started = time.perf_counter()
    result = worker.run_shard(shard)
    total = time.perf_counter() - started
    inside = worker.fitted.seconds  # wall time inside pipeline calls
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
    parser.add_argument("--video", action="store_true", help="clips of 81 frames at 832x480, one per call")
    parser.add_argument("--json")
    args = parser.parse_args()
    from fleetgen.workers.output.writer import WRITE_AHEAD
    from fleetgen.workers.tiny import write_tiny_model
    from tests.conftest import write_prompts

    tmp = Path(tempfile.mkdtemp(prefix="fleetgen-bench-overlap-"))
    model = str(write_tiny_model(tmp / "tiny", family="wan" if args.video else "sd"))
    prompts = str(write_prompts(tmp / "p.parquet", [f"image {i}" for i in range(args.images)]))
    runs = []
    for r in range(args.rounds):
        for depth in (0, WRITE_AHEAD):
            out = str(tmp / f"out-{r}-{depth}")
            runs.append({"round": r, **run(model, prompts, out, args.call, depth, args.video)})
            print(json.dumps(runs[-1]), flush=True)
    inline = [x for x in runs if x["depth"] == 0]
    overlap = [x for x in runs if x["depth"] != 0]
    summary = {
        "call_seconds": args.call,
        "batch": 1 if args.video else BATCH,
        "size": f"{FRAMES} frames of {VIDEO_SIZE[0]}x{VIDEO_SIZE[1]}" if args.video else f"{SIDE}x{SIDE}",
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
