"""`--compile` and `--attention auto` on CPU: images/s against the uncompiled, native-kernel
reference, the pixels against its (PSNR, SSIM), and the compile seconds — measured by
`fleetgen calibrate` itself (jobs/calibrate.py: the job's own worker path, each setting a worker of
its own, the reference measured again for the noise), on the small FLUX.1-shaped pipeline of
bench/caches.py (4 double + 8 single blocks of width 128; 256 image tokens at 64x64).

    python bench/compile.py [--images 4] [--steps 16] [--threads 2] [--json out.json]

Compile seconds are inductor's, cold (a fresh cache directory per run): what a new worker pays once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the worker")
    ap.add_argument("--max-batch", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()

    from bench.caches import small_flux
    from fleetgen.jobs.calibrate import calibrate
    from fleetgen.jobs.config import make_config
    from tests.conftest import write_prompts

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")  # cold: no graph compiled before
        model = small_flux(root / "model")
        prompts = write_prompts(root / "p.parquet", [f"a photo of thing {i}" for i in range(args.images)])
        options = {"input": str(prompts), "output": str(root / "unused"), "model": str(model), "device": "cpu"}
        options.update(steps=args.steps, width=args.side, height=args.side, guidance=3.5)
        options.update(cpu_threads=args.threads, max_batch=args.max_batch)
        cal = calibrate(make_config(options), sample=args.images, min_psnr=40.0, kinds=("compile", "attention"))
    print(f"{args.images} images, {args.steps} steps, {args.side}px, batch {args.max_batch}, {args.threads} threads")
    print(cal.table())
    if args.json:
        rows = [{k: v for k, v in dataclasses.asdict(r).items()} for r in cal.results]
        Path(args.json).write_text(json.dumps({"noise": cal.noise, "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
