"""fleetgen's Python API: what the `fleetgen` commands do, for a notebook or a script.

Each function takes the command's options as keyword arguments, named as the options are (`--max-batch`
is `max_batch`), builds the same records, applies the same defaults and raises the same errors
(`fleetgen.FleetgenError` and its tree: `ConfigError` for bad options, `StorageError` for a store that
fails, ...). The command line is a thin layer over these functions (fleetgen/jobs/cli.py).

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

import difflib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, TextIO

from fleetgen.errors import ConfigError

if TYPE_CHECKING:
    from fleetgen.jobs.planning import Plans
    from fleetgen.jobs.status import JobStatus
    from fleetgen.jobs.summary import JobSummary
    from fleetgen.jobs.verify import VerifyReport


def _known(options: dict, known: list[str], command: str) -> None:
    """An option the command does not have is refused, naming the closest one it has."""
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else f" Its options: {', '.join(sorted(known))}."
            raise ConfigError(f"`{command}` has no option `{name}`.{hint}")


def run(
    input: str, output: str, model: str, *, config: str | None = None, progress: TextIO | None = None, **options
) -> JobSummary:
    """`fleetgen run`: generate (or resume) the job; returns its summary (`.complete`, `.exit_code`,
    counts, failures, the per-worker table). `options`: any of `fleetgen run`'s (`steps=20`,
    `output_format="webdataset"`, `quantize="transformer=fp8"`, ...); `config`: a TOML file with the
    same settings, which `options` override, as on the command line. `progress`: where progress
    lines go (default standard error)."""
    from dataclasses import fields

    from fleetgen.jobs.config import JobConfig, make_config
    from fleetgen.jobs.driver import run_job

    _known(options, [f.name for f in fields(JobConfig)], "fleetgen.run")
    job = make_config({"input": input, "output": output, "model": model, **options}, config)
    return run_job(job, progress_stream=progress)


def warm_workers(address: str | None = None) -> AbstractContextManager:
    """A block whose runs keep their workers between them: a worker whose run is over is closed but
    not killed, and the next run that asks Ray for the same resources loads its model in that
    process instead of starting a new one (seconds of imports saved per worker; nothing carried from
    one job to the next). Joins `address` (else `RAY_ADDRESS`, else a local Ray started for the
    block); the workers hold their Ray resources until a run takes them or the block ends
    (fleetgen/cluster/warm.py)."""
    from fleetgen.cluster.warm import warm_workers as block

    return block(address)


def plan(
    model: str,
    gpu_memory: str | list[str] | None = None,
    *,
    gpu: str | None = None,
    host_memory: str | None = None,
    dtype: str | None = None,
    bandwidth: float | None = None,
    **options,
) -> Plans:
    """`fleetgen plan`: the offload plan and batch each device budget would get, from the model's
    configs alone (no weights, no GPU). `model`: a shipped architecture (`fleetgen plan --help` names
    them) or a pipeline directory; `gpu_memory`: a size like `24GiB`, or several; `gpu`: a card
    (`H100`, `RTX-4090`, ...: offload/devices.py) whose throughput and host link the plans assume, and
    whose memory is the budget when `gpu_memory` is not given; `bandwidth`: host→device GB/s to assume
    (default the card's, else 20). `options`: `width`, `height`, `steps`, `guidance`, `true_cfg_scale`, `max_batch`,
    `offload`, `phases`, `task`, `references`, `num_frames`, `cache`, `quantize`. Returns the plans (`.rows`,
    `.text()`, `.to_dict()`)."""
    from dataclasses import fields

    from fleetgen.jobs.planning import PlanRequest, plan_budgets

    _known(options, [f.name for f in fields(PlanRequest) if f.name != "model"], "fleetgen.plan")
    budgets = [gpu_memory] if isinstance(gpu_memory, str) else list(gpu_memory or [])
    bytes_per_s = bandwidth * 1e9 if bandwidth else None
    return plan_budgets(PlanRequest(model, **options), budgets, host_memory, dtype, bytes_per_s, gpu)


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
