"""`fleetgen plan --gpu NAME` beside published GPU measurements (each case names its source):
predicted peak and seconds per image against what others measured with diffusers on that card.

    python bench/published.py [--json out.json]

These rows are among those the speed model is fitted to (bench/fit_speed.py, offload/speed.json), beside
the rows measured on a GPU; the fit's leave-one-model-out error says how well a model it was not fitted
to is predicted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (model, card, budget, plan options, published peak GiB or None, published seconds per image, source)
CASES = [
    ("flux.1-dev", "H100", "80GiB", {"steps": 50, "max_batch": 1}, 36.2, 12.0, "HF blog diffusers-quantization (bf16)"),
    ("flux.1-dev", "H100", "80GiB", {"steps": 50, "max_batch": 1}, None, 9.3, "cache-dit NVIDIA_GPU.md (no cache)"),
    ("sd3-medium", "A100-80GB", "80GiB", {"steps": 28, "max_batch": 1}, 18.8, 4.8, "HF blog sd3 (all on GPU)"),
    ("sdxl", "A100-40GB", "40GiB", {"steps": 30, "max_batch": 4}, 21.7, 11.4 / 4, "HF blog simple_sdxl_optimizations"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args()
    import fleetgen

    rows = []
    for model, card, budget, options, peak, seconds, source in CASES:
        plan = fleetgen.plan(model, budget, gpu=card, host_memory="128GiB", **options).rows[0]
        predicted_peak = plan["peak_bytes"] / 2**30
        predicted = plan["predicted_seconds_per_image"]
        rows.append(
            {
                "model": model,
                "gpu": card,
                "batch": plan["batch_size"],
                "modes": plan["modes"],
                "predicted_peak_gib": round(predicted_peak, 1),
                "published_peak_gib": peak,
                "predicted_s_per_image": round(predicted, 2),
                "published_s_per_image": round(seconds, 2),
                "time_ratio": round(predicted / seconds, 2),
                "source": source,
            }
        )
    print("| model | GPU | batch | peak predicted / published | s per image predicted / published | ratio | source |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peak = f"{r['predicted_peak_gib']} / {r['published_peak_gib']} GiB" if r["published_peak_gib"] else "—"
        print(
            f"| {r['model']} | {r['gpu']} | {r['batch']} | {peak} | {r['predicted_s_per_image']} / "
            f"{r['published_s_per_image']} | {r['time_ratio']} | {r['source']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
