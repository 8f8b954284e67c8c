"""Step caches on CPU: what `--cache` skips, what that buys in images/s, and what it costs in pixels.

A small FLUX.1-shaped pipeline (random weights; 4 double + 8 single blocks of width 128, at
64x64 through the tiny VAE: 256 image tokens) runs the same prompts through fleetgen's worker (`Worker.run_shard`, the
job's own path), one image per call for every setting so that only the cache differs: no cache,
First Block Cache at several thresholds, TaylorSeer. Per setting: images/s (the worker's time in
pipeline calls) as a ratio to no cache, the share of block evaluations skipped (the worker's
counts), the ratio those skips predict (no-cache time minus the skipped evaluations at the
measured seconds per block evaluation), PSNR against the uncached image of the same seed, and,
with the transformer offloaded block by block, the bytes it moved per image.

    python bench/caches.py [--images 4] [--steps 16] [--json out.json]

Settings alternate per round (`--rounds`), and the median of rounds is reported: the machine is
shared. Random weights make the tiny model's block outputs change more per step than a trained
model's, so its skips at a threshold are not a trained model's: the ratio of measured to
predicted speed-up is the figure that carries over.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Thresholds for random weights: their first block's output changes by 0.4-0.55 (relative) per step
# (measured: a trained model's changes far less, and skips at 0.05-0.1), so these sit in that range.
WORKER_THREADS = 1  # torch threads of the benchmark's workers, and of the per-block clock
SETTINGS = ("none", "first-block:0.45", "first-block:0.5", "first-block:0.6", "taylorseer:interval=3,warmup=3,order=1")


def small_flux(path: Path) -> Path:
    """The tiny FLUX.1's text encoders and VAE with a larger transformer, written to `path`."""
    import torch
    from diffusers import FluxTransformer2DModel

    from fleetgen.workers.tiny.flux import build_tiny_flux

    pipe = build_tiny_flux(0, guidance_embeds=True)
    torch.manual_seed(7)
    pipe.transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=4,
        num_single_layers=8,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[8, 12, 12],
        guidance_embeds=True,
    )
    pipe.save_pretrained(path)
    return path


def block_seconds(model: Path, steps: int, side: int) -> float:
    """Seconds per block evaluation of the transformer, clocked with torch hooks on an uncached run."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)  # clocked as the workers run (the first version clocked at 2: half the time)
    spent, started = [0.0, 0], {}
    blocks = [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]
    for b in blocks:
        b.register_forward_pre_hook(lambda m, *_: started.__setitem__(id(m), time.perf_counter()))
        b.register_forward_hook(
            lambda m, *_: (
                spent.__setitem__(0, spent[0] + time.perf_counter() - started[id(m)])
                or spent.__setitem__(1, spent[1] + 1)
            )
        )
    with torch.inference_mode():
        pipe("warm", num_inference_steps=2, height=side, width=side, output_type="np")
        spent[:] = [0.0, 0]
        pipe("a red fox", num_inference_steps=steps, height=side, width=side, output_type="np")
    torch.set_num_threads(threads)
    return spent[0] / spent[1]


def run(model: Path, prompts: Path, out: Path, cache: str, steps: int, side: int, offload: str) -> dict:
    import pyarrow.parquet as pq
    from PIL import Image

    from fleetgen.caches import parse_cache
    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import GenerationSettings, WorkerSpec
    from fleetgen.workers.worker import Worker

    files = [read_footer(str(prompts))]
    shard, columns = plan_shards(files, 1000)[0], resolve_columns(files, Columns())
    settings = GenerationSettings(
        task="text-to-image",
        steps=steps,
        guidance=3.5,
        width=side,
        height=side,
        family="flux",
        cache=parse_cache(cache),
    )
    extra = {"offload": "block", "gpu_memory": 400 << 20} if offload == "block" else {}  # the leanest plan
    spec = WorkerSpec.of(
        "w0", str(model), str(out), settings, columns, device="cpu", max_batch=1, threads=WORKER_THREADS, **extra
    )
    worker = Worker(spec)
    worker.run_shard(shard)
    info = worker.describe()
    rows = sorted(pq.read_table(out / "shards").to_pylist(), key=lambda r: r["id"])
    pixels = [np.asarray(Image.open(out / r["image"]), dtype=np.float64) for r in rows]
    moved = sum(c["bytes_onloaded"] for c in info["offload"]["components"].values())
    worker.close()
    return {
        "seconds_per_image": info["stats"]["generate_seconds"] / len(rows),
        "skipped_share": (info["cache"] or {}).get("skipped_share") or 0.0,
        "skipped": (info["cache"] or {}).get("skipped") or 0,
        "moved_per_image": moved / len(rows),
        "plan": info["plan"]["modes"]["transformer"],
        "pixels": pixels,
    }


def psnr(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    mse = statistics.fmean(float(np.mean((x - y) ** 2)) for x, y in zip(a, b, strict=True))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--side", type=int, default=64)  # the tiny VAE halves: 32x32 latents, 256 tokens
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()

    from tests.conftest import write_prompts

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = small_flux(root / "model")
        prompts = write_prompts(root / "p.parquet", [f"a photo of thing {i}" for i in range(args.images)])
        per_block = block_seconds(model, args.steps, args.side)
        runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        for r in range(args.rounds):
            for i, s in enumerate(SETTINGS):  # an output per run: a second run into one would resume it
                runs[s].append(run(model, prompts, root / f"o{r}-{i}", s, args.steps, args.side, "none"))
        moved = {
            s: run(model, prompts, root / f"b{i}", s, args.steps, args.side, "block")
            for i, s in enumerate(SETTINGS[:3])
        }
    base = statistics.median(x["seconds_per_image"] for x in runs["none"])
    rows = []
    for s in SETTINGS:
        secs = statistics.median(x["seconds_per_image"] for x in runs[s])
        first = runs[s][0]
        saved = first["skipped"] / args.images * per_block  # seconds of block evaluations skipped per image
        rows.append(
            {
                "cache": s,
                "seconds_per_image": round(secs, 4),
                "images_per_s_ratio": round(base / secs, 3),
                "skipped_share": round(first["skipped_share"], 3),
                "predicted_ratio": round(base / max(base - saved, 1e-9), 3),
                "psnr_db": round(psnr(first["pixels"], runs["none"][0]["pixels"]), 1),
                **(
                    {"block_offload_moved_per_image": int(moved[s]["moved_per_image"]), "plan": moved[s]["plan"]}
                    if s in moved
                    else {}
                ),
            }
        )
    print(
        f"seconds per block evaluation {per_block * 1e3:.2f} ms; {args.images} images, {args.steps} steps, {args.side}px"
    )
    print(
        f"{'cache':42} {'s/img':>7} {'img/s x':>8} {'skipped':>8} {'predicted x':>12} {'PSNR dB':>8} {'moved/img':>10}"
    )
    for r in rows:
        moved_text = f"{r['block_offload_moved_per_image'] / 2**20:.1f} MiB" if "plan" in r else ""
        print(
            f"{r['cache']:42} {r['seconds_per_image']:7.3f} {r['images_per_s_ratio']:8.2f} {r['skipped_share']:8.1%} "
            f"{r['predicted_ratio']:12.2f} {r['psnr_db']:8.1f} {moved_text:>10}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"per_block_seconds": per_block, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
