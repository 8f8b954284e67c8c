"""How long planning takes, and what the planner predicts, for every shipped architecture.

For each architecture (config-only, on the `meta` device) and each device budget: the plan's
placements, batch, predicted peak and images/s relative to all resident, the budget that binds it,
and the seconds `plan()` took (the profile is built once per architecture, outside the timing).
The pruned search is timed against the exhaustive product it replaced where that product is small
enough to run (`--exhaustive-up-to` components, default 5). Predictions only: no GPU, no weights.

    python bench/plans.py [--host-memory 256GiB] [--budgets 16,24,48,80,141]
    python bench/plans.py --quantize [--models flux.1-dev,flux.2-dev] [--hosts 64,128]
    python bench/plans.py --video [--host-memory 128GiB]

`--video`: the shipped video architectures at their family's card (size, frames, steps), a clip per
row: placements, batch, predicted peak, clips per hour, each plan's reason (the experts and the VAE
decode), the seconds `plan()` took.

`--quantize`: per model, host budget and device budget, the plan under `--quantize none` and under
`--quantize auto` (every format the table has, as `fleetgen plan` assumes a CUDA GPU with the
packages): the formats chosen, placements, batch, predicted peak, images/s relative to all resident
unquantized, and the seconds `plan()` took.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetgen.errors import OffloadError  # noqa: E402
from fleetgen.offload import DeviceSpec, Workload, plan, profile_modules  # noqa: E402
from fleetgen.offload.architectures import HERE, NAMES, build_on_meta  # noqa: E402
from fleetgen.offload.cost import MARGIN, _options  # noqa: E402
from fleetgen.units import format_size, parse_size  # noqa: E402
from fleetgen.workers.families.detect import read_family  # noqa: E402
from fleetgen.workers.pipeline.load import DTYPES  # noqa: E402


def exhaustive_seconds(prof, device: DeviceSpec, w: Workload) -> float:
    """Seconds the exhaustive product over every component's options takes (the old search)."""
    started = time.perf_counter()
    for batch in range(1, w.max_batch + 1):
        tables = [_options(n, prof, device, w, batch) for n in prof.components]
        for combo in itertools.product(*tables):
            peak = sum(o.resident for o in combo) + max(o.phase for o in combo)
            _ = peak <= device.budget * (1 - MARGIN) and sum(o.host for o in combo) <= device.host_budget
    return time.perf_counter() - started


