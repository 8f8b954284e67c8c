"""`fleetgen` (also `python -m fleetgen`): run, demo, tiny-model, status."""

from __future__ import annotations

import argparse
import sys

from fleetgen import __version__
from fleetgen.errors import FleetgenError
from fleetgen.jobs.run_options import add_run_options
from fleetgen.workers.families.table import NO_TINY, TABLE

EXIT_INCOMPLETE = 1  # the job ran but not every shard committed
EXIT_ERROR = 2  # bad input, config or environment: nothing (more) was generated
FAILURES_SHOWN = 5  # failed shards listed on screen; summary.json has every one


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetgen", description="Bulk image generation on Ray with diffusers.")
    p.add_argument("--version", action="version", version=f"fleetgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_run_options(sub.add_parser("run", help="generate images for a Parquet prompt set"))
    d = sub.add_parser("demo", help="tiny model + sample prompts + local Ray, on CPU")
    d.add_argument("--output", default="demo-output", help="directory for model, prompts and images")
    t = sub.add_parser("tiny-model", help="write a small random-weight pipeline to DIR")
    t.add_argument("dir", help="directory to write the pipeline to (created; loadable with from_pretrained)")
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    t.add_argument(
        "--size", choices=["tiny", "small"], default="tiny", help="tiny ≈ 1.7 M params, small ≈ 85 M (sd only)"
    )
    t.add_argument(
        "--family",
        choices=[f.name for f in TABLE if f.name not in NO_TINY],
        default="sd",
        help="the pipeline family to build (real diffusers classes, random weights)",
    )
    c = sub.add_parser(
        "calibrate",
        help="the job's first rows under each speed setting against the exact reference: speed, PSNR, SSIM, "
        "then the fastest within --min-psnr as a config snippet",
    )
    add_run_options(c)
    c.add_argument("--sample", type=int, default=4, help="rows of the job to make per setting (default 4)")
    c.add_argument("--min-psnr", type=float, default=30.0, help="quality floor, dB against the reference (default 30)")
    c.add_argument("--min-ssim", type=float, help="a second floor: SSIM against the reference, 0..1 (default none)")
    c.add_argument(
        "--try",
        dest="kinds",
        default="attention,compile,cache,quantize",
        help="settings to try, comma-separated (default attention,compile,cache,quantize)",
    )
    c.add_argument("--write", help="also write the chosen settings (TOML) here, for `fleetgen run --config`")
    pl = sub.add_parser("plan", help="dry run: the offload plan and batch each GPU size would get")
    pl.add_argument(
        "--model",
        required=True,
        help="shipped architecture (sd-1.5, sdxl, sd3-medium, flux.1-dev) or a pipeline directory",
    )
    pl.add_argument("--gpu-memory", action="append", required=True, help="a budget, e.g. 24GiB; repeat for more")
    pl.add_argument("--host-memory", help="host RAM per worker for offloaded copies (default 80%% of this machine's)")
    pl.add_argument("--width", type=int, help="pixels to plan for (default 1024; video families: their card's)")
    pl.add_argument("--height", type=int, help="pixels to plan for (default 1024; video families: their card's)")
    pl.add_argument("--num-frames", type=int, help="video families: frames per clip (default: the family's)")
    pl.add_argument("--steps", type=int, help="default: the model family's")
    pl.add_argument("--guidance", type=float, help="default: the model family's")
    pl.add_argument("--true-cfg-scale", type=float, help="Flux: true CFG scale (> 1 doubles the denoiser's batch)")
    pl.add_argument("--max-batch", type=int, default=8, help="largest batch the plan may choose (default 8)")
    from fleetgen.workers.families.table import TASKS

    pl.add_argument(
        "--task",
        choices=TASKS,
        help="plan for a task the model's weights serve: its input images are VAE-encoded, an edit "
        "model's join the denoiser's sequence (default: the model's own)",
    )
    pl.add_argument(
        "--references", type=int, default=1, help="edit models: input images per image to plan for (default 1)"
    )
    pl.add_argument(
        "--offload",
        choices=["auto", "none", "block", "leaf", "disk"],
        default="auto",
        help="placements the plan may use (default auto: any)",
    )
    pl.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: the model family's")
    pl.add_argument(
        "--quantize",
        default="none",
        help="none | auto | COMPONENT=FORMAT,... (fp8, int8, nf4, bnb-int8, gguf:PATH): formats to plan with",
    )
    pl.add_argument(
        "--cache",
        default="none",
        help="none | first-block[:THRESHOLD] | taylorseer[:interval=N,warmup=W,order=K] | magcache[:...]: a step "
        "cache to plan with",
    )
    pl.add_argument("--bandwidth", type=float, default=20.0, help="host→device GB/s to assume (default 20)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    s = sub.add_parser("status", help="progress of a running or finished job, from its output location")
    s.add_argument("output", metavar="OUT", help="the job's output location (`--output` of the run), any fsspec URL")
    r = sub.add_parser("report", help="write OUT/report.html: sample images, per-worker table and charts, failures")
    r.add_argument("output", metavar="OUT", help="the job's output location (`--output` of the run), any fsspec URL")
    v = sub.add_parser("verify", help="check every stored image against the manifests; find orphans and leftovers")
    v.add_argument("output", metavar="OUT", help="the job's output location (`--output` of the run), any fsspec URL")
    v.add_argument("--deep", action="store_true", help="hash every image (default: sizes, and a sample hashed)")
    v.add_argument(
        "--fix",
        action="store_true",
        help="remove orphans and leftovers; un-commit shards with missing or wrong images so that a rerun redoes them",
    )
    v.add_argument(
        "--force",
        action="store_true",
        help="with --fix: repair even when most images look missing "
        "(by default --fix then changes nothing: a wrong location is likelier than lost images)",
    )
    v.add_argument("--json", help="also write the report here")
    return p


def _run(config) -> int:
    from fleetgen.jobs.driver import run_job

    summary = run_job(config)
    filtered = f", {summary.images_filtered} filtered by the safety checker" if summary.images_filtered else ""
    print(
        f"{summary.images_ok} {summary.unit}s ({summary.images_error} row errors{filtered}) in {summary.output} "
        f"— {summary.shards_committed}/{summary.shards_total} shards committed in {summary.seconds:.1f} s"
    )
    for f in summary.failures[:FAILURES_SHOWN]:
        print(f"FAILED {f['shard']} after {f['attempts']} attempt(s): {f['error']}", file=sys.stderr)
    if len(summary.failures) > FAILURES_SHOWN:
        print(f"... and {len(summary.failures) - FAILURES_SHOWN} more (all of them in summary.json)", file=sys.stderr)
    if summary.failures:
        print(f"{len(summary.failures)} shard(s) failed; rerun the same command to retry only those.", file=sys.stderr)
    if summary.stopped:
        print("stopped before the end; rerun the same command to resume.", file=sys.stderr)
    if summary.error:
        print(f"fleetgen: error: {summary.error}", file=sys.stderr)
    return summary.exit_code


def _calibrate(args) -> int:
    import tempfile
    from pathlib import Path

    from fleetgen.jobs.calibrate import calibrate
    from fleetgen.jobs.config import make_config

    extra = ("command", "config", "sample", "min_psnr", "min_ssim", "kinds", "write")
    options = {k: v for k, v in vars(args).items() if k not in extra}
    options["output"] = options["output"] or tempfile.gettempdir()  # nothing is written there: each setting has its own
    cal = calibrate(
        make_config(options, args.config),
        sample=args.sample,
        min_psnr=args.min_psnr,
        min_ssim=args.min_ssim,
        kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
        say=lambda line: print(f"[fleetgen] {line}", file=sys.stderr, flush=True),
    )
    print(cal.table())
    print()
    print(cal.snippet(), end="")
    if args.write:
        Path(args.write).write_text(cal.snippet())
        print(f"wrote {args.write}: fleetgen run --config {args.write} --input ... --output ... --model ...")
    return 0


def _status(url: str) -> int:
    from fleetgen.jobs.status import job_state, status_text

    state = job_state(url)
    print(status_text(state))
    return 0 if state["complete"] or state["running"] else EXIT_INCOMPLETE


def main(argv: list[str] | None = None) -> int:
    try:
        parser = _parser()  # reads the field table and the formats: FLEETGEN_PLUGINS loads here
    except FleetgenError as err:
        print(f"fleetgen: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            from fleetgen.jobs.config import make_config

            options = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
            return _run(make_config(options, args.config))
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "demo":
            from fleetgen.jobs.demo import prepare

            config = prepare(args.output)
            code = _run(config)
            print(f"demo images: {config.output}/images/  (manifests: {config.output}/shards/)")
            return code
        if args.command == "tiny-model":
            from fleetgen.workers.families.detect import identify_dir
            from fleetgen.workers.tiny import write_tiny_model

            path = write_tiny_model(args.dir, seed=args.seed, size=args.size, family=args.family)
            detected, why = identify_dir(path)
            hint = "" if detected.name == args.family else f"; run it with `--family {args.family}`"
            print(f"wrote {path} ({args.family}; detected as {detected.name}: {why}{hint})")
            return 0
        if args.command == "plan":
            from fleetgen.jobs.planning import PlanRequest, plan_rows, plan_workload, print_plans

            request = PlanRequest(
                args.model,
                **{k: getattr(args, k) for k in ("width", "height", "steps", "guidance", "true_cfg_scale")},
                **{k: getattr(args, k) for k in ("max_batch", "offload", "task", "references", "num_frames")},
                cache=args.cache,
                quantize=args.quantize,
            )
            work, family = plan_workload(request)
            summary, rows = plan_rows(
                args.model,
                args.gpu_memory,
                args.host_memory,
                args.dtype or family.dtype,
                work,
                bandwidth=args.bandwidth * 1e9,
                vae_upcast=family.upcasts_vae,
            )
            summary["family"] = family.name
            print_plans(summary, rows, args.json)
            return 0 if all("error" not in r for r in rows) else EXIT_INCOMPLETE
        if args.command == "status":
            return _status(args.output)
        if args.command == "verify":
            from fleetgen.jobs.verify import verify

            report = verify(
                args.output,
                deep=args.deep,
                fix=args.fix,
                force=args.force,
                progress=lambda line: print(f"[fleetgen] {line}", file=sys.stderr, flush=True),
            )
            print(report.text())
            if args.json:
                import json
                from pathlib import Path

                Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
            return 0 if report.clean else EXIT_INCOMPLETE
        if args.command == "report":
            from fleetgen.jobs.report import write_report

            print(f"wrote {write_report(args.output)}")
            return 0
    except FleetgenError as err:
        print(f"fleetgen: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    raise AssertionError(args.command)
