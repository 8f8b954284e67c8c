"""fleetgen's Python API: what the `fleetgen` commands do, for a notebook or a script.

Each function takes the command's options as keyword arguments, named as the options are (`--max-batch`
is `max_batch`), builds the same records, applies the same defaults and raises the same errors
(`fleetgen.FleetgenError` and its tree: `ConfigError` for bad options, `StorageError` for a store that
fails, ...). The command line is a thin layer over these functions (fleetgen/cli.py); they call the rooms.

    import fleetgen

    summary = fleetgen.run("prompts.parquet", "out/", "org/model", steps=20, max_batch=8)
    print(summary.images_ok, summary.complete)
    print(fleetgen.status("out/").text())
    assert fleetgen.verify("out/", deep=True).clean
    print(fleetgen.plan("flux.1-dev", ["24GiB", "80GiB"]).text())

    with fleetgen.warm_workers():  # several runs in a row: workers stay up between them
        for name in ("cats", "dogs"):
            fleetgen.run(f"{name}.parquet", f"out/{name}", "org/model")

Nothing is imported until a function is called: `import fleetgen` loads no torch and no Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, TextIO

from fleetgen.errors import ConfigError

if TYPE_CHECKING:
    from fleetgen.jobs.calibrate import Calibration
    from fleetgen.jobs.planning import Plans
    from fleetgen.jobs.status import JobStatus
    from fleetgen.jobs.summary import JobSummary
    from fleetgen.jobs.verify import VerifyReport


def _job(input: str | None, output: str | None, model: str | None, config: str | None, options: dict, command: str):
    """The job a command's keywords describe, as `fleetgen run` builds it: the settings table's
    names only (a misspelt one refused, naming the closest), `config`'s TOML under them, validated."""
    from fleetgen.jobs.config import job_settings, make_config
    from fleetgen.settings import check_names

    check_names(list(options), job_settings(), command)
    return make_config({"input": input, "output": output, "model": model, **options}, config)


def run(
    input: str, output: str, model: str, *, config: str | None = None, progress: TextIO | None = None, **options
) -> JobSummary:
    """`fleetgen run`: generate (or resume) the job; returns its summary (`.complete`, `.exit_code`,
    counts, failures, the per-worker table). `options`: any of `fleetgen run`'s (`steps=20`,
    `output_format="webdataset"`, `quantize="transformer=fp8"`, ...); `config`: a TOML file with the
    same settings, which `options` override, as on the command line. `progress`: where progress
    lines go (default standard error)."""
    from fleetgen.jobs.driver import run_job

    return run_job(_job(input, output, model, config, options, "fleetgen.run"), progress_stream=progress)


def demo(output: str = "demo-output", progress: TextIO | None = None) -> JobSummary:
    """`fleetgen demo`: builds the tiny model and a sample prompt set under `output` (once), then runs
    a two-worker CPU job on a local Ray into `output`/out; returns its summary."""
    from fleetgen.jobs.demo import prepare
    from fleetgen.jobs.driver import run_job

    return run_job(prepare(output), progress_stream=progress)


def tiny_model(directory: str, family: str = "sd", size: str = "tiny", seed: int = 0, scorer: str | None = None) -> str:
    """`fleetgen tiny-model`: writes a random-weight pipeline of `family` (real diffusers classes,
    loadable with `from_pretrained`) to `directory`, or with `scorer` a tiny scorer for `--score
    NAME=DIR`; returns what it wrote, in words."""
    from fleetgen.workers.families.detect import identify_dir
    from fleetgen.workers.tiny import write_tiny_model
    from fleetgen.workers.tiny.scorers import write_tiny_scorer

    if size not in ("tiny", "small") or (size == "small" and family != "sd"):
        raise ConfigError(f"`--size` must be tiny, or small for the sd family; got `{size}` for {family}.")
    try:  # the builders name what they take
        if scorer:
            return f"{write_tiny_scorer(directory, scorer, seed)} (a tiny {scorer} scorer)"
        path = write_tiny_model(directory, seed=seed, size=size, family=family)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    detected, why = identify_dir(path)
    hint = "" if detected.name == family else f"; run it with `--family {family}`"
    return f"{path} ({family}; detected as {detected.name}: {why}{hint})"


