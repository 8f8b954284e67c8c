"""Fit the planner's speed model (offload/speed.py) to the rows measured on GPUs, and say how well it
predicts them: every row measured beside predicted before the fit (the landed constants) and after
it, and a leave-one-model-out error (fit on the other models' rows, predict the held-out model's).

    python bench/fit_speed.py                 # report only
    python bench/fit_speed.py --write         # and store the fit in offload/speed.json

Rows: `bench/results/gpu-check-*.json` (`make gpu-check` on a lent GPU; each row replayed with its
own placements, batch and phases, as `fleetgen plan --placement --batch --phases` replays it), without
quantization, a step cache, compilation or an inexact attention kernel; and the published resident
timings of bench/published.py. Each row's device: the card's figures as a probe reads them
(offload/devices.py). The fit minimises the squared log of measured over predicted (scipy's
least_squares, each constant within physical bounds).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.published import CASES  # noqa: E402
from fleetgen.offload import DeviceSpec, plan  # noqa: E402
from fleetgen.offload.cost import Placement  # noqa: E402
from fleetgen.offload.devices import GPUS, LINK_EFFICIENCY, MATMUL_SHARE  # noqa: E402
from fleetgen.offload.speed import STORED, Speed  # noqa: E402
from fleetgen.units import parse_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOST = 96 * 2**30  # the GPU check's `--host-memory`
BAND = (0.77, 1.3)  # the aim: 80 % of rows within it, all within 0.5-2
# The landed model before this fit: FLOPs estimated, compute at 0.55 of the dense peak (= 0.6875 of the
# probe's matmul rate), 30 µs per blocking copy, 1 ms per forward, nothing per call.
BEFORE = Speed(0.55 / MATMUL_SHARE, 0.55 / MATMUL_SHARE, 0.55 / MATMUL_SHARE, 1.0, 30e-6, 1e-3, 0.0, 0.0)
NAMES = ("denoiser", "text", "vae", "link", "copy_seconds", "forward_seconds", "call_seconds", "image_seconds")
# Each constant within physical bounds. The encoders' and the VAE's shares at least a quarter of the matmul
# rate (their matmuls and convolutions are large; the rows, at 6 steps, cannot tell a VAE's time from an
# image's fixed cost, and left free the fit pushed the VAE to 0.09, predicting a 1024² FLUX decode at 0.9 s
# on an RTX 4090); per-copy and per-forward costs within what a launch and a sync can cost.
PEAK = 1 / MATMUL_SHARE  # a share of the probe's rate above this is above the dense peak
BOUNDS = ((0.05, PEAK), (0.25, PEAK), (0.25, PEAK), (0.1, 1.5), (1e-6, 2e-3), (1e-5, 0.05), (1e-4, 1.0), (1e-4, 1.0))


def measured_rows() -> list[dict]:
    rows = []
    for path in sorted(glob.glob(str(ROOT / "bench/results/gpu-check-*.json"))):
        data = json.loads(Path(path).read_text())
        card, settings = data["device"].replace("NVIDIA ", ""), data["settings"]
        for r in data["rows"]:
            plain = (
                r.get("modes")
                and r.get("errors") == 0
                and r.get("quantize", "none") == "none"
                and r.get("cache", "none") == "none"
                and not r.get("compile")
                and r.get("attention", "native") == "native"
            )
            if not plain:
                continue
            for i, t in enumerate(r.get("trials") or []):  # a sweep row's candidates, each timed on the device
                if t.get("measured_seconds_per_image") and not t.get("phased"):
                    rows.append(
                        {
                            "model": r["model"],
                            "run": f"{r['run']}, trial {i + 1}",
                            "gpu": card,
                            "budget": r["budget_bytes"] or GPUS[card].memory,
                            "steps": settings["steps"],
                            "size": settings["size"],
                            "modes": t["modes"],
                            "batch": t["batch_size"],
                            "phases": "off",
                            "measured": t["measured_seconds_per_image"],
                            "source": Path(path).name,
                        }
                    )
            rows.append(
                {
                    "model": r["model"],
                    "run": r["run"],
                    "gpu": card,
                    "budget": r["budget_bytes"] or GPUS[card].memory,
                    "steps": settings["steps"],
                    "size": settings["size"],
                    "modes": r["modes"],
                    "batch": r["batch"],
                    "phases": "on" if r.get("phased") else "off",
                    "measured": r["seconds_per_image"]["measured"],
                    "source": Path(path).name,
                }
            )
    return rows


def published_rows() -> list[dict]:
    return [
        {
            "model": model,
            "run": "published, all resident",
            "gpu": card,
            "budget": parse_size(budget, "budget"),
            "steps": options["steps"],
            "size": 1024,
            "modes": {},  # all resident
            "batch": options["max_batch"],
            "phases": "off",
            "measured": seconds,
            "source": source,
        }
        for model, card, budget, options, _, seconds, source in CASES
    ]


_CONTEXT: dict = {}


def _context(model: str, steps: int, size: int, batch: int, phases: str):
    """(profile, workload) of a row, built once per distinct row shape."""
    key = (model, steps, size, batch, phases)
    if key not in _CONTEXT:
        from fleetgen.jobs.planning import pipeline_profile, plan_workload

        work, family = plan_workload(
            model, steps=steps, width=size, height=size, max_batch=batch, phases=phases, dtype="auto"
        )
        prof = pipeline_profile(model, family.dtype, family.upcasts_vae, ())
        _CONTEXT[key] = (prof, work)
    return _CONTEXT[key]


def _estimated(prof):
    """The profile as the landed model saw it: FLOPs estimated (2 per parameter per token, attention beside,
    a UNet's levels weighted), not counted."""
    parts = {n: replace(c, flops_terms=()) for n, c in prof.components.items()}
    return replace(prof, components=parts, variants={})


def predict(row: dict, speed: Speed) -> float:
    prof, work = _context(row["model"], row["steps"], row["size"], row["batch"], row["phases"])
    if speed is BEFORE:
        prof = _estimated(prof)
    card = GPUS[row["gpu"]]
    device = DeviceSpec(row["budget"], HOST, card.link_gbps * 1e9 * LINK_EFFICIENCY, card.flops, True, speed=speed)
    given = {n: Placement.parse(m) for n, m in row["modes"].items()}
    return plan(prof, device, work, given=given, batch=row["batch"]).seconds_per_image


def ratios(rows: list[dict], speed: Speed) -> list[float]:
    return [r["measured"] / predict(r, speed) for r in rows]


def fit(rows: list[dict], start: Speed = BEFORE) -> Speed:
    import numpy as np
    from scipy.optimize import least_squares

    lo = np.log([b[0] for b in BOUNDS])
    hi = np.log([b[1] for b in BOUNDS])
    x0 = np.clip(np.log([max(getattr(start, n), 1e-6) for n in NAMES]), lo + 1e-6, hi - 1e-6)

    def residuals(x):
        speed = Speed(*np.exp(x))
        return np.log(ratios(rows, speed))

    found = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-3)
    return Speed(*(float(v) for v in np.exp(found.x)))