def quantize_table(args) -> None:
    from fleetgen.offload.weight_formats import CHOOSABLE, parse_quantize

    print("| model | host RAM | GPU | quantize | formats | offloaded | batch | peak | rel img/s | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        family = read_family(HERE / name)
        prof = profile_modules(name, build_on_meta(name), DTYPES[family.dtype], formats=CHOOSABLE)
        for host in (int(h) for h in args.hosts.split(",")):
            for gib in (int(b) for b in args.budgets.split(",")):
                for quantize in ("none", "auto"):
                    work = Workload(
                        width=args.size,
                        height=args.size,
                        steps=family.steps,
                        cfg=family.doubles_batch(family.guidance, None),
                        max_batch=args.max_batch,
                        quantize=parse_quantize(quantize),
                    )
                    started = time.perf_counter()
                    try:
                        device = DeviceSpec(budget=gib << 30, host_budget=host << 30, flops=args.flops * 1e12)
                        p = plan(prof, device, work)
                        cells = [
                            ", ".join(f"{n} {f}" for n, f in p.formats.items()) or "-",
                            ", ".join(f"{n} {m}" for n, m in p.modes.items() if m != "resident") or "-",
                            str(p.batch_size),
                            format_size(p.peak_bytes),
                            f"{p.relative_speed:.2f}",
                        ]
                    except OffloadError as err:
                        what = "nothing loads" if str(err).startswith("Nothing loads") else "nothing fits"
                        cells = [what, "", "", "", ""]
                    seconds = time.perf_counter() - started
                    print(
                        f"| {name} | {host} GiB | {gib} GiB | {quantize} | " + " | ".join(cells) + f" | {seconds:.3f} |"
                    )


def video_table(args) -> None:
    from fleetgen.jobs.planning import plan_workload
    from fleetgen.offload.architectures import pipeline_settings

    host = parse_size(args.host_memory, "--host-memory")
    print("| architecture | clip | GPU | offloaded | batch | peak | clips/h | plan s |")
    print("|---|---|---|---|---|---|---|---|")
    notes = []
    for name in [n for n in NAMES if read_family(HERE / n).video]:
        work, family = plan_workload(
            name,
            width=None,
            height=None,
            steps=None,
            guidance=None,
            true_cfg_scale=None,
            max_batch=args.max_batch,
            offload="auto",
        )
        modules = build_on_meta(name)
        prof = profile_modules(name, modules, DTYPES[family.dtype], pipeline_config=pipeline_settings(name))
        clip = f"{work.frames} x {work.width}x{work.height}, {work.steps} steps"
        for gib in (int(b) for b in args.budgets.split(",")):
            started = time.perf_counter()
            try:
                p = plan(prof, DeviceSpec(budget=gib << 30, host_budget=host, flops=args.flops * 1e12), work)
                cells = [
                    ", ".join(f"{n} {m}" for n, m in p.modes.items() if m != "resident") or "all resident",
                    str(p.batch_size),
                    format_size(p.peak_bytes),
                    f"{3600 / p.seconds_per_image:.2f}",
                ]
                notes.append(f"{name} at {gib} GiB: {p.reason}")
            except OffloadError as err:
                cells = ["nothing fits", "", "", ""]
                notes.append(f"{name} at {gib} GiB: {err}")
            print(f"| {name} | {clip} | {gib} GiB | " + " | ".join(cells) + f" | {time.perf_counter() - started:.3f} |")
    print()
    for note in notes:
        print(f"- {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host-memory", default="256GiB")
    parser.add_argument("--budgets", default="16,24,48,80,141", help="GiB")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument(
        "--exhaustive-up-to", type=int, default=5, help="components: time the old search up to this many"
    )
    parser.add_argument("--quantize", action="store_true", help="the none-vs-auto table")
    parser.add_argument("--video", action="store_true", help="the video architectures, a clip per row")
    parser.add_argument("--models", default="flux.1-dev,flux.2-dev")
    parser.add_argument("--hosts", default="64,128", help="GiB of host RAM (with --quantize)")
    parser.add_argument("--flops", type=float, default=100, help="TFLOP/s the device computes at (--quantize, --video)")
    args = parser.parse_args()
    if args.quantize:
        return quantize_table(args)
    if args.video:
        return video_table(args)
    host = parse_size(args.host_memory, "--host-memory")
    print("| architecture | components | GPU | plan | batch | peak | rel img/s | binds | plan s | exhaustive loop s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in NAMES:
        family = read_family(HERE / name)
        prof = profile_modules(name, build_on_meta(name), DTYPES[family.dtype])
        steps = family.steps
        work = Workload(
            width=args.size,
            height=args.size,
            steps=steps,
            cfg=family.doubles_batch(family.guidance, None),
            max_batch=args.max_batch,
        )
        for gib in (int(b) for b in args.budgets.split(",")):
            device = DeviceSpec(budget=gib << 30, host_budget=host)
            started = time.perf_counter()
            try:
                p = plan(prof, device, work)
                cells = [
                    ", ".join(f"{n} {m}" for n, m in p.modes.items() if m != "resident") or "all resident",
                    str(p.batch_size),
                    format_size(p.peak_bytes),
                    f"{p.relative_speed:.2f}",
                    ", ".join(p.binds) or "neither",
                ]
            except OffloadError as err:
                cells = ["nothing fits", "", "", "", "host RAM" if "host RAM binds" in str(err) else "device memory"]
            seconds = time.perf_counter() - started
            small = len(prof.components) <= args.exhaustive_up_to
            exhaustive = f"{exhaustive_seconds(prof, device, work):.2f}" if small else "-"
            print(
                f"| {name} | {len(prof.components)} | {gib} GiB | "
                + " | ".join(cells)
                + f" | {seconds:.3f} | {exhaustive} |"
            )


if __name__ == "__main__":
    main()