def calibrate(
    input: str | None,
    model: str | None,
    *,
    config: str | None = None,
    sample: int = 4,
    min_psnr: float = 30.0,
    min_ssim: float | None = None,
    max_drop: dict[str, float] | None = None,
    kinds: tuple[str, ...] = ("attention", "compile", "cache", "quantize"),
    progress: Callable[[str], None] | None = None,
    **options,
) -> Calibration:
    """`fleetgen calibrate`: the job's first `sample` rows made under each speed setting of `kinds`
    and compared with the exact reference (speed, PSNR, SSIM, the scores' drops); returns the
    table and the fastest setting within the floors (`.table()`, `.snippet()`: TOML for `config`).
    `options`: `fleetgen run`'s; nothing is written to `output` (default: a temporary directory)."""
    import tempfile

    from fleetgen.jobs.calibrate import calibrate as measure

    output = options.pop("output", None) or tempfile.gettempdir()  # each setting writes under a folder of its own
    job = _job(input, output, model, config, options, "fleetgen.calibrate")
    return measure(job, sample, min_psnr, min_ssim, kinds, say=progress or (lambda _: None), max_drop=max_drop or {})


def warm_workers(address: str | None = None) -> AbstractContextManager:
    """A block whose runs keep their workers between them: a worker whose run is over is closed but
    not killed, and the next run that asks Ray for the same resources loads its model in that
    process instead of starting a new one (seconds of imports saved per worker; nothing carried from
    one job to the next). Joins `address` (else `RAY_ADDRESS`, else a local Ray started for the
    block); the workers hold their Ray resources until a run takes them or the block ends
    (cluster/warm.py)."""
    from fleetgen.cluster.warm import warm_workers as block

    return block(address)


def plan(model: str, gpu_memory: str | list[str] | None = None, **options) -> Plans:
    """`fleetgen plan`: the offload plan and batch each device budget would get, from the model's
    configs alone (no weights, no GPU). `model`: a shipped architecture (`fleetgen plan --help` names
    them) or a pipeline directory; `gpu_memory`: a size like `24GiB`, or several. `options`, as the
    command's: `gpu` (a card, `H100`, `RTX-4090`, ...: offload/devices.py, whose throughput and host link
    the plans assume, and whose memory is the budget when `gpu_memory` is not given), `bandwidth`
    (host→device GB/s to assume), `host_memory`, `workers_per_node` and `host_copy` (the node's RAM and
    host link shared by that many workers, holding the weights once or each its own), `dtype`, `references`,
    and the job's settings a plan
    depends on (`width`, `height`, `steps`, `guidance`, `max_batch`, `offload`, `phases`, `task`, `cache`,
    `quantize`, `score`, ...: `fleetgen plan --help`). Returns the plans (`.rows`, `.text()`, `.to_dict()`)."""
    from fleetgen.jobs.planning import PlanRequest, plan_budgets

    if gpu_memory is not None:
        options["budgets"] = (gpu_memory,) if isinstance(gpu_memory, str) else tuple(gpu_memory)
    return plan_budgets(PlanRequest.of(model, **options))


def status(output: str) -> JobStatus:
    """`fleetgen status`: a running or finished job's progress from its output location alone
    (`.complete`, `.running`, counts, per-worker rates, `.eta_seconds`, `.text()`)."""
    from fleetgen.jobs.status import job_state

    return job_state(output)


def verify(
    output: str,
    *,
    deep: bool = False,
    fix: bool = False,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """`fleetgen verify`: every stored byte against the manifests (`.clean`, counts and examples of
    what is missing, mismatched, orphaned or left over, `.text()`). `deep`: hash every image;
    `fix`: remove orphans and leftovers and un-commit damaged shards so that a rerun redoes them."""
    from fleetgen.jobs.verify import verify as verify_output

    return verify_output(output, deep=deep, fix=fix, force=force, progress=progress)


def score(
    output: str,
    score: str,
    device: str = "auto",
    batch: int = 16,
    progress: Callable[[str], None] | None = None,
    workers: int = 0,
):
    """`fleetgen score`: a finished (or running) job's stored images scored after the fact into
    `OUT/scores/<name>/<shard>.parquet`, shard by shard, resumable (jobs/score.py): in this process, or
    on `workers` Ray workers; returns a summary (`.complete`, counts, `.text()`)."""
    from fleetgen.jobs.score import score_job

    return score_job(output, score, device=device, batch=batch, say=progress or (lambda _: None), workers=workers)


def report(output: str, group_by: str | None = None, sort_by: str | None = None) -> str:
    """`fleetgen report`: writes OUT/report.html (a contact sheet, the per-worker table and charts,
    the failures; a scored job's histograms, by `group_by`'s values, its sheet ordered by the score
    `sort_by`); returns its URL."""
    from fleetgen.jobs.report import write_report

    return write_report(output, group_by, sort_by)