def summary(values: list[float]) -> dict:
    inside = sum(BAND[0] <= v <= BAND[1] for v in values)
    return {
        "rows": len(values),
        "within_0.77_1.3": inside,
        "share_within": round(inside / len(values), 3) if values else None,
        "all_within_0.5_2": all(0.5 <= v <= 2 for v in values),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "mean_abs_log_error": round(sum(abs(math.log(v)) for v in values) / len(values), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="store the fit in offload/speed.json")
    args = ap.parse_args()
    rows = measured_rows() + published_rows()
    fitted = fit(rows)
    before, after = ratios(rows, BEFORE), ratios(rows, fitted)
    held_out = {}
    for model in sorted({r["model"] for r in rows}):
        train = [r for r in rows if r["model"] != model]
        test = [r for r in rows if r["model"] == model]
        held_out[model] = ratios(test, fit(train, fitted))
    lomo = [v for vs in held_out.values() for v in vs]
    print(f"{len(rows)} rows; fitted: " + ", ".join(f"{n} {getattr(fitted, n):.4g}" for n in NAMES))
    print(
        f"{'model':<15}{'gpu':<11}{'run':<34}{'batch':>5}  {'measured':>8}  {'before':>6}  {'after':>6}  {'held out':>8}"
    )
    for r, b, a in zip(rows, before, after, strict=True):
        h = held_out[r["model"]][[x for x in rows if x["model"] == r["model"]].index(r)]
        print(
            f"{r['model']:<15}{r['gpu']:<11}{r['run'][:33]:<34}{r['batch']:>5}  {r['measured']:>8.3f}  "
            f"{b:>6.2f}  {a:>6.2f}  {h:>8.2f}"
        )
    report = {"before": summary(before), "after": summary(after), "leave_one_model_out": summary(lomo)}
    for name, s in report.items():
        print(f"{name}: {json.dumps(s)}")
    if args.write:
        stored = {
            "model": fitted.to_dict(),
            "errors": report,
            "rows": [
                {**r, "predicted": round(r["measured"] / a, 4), "measured_over_predicted": round(a, 3)}
                for r, a in zip(rows, after, strict=True)
            ],
        }
        STORED.write_text(json.dumps(stored, indent=1) + "\n")
        print(f"written: {STORED.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
