"""`fleetgen` (also `python -m jobs`): run, demo, tiny-model, status."""

from __future__ import annotations

import argparse
import sys

from fleetgen import __version__
from fleetgen.errors import FleetgenError
from workers.family_table import NO_TINY, TABLE

EXIT_INCOMPLETE = 1  # the job ran but not every shard committed
EXIT_ERROR = 2  # bad input, config or environment: nothing (more) was generated
FAILURES_SHOWN = 5  # failed shards listed on screen; summary.json has every one


def _add_run_options(p: argparse.ArgumentParser) -> None:
    # Every default is None: unset options fall through to `--config`, then to JobConfig's defaults.
    g = p.add_argument_group("job")
    g.add_argument("--input", help="Parquet file, directory or glob (any fsspec URL)")
    g.add_argument("--output", help="output location (any fsspec URL)")
    g.add_argument("--model", help="pipeline directory or hub id")
    g.add_argument("--config", help="TOML file with the same settings (command line wins)")
    g.add_argument(
        "--revision",
        help="hub model: branch, tag or commit (default main, resolved once to a commit and "
        "pinned in job.json so workers and resumes use the same weights)",
    )
    g.add_argument("--variant", help="weights variant, e.g. fp16 (loads *.fp16.safetensors)")
    g.add_argument(
        "--family",
        help="the model's entry in the family table (README), where the checkpoint does not say, e.g. "
        "z-image for the base model (default: detected from model_index.json, the transformer's config, the name)",
    )
    g = p.add_argument_group("generation (part of the job fingerprint)")
    g.add_argument(
        "--steps", type=int, help="denoising steps (default: the model family's, e.g. 30 for SD, 28 for FLUX.1-dev)"
    )
    g.add_argument(
        "--guidance",
        type=float,
        help="guidance scale (default: the model family's, e.g. 7.5 for SD, 3.5 for FLUX.1-dev)",
    )
    g.add_argument(
        "--true-cfg-scale",
        type=float,
        help="Flux: apply negative prompts with true CFG at this scale (> 1; doubles the compute)",
    )
    g.add_argument(
        "--quantize",
        help="none (default), auto (each worker's planner may quantize where that is faster or the only fit), or "
        "a format per component, e.g. transformer=fp8,text_encoder=int8 (fp8, int8, nf4, bnb-int8, gguf:PATH); "
        "changes pixels",
    )
    from workers.family_table import TASKS
    from workers.inputs import RESIZE_RULES

    g.add_argument(
        "--task",
        choices=TASKS,
        help="what the model does with each row (default: what its pipeline class does); e.g. "
        "`--task image-to-image` or `--task inpaint` on an SD directory (its weights serve both)",
    )
    g.add_argument(
        "--strength",
        type=float,
        help="image-to-image, inpaint: how far from the input, 0 to 1 (default: the task's, e.g. 0.8 for SD "
        "img2img); a `strength` column sets it per row",
    )
    g.add_argument(
        "--resize",
        choices=RESIZE_RULES,
        help="how an input image becomes the image's size: crop (default: scale to cover, cut the middle), "
        "pad (scale to fit, pad black), fit (scale to the size, aspect or not)",
    )
    g.add_argument(
        "--store-inputs",
        action="store_true",
        default=None,
        help="webdataset/parquet output: carry each image's input beside it (<id>.input.png; an "
        "`input_image` column), for before/after datasets",
    )
    g.add_argument("--width", type=int, help="pixels, multiple of 8 (default 512; video families: their card's)")
    g.add_argument("--height", type=int, help="pixels, multiple of 8 (default 512; video families: their card's)")
    g.add_argument("--seed", type=int, help="job seed (default 0)")
    g.add_argument("--image-format", choices=["png", "jpeg", "webp"], help="default png")
    from workers.video import VIDEO_FORMATS

    g.add_argument(
        "--num-frames",
        type=int,
        help="video tasks: frames per clip (default: the family's, e.g. 81 for Wan, which makes 4k+1); "
        "a `num_frames` column sets it per row",
    )
    g.add_argument(
        "--fps",
        type=float,
        help="video tasks: frames per second of the stored clip (default: the family's, e.g. 16 for Wan); an "
        "`fps` column sets it per row",
    )
    g.add_argument(
        "--video-format", choices=list(VIDEO_FORMATS), help="video tasks: mp4 (H.264, yuv420p; default) or webm (AV1)"
    )
    g.add_argument("--crf", type=int, help="video tasks: the encoder's quality, 0 (lossless) to 51; default 18")
    from workers.formats import FORMATS, format_names

    g.add_argument(
        "--output-format",
        choices=format_names(),
        help="default files; " + "; ".join(f"{name}: {FORMATS[name].description}" for name in format_names()),
    )
    g.add_argument("--prompt-column", help="default prompt")
    g.add_argument("--id-column", help="default id (used when present)")
    g.add_argument("--seed-column", help="default seed (used when present)")
    g.add_argument("--negative-prompt-column", help="default negative_prompt (used when present)")
    g.add_argument("--rows-per-shard", type=int, help="rows per shard (default 256)")
    g = p.add_argument_group("dataset synthesis (part of the job fingerprint)")
    g.add_argument(
        "--prompt-template",
        help="build each prompt from columns, e.g. 'a {style} photo of a {label}' "
        "(the manifest keeps the rendered prompt and the template)",
    )
    g.add_argument(
        "--images-per-prompt",
        type=int,
        help="images per row (default 1); ids become <id>-<k>, each with "
        "its own stable seed; a `num_images` column overrides it per row",
    )
    g.add_argument(
        "--lora",
        action="append",
        metavar="PATH_OR_ID[:SCALE]",
        help="a LoRA adapter on every image (repeatable); a row's `lora` column replaces them for that row",
    )
    g.add_argument(
        "--keep-columns",
        help="carry only these input columns into the outputs, e.g. label,style (default: every column)",
    )
    g.add_argument("--drop-columns", help="carry every input column but these")
    from workers.fields import roles

    for f in (f for f in roles() if f.setting):  # one per per-row role of the field table (workers/fields.py)
        g.add_argument(
            f"--{f.role.replace('_', '-')}-column",
            help=f"per-row {f.role.replace('_', ' ')} (default `{f.default_column}`, used when present; "
            "`none` to ignore it)",
        )
    g = p.add_argument_group("execution")
    g.add_argument(
        "--workers",
        "--max-workers",
        type=int,
        dest="max_workers",
        help="at most this many workers (default: locally one per GPU, else CPUs / --cpu-threads; "
        "on a cluster one per shard to do, up to 1000: the autoscaler adds nodes for them)",
    )
    g.add_argument(
        "--gpus-per-worker",
        type=float,
        help="Ray GPUs each worker asks for (default 1 for GPU workers; "
        "0.5 packs two on one GPU, each planning within its share)",
    )
    g.add_argument(
        "--placement-timeout",
        type=float,
        help="seconds to wait with no worker placed before giving up with exit 2 (default 300)",
    )
    g.add_argument("--cpu-threads", type=int, help="torch threads per CPU worker (default 1)")
    g.add_argument("--max-batch", type=int, help="images per pipeline call (default 4)")
    g.add_argument("--max-attempts", type=int, help="tries per shard (default 3)")
    g.add_argument("--max-restarts", type=int, help="restarts of a dead worker before it is dropped (default 3)")
    g.add_argument(
        "--stop-grace",
        type=float,
        help="seconds running shards get to commit after SIGTERM/SIGINT (default 0: abandon)",
    )
    g.add_argument(
        "--offload",
        choices=["auto", "none", "block", "leaf", "disk"],
        help="how workers place the pipeline (default auto: planned per device)",
    )
    g.add_argument(
        "--gpu-memory",
        help="device budget per worker, e.g. 24GiB (default: free memory; "
        "on CPU workers, plan as if the device had this much)",
    )
    g.add_argument(
        "--host-memory",
        help="host RAM per worker for offloaded copies (default: the node's RAM split between its workers)",
    )
    g.add_argument("--worker-memory", help="emulate a mixed fleet: one worker per budget, e.g. 16GiB,24GiB,80GiB")
    g.add_argument(
        "--device",
        help="where workers compute: auto | cpu | cuda | cuda:N (default auto: GPU workers "
        "on a cluster or a machine with GPUs, else CPU)",
    )
    g.add_argument(
        "--dtype", help="auto | float32 | float16 | bfloat16 (default auto: the family's on CUDA, float32 on CPU)"
    )
    g.add_argument("--ray-address", help="Ray cluster to join (default RAY_ADDRESS, else start a local one)")
    g.add_argument("--overwrite", action="store_true", default=None, help="replace a different job at --output")
    g.add_argument(
        "--strict-prompts",
        action="store_true",
        default=None,
        help="a prompt longer than the text encoder takes is an error row (default: truncate, noted per row)",
    )
    g.add_argument(
        "--retry-errors",
        action="store_true",
        default=None,
        help="also redo the error rows of committed shards; their ok images are kept as they are",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="allow the model repo to run its own code (off by default)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetgen", description="Bulk image generation on Ray with diffusers.")
    p.add_argument("--version", action="version", version=f"fleetgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run_options(sub.add_parser("run", help="generate images for a Parquet prompt set"))
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
    from workers.family_table import TASKS

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
    from jobs.driver import run_job

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


def _status(url: str) -> int:
    from jobs.inspect import job_state, status_text

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
            from jobs.config import make_config

            options = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
            return _run(make_config(options, args.config))
        if args.command == "demo":
            from jobs.demo import prepare

            config = prepare(args.output)
            code = _run(config)
            print(f"demo images: {config.output}/images/  (manifests: {config.output}/shards/)")
            return code
        if args.command == "tiny-model":
            from workers.families import identify_dir
            from workers.tiny_model import write_tiny_model

            path = write_tiny_model(args.dir, seed=args.seed, size=args.size, family=args.family)
            detected, why = identify_dir(path)
            hint = "" if detected.name == args.family else f"; run it with `--family {args.family}`"
            print(f"wrote {path} ({args.family}; detected as {detected.name}: {why}{hint})")
            return 0
        if args.command == "plan":
            from jobs.planning import plan_rows, plan_workload, print_plans

            work, family = plan_workload(
                args.model,
                task=args.task,
                references=args.references,
                num_frames=args.num_frames,
                width=args.width,
                height=args.height,
                steps=args.steps,
                guidance=args.guidance,
                true_cfg_scale=args.true_cfg_scale,
                max_batch=args.max_batch,
                offload=args.offload,
            )
            summary, rows = plan_rows(
                args.model,
                args.gpu_memory,
                args.host_memory,
                args.dtype or family.dtype,
                work,
                bandwidth=args.bandwidth * 1e9,
                vae_upcast=family.upcasts_vae,
                quantize=args.quantize,
            )
            summary["family"] = family.name
            print_plans(summary, rows, args.json)
            return 0 if all("error" not in r for r in rows) else EXIT_INCOMPLETE
        if args.command == "status":
            return _status(args.output)
        if args.command == "verify":
            from jobs.verify import verify

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
            from jobs.report import write_report

            print(f"wrote {write_report(args.output)}")
            return 0
    except FleetgenError as err:
        print(f"fleetgen: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    raise AssertionError(args.command)
