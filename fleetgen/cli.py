"""`fleetgen` (also `python -m fleetgen`): run, demo, tiny-model, calibrate, plan, status, report,
verify, score — a thin layer over the Python API (fleetgen/api.py): parse the options, call the API,
print, exit 0 (done), 1 (incomplete: a rerun resumes) or 2 (bad input, config or environment).
`fleetgen run`'s options are the job's settings table (jobs/config.py `job_settings`)."""

from __future__ import annotations

import argparse
import sys

import fleetgen
from fleetgen import __version__
from fleetgen.errors import FleetgenError

EXIT_INCOMPLETE = 1  # the job ran but not every shard committed
EXIT_ERROR = 2  # bad input, config or environment: nothing (more) was generated
FAILURES_SHOWN = 5  # failed shards listed on screen; summary.json has every one


OUT_HELP = "the job's output location (`--output` of the run), any fsspec URL"


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Every setting of a job as an option (`fleetgen run`, `fleetgen calibrate`), grouped as the
    table groups them, each default None: unset options fall through to `--config`, then to the
    setting's own default."""
    from fleetgen.jobs.config import GROUPS, job_settings
    from fleetgen.settings import add_options

    groups = add_options(p, job_settings(), GROUPS)
    groups["job"].add_argument("--config", help="TOML file with the same settings (command line wins)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetgen", description="Bulk image generation on Ray with diffusers.")
    p.add_argument("--version", action="version", version=f"fleetgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_run_options(sub.add_parser("run", help="generate images for a Parquet prompt set"))
    d = sub.add_parser("demo", help="tiny model + sample prompts + local Ray, on CPU")
    d.add_argument("--output", default="demo-output", help="directory for model, prompts and images")
    _add_tiny_model(sub.add_parser("tiny-model", help="write a small random-weight pipeline to DIR"))
    _add_calibrate(
        sub.add_parser(
            "calibrate",
            help="the job's first rows under each speed setting against the exact reference: speed, PSNR, SSIM, "
            "then the fastest within --min-psnr as a config snippet",
        )
    )
    _add_plan(sub.add_parser("plan", help="dry run: the offload plan and batch each GPU size would get"))
    sub.add_parser("status", help="progress of a running or finished job, from its output location").add_argument(
        "output", metavar="OUT", help=OUT_HELP
    )
    r = sub.add_parser(
        "report", help="write OUT/report.html: sample images, per-worker table and charts, scores, failures"
    )
    r.add_argument("output", metavar="OUT", help=OUT_HELP)
    r.add_argument(
        "--group-by", metavar="COLUMN", help="a scored job: each score's mean and spread per value of COLUMN"
    )
    r.add_argument(
        "--sort-by", metavar="NAME", help="a scored job: the contact sheet by this score (`-NAME`: lowest first)"
    )
    sc = sub.add_parser(
        "score", help="score a job's stored images after the fact into OUT/scores/<name>/<shard>.parquet (resumable)"
    )
    sc.add_argument("output", metavar="OUT", help=OUT_HELP)
    sc.add_argument("--score", required=True, metavar="NAME[=MODEL],...", help="the scorers, as `fleetgen run --score`")
    sc.add_argument("--device", default="auto", help="auto (a GPU when there is one) | cpu | cuda | cuda:N")
    sc.add_argument("--batch", type=int, default=16, help="images scored per call (default 16)")
    sc.add_argument(
        "--workers",
        type=int,
        default=0,
        help="score on N Ray workers (a GPU each where the cluster has them; RAY_ADDRESS or a local Ray), "
        "each taking the next shard; 0 (default): in this process",
    )
    _add_verify(
        sub.add_parser("verify", help="check every stored image against the manifests; find orphans and leftovers")
    )
    return p


def _add_tiny_model(t: argparse.ArgumentParser) -> None:
    from fleetgen.workers.families.table import NO_TINY, TABLE

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
    t.add_argument(
        "--scorer",
        metavar="NAME",
        help="write a tiny scorer instead (clip, pickscore, aesthetic or nsfw), for `--score NAME=DIR`: a "
        "random-weight CLIP, LAION's aesthetic head over it, or an image classifier",
    )


def _add_calibrate(c: argparse.ArgumentParser) -> None:
    add_run_options(c)
    c.add_argument("--sample", type=int, default=4, help="rows of the job to make per setting (default 4)")
    c.add_argument("--min-psnr", type=float, default=30.0, help="quality floor, dB against the reference (default 30)")
    c.add_argument("--min-ssim", type=float, help="a second floor: SSIM against the reference, 0..1 (default none)")
    c.add_argument(
        "--max-drop",
        metavar="NAME=X,...",
        help="a floor on the job's scores (--score): each one's mean may fall at most X below the reference's, "
        "e.g. clip=0.01",
    )
    c.add_argument(
        "--try",
        dest="kinds",
        default="attention,compile,cache,quantize",
        help="settings to try, comma-separated (default attention,compile,cache,quantize)",
    )
    c.add_argument("--write", help="also write the chosen settings (TOML) here, for `fleetgen run --config`")


def _add_plan(pl: argparse.ArgumentParser) -> None:
    """The plan's own options, then the job's settings it plans with: the same rows as `fleetgen run`'s
    (declared `plan=True`: jobs/planning.py `plan_settings`), with the plan's defaults."""
    from fleetgen.jobs.planning import plan_settings
    from fleetgen.settings import add_options

    group = add_options(pl, plan_settings(), {"plan": "options"})["plan"]
    next(a for a in group._group_actions if a.dest == "model").required = True
    group.add_argument("--json", action="store_true", help="machine-readable output")


def _add_verify(v: argparse.ArgumentParser) -> None:
    v.add_argument("output", metavar="OUT", help=OUT_HELP)
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


def _print_summary(summary) -> int:
    filtered = f", {summary.images_filtered} filtered, not stored" if summary.images_filtered else ""
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


def _say(line: str) -> None:
    print(f"[fleetgen] {line}", file=sys.stderr, flush=True)


def _options(args, *leave) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("command", *leave)}


