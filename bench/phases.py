"""Phased against per batch (offload/phasing.py): what the planner predicts, and one CPU run.

    python bench/phases.py plans [--host-memory 128GiB]
    python bench/phases.py cpu [--rows 16] [--steps 4]

`plans`: for FLUX.2 dev, FLUX.2 klein 4B, Qwen-Image, Z-Image-Turbo and Wan 2.2 (T2V A14B) at
12/16/24/48/80 GiB on an H100 and an RTX 4090 (their throughput and link: offload/devices.py),
the per-batch plan beside the phased one: predicted images/s (clips/h for Wan) and bytes moved per
image, and which `auto` picks. Predictions only: no GPU, no weights.

`cpu`: one tiny FLUX.1 job on this CPU, its text encoder and transformer given weight-sized
buffers (64 and 48 MiB: the 2026 models' encoders and denoisers are both large), at a budget where
per batch must offload the text encoder and phased need not; the same worker code, `--phases off`
then `auto`, in one run: measured images/s, bytes onloaded per image, the text encoder's onloads.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetgen.errors import OffloadError  # noqa: E402
from fleetgen.offload import DeviceSpec, plan  # noqa: E402
from fleetgen.offload.cost import MARGIN  # noqa: E402
from fleetgen.offload.devices import gpu  # noqa: E402
from fleetgen.offload.planner import per_batch_plan  # noqa: E402
from fleetgen.units import format_size, parse_size  # noqa: E402

MODELS = ("flux.2-dev", "flux.2-klein-4b", "qwen-image", "z-image-turbo", "wan2.2-t2v-a14b")
BUDGETS = (12, 16, 24, 48, 80)
CARDS = ("H100", "RTX-4090")


def plans_table(host: int) -> None:
    from fleetgen.jobs.planning import pipeline_profile, plan_workload
    from fleetgen.offload.profiles import DTYPE_BYTES

    print(f"host RAM {format_size(host)} per worker; 1024² (Wan: its card's clip), the family's steps, max batch 4\n")
    print("| model | GPU | memory | per batch: img/s | moved/img | phased: img/s | moved/img | chunk | auto picks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        work, family = plan_workload(name, max_batch=4)
        dtype = family.dtype if family.dtype in DTYPE_BYTES else "bfloat16"
        prof = pipeline_profile(name, dtype, family.upcasts_vae, ())
        rate = (lambda s: f"{3600 / s:.1f} clips/h") if work.frames else (lambda s: f"{1 / s:.3f}")
        for card in CARDS:
            g = gpu(card)
            for gib in BUDGETS:
                device = DeviceSpec(budget=gib << 30, host_budget=host, bandwidth=g.bandwidth, flops=g.flops)
                cells = []
                for p in _plans(prof, device, work):
                    cells += ["—", "—"] if p is None else [rate(p.seconds_per_image), format_size(p.moved_per_image)]
                try:
                    chosen = plan(prof, device, work)
                    picks = "phased" if chosen.phases else "per batch"
                    chunk = str(chosen.chunk) if chosen.phases else "—"
                except OffloadError:
                    picks, chunk = "nothing fits", "—"
                print(f"| {name} | {card} | {gib} GiB | " + " | ".join(cells) + f" | {chunk} | {picks} |")


def _plans(prof, device, work):
    out = []
    try:
        out.append(per_batch_plan(prof, device, work))
    except OffloadError:
        out.append(None)
    try:
        phased = plan(prof, device, replace(work, phases="on"))
        out.append(phased if phased.phases else None)
    except OffloadError:
        out.append(None)
    return out


def cpu_run(rows: int, steps: int) -> None:
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from fleetgen.jobs.sharding import plan_shards, read_footer, resolve_columns
    from fleetgen.offload import profile_pipeline
    from fleetgen.workers.rows.shard import Columns
    from fleetgen.workers.spec import GenerationSettings, WorkerSpec
    from fleetgen.workers.tiny.registry import TINY_FAMILIES
    from fleetgen.workers.worker import Worker

    pipe = TINY_FAMILIES["flux"](0)
    for name, size in {"text_encoder": 64 << 20, "transformer": 48 << 20}.items():
        getattr(pipe, name).register_buffer("ballast", torch.zeros(size // 4), persistent=False)
    settings = GenerationSettings(
        task="text-to-image", family="flux", steps=steps, guidance=3.5, width=64, height=64, output_format="files"
    )
    work = settings.workload(1)
    roomy = DeviceSpec(budget=1 << 40, host_budget=1 << 34, streams=False)
    prof = profile_pipeline(pipe, "tiny")
    whole = plan(prof, roomy, replace(work, phases="off")).peak_bytes
    phased = plan(prof, roomy, replace(work, phases="on")).peak_bytes
    budget = int((whole + phased) / 2 / (1 - MARGIN))  # between the two: per batch must offload
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.parquet"
        pq.write_table(pa.table({"prompt": [f"a lighthouse, number {i}" for i in range(rows)]}), path)
        files = [read_footer(str(path))]
        print(f"tiny FLUX.1, {rows} images at 64x64, {steps} steps, batch 1, budget {format_size(budget)}, CPU\n")
        print("| phases | plan | images/s | onloaded/img | text encoder onloads | prompts encoded |")
        print("|---|---|---|---|---|---|")
        results = {}
        for phases in ("off", "auto"):
            spec = WorkerSpec.of(
                "w0", "tiny", f"{tmp}/{phases}", settings, resolve_columns(files, Columns()),
                max_batch=1, device="cpu", threads=1, gpu_memory=budget, phases=phases,
            )  # fmt: skip
            worker = Worker(spec, pipe)
            started = time.perf_counter()
            worker.run_shard(plan_shards(files, rows)[0])
            seconds = time.perf_counter() - started
            info = worker.describe()
            worker.close()
            onloaded = sum(c["bytes_onloaded"] for c in info["offload"]["components"].values())
            te = info["offload"]["components"].get("text_encoder", {}).get("onloads", 0)
            modes = ", ".join(f"{n} {m}" for n, m in info["plan"]["modes"].items() if m != "resident") or "all resident"
            label = "phased" if info["plan"].get("phases") else "per batch"
            encoded = info["phases"]["prompts_encoded"] if info["phases"] else rows
            results[phases] = rows / seconds
            print(
                f"| {phases} | {label}: {modes} | {rows / seconds:.2f} | {format_size(onloaded // rows)} | {te} | {encoded} |"
            )
        print(f"\nphased / per batch images/s: {results['auto'] / results['off']:.2f}x (one run, this machine)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("plans")
    p.add_argument("--host-memory", default="128GiB")
    c = sub.add_parser("cpu")
    c.add_argument("--rows", type=int, default=16)
    c.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if args.what == "plans":
        plans_table(parse_size(args.host_memory, "--host-memory"))
    else:
        cpu_run(args.rows, args.steps)


if __name__ == "__main__":
    main()