def _run(args) -> int:
    options = _options(args, "config")
    return _print_summary(
        fleetgen.run(options.pop("input"), options.pop("output"), options.pop("model"), config=args.config, **options)
    )


def _demo(args) -> int:
    summary = fleetgen.demo(args.output)
    code = _print_summary(summary)
    print(f"demo images: {summary.output}/images/  (manifests: {summary.output}/shards/)")
    return code


def _tiny_model(args) -> int:
    made = fleetgen.tiny_model(args.dir, family=args.family, size=args.size, seed=args.seed, scorer=args.scorer)
    print(f"wrote {made}")
    return 0


def _drops(text: str | None) -> dict[str, float]:
    """`--max-drop clip=0.01,aesthetic=0.2` as {scorer: drop}."""
    from fleetgen.errors import ConfigError

    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"`--max-drop` takes NAME=NUMBER,... (e.g. clip=0.01); got `{part}`.") from None
    return out


def _calibrate(args) -> int:
    from pathlib import Path

    options = _options(args, "config", "sample", "min_psnr", "min_ssim", "kinds", "write", "max_drop")
    cal = fleetgen.calibrate(
        options.pop("input"),
        options.pop("model"),
        config=args.config,
        sample=args.sample,
        min_psnr=args.min_psnr,
        min_ssim=args.min_ssim,
        kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
        max_drop=_drops(args.max_drop),
        progress=_say,
        **options,
    )
    print(cal.table())
    print()
    print(cal.snippet(), end="")
    if args.write:
        Path(args.write).write_text(cal.snippet())
        print(f"wrote {args.write}: fleetgen run --config {args.write} --input ... --output ... --model ...")
    return 0


def _plan(args) -> int:
    import json

    options = {k: v for k, v in _options(args, "model", "json").items() if v is not None}
    plans = fleetgen.plan(args.model, **options)
    print(json.dumps(plans.to_dict(), indent=2) if args.json else plans.text(), end="\n" if args.json else "")
    return 0 if plans.all_fit else EXIT_INCOMPLETE


def _status(args) -> int:
    state = fleetgen.status(args.output)
    print(state.text())
    return 0 if state.complete or state.running else EXIT_INCOMPLETE


def _verify(args) -> int:
    report = fleetgen.verify(args.output, deep=args.deep, fix=args.fix, force=args.force, progress=_say)
    print(report.text())
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.clean else EXIT_INCOMPLETE


def _score(args) -> int:
    summary = fleetgen.score(
        args.output, args.score, device=args.device, batch=args.batch, progress=_say, workers=args.workers
    )
    print(summary.text())
    return 0 if summary.complete else EXIT_INCOMPLETE


def _report(args) -> int:
    print(f"wrote {fleetgen.report(args.output, group_by=args.group_by, sort_by=args.sort_by)}")
    return 0


COMMANDS = {
    "run": _run,
    "demo": _demo,
    "tiny-model": _tiny_model,
    "calibrate": _calibrate,
    "plan": _plan,
    "status": _status,
    "verify": _verify,
    "report": _report,
    "score": _score,
}


def main(argv: list[str] | None = None) -> int:
    """`fleetgen ...`: exit 0 done, 1 incomplete (a rerun resumes), 2 bad input, config or environment."""
    try:
        parser = _parser()  # reads the field table and the formats: FLEETGEN_PLUGINS loads here
    except FleetgenError as err:
        print(f"fleetgen: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except FleetgenError as err:
        print(f"fleetgen: error: {err}", file=sys.stderr)
        return EXIT_ERROR
