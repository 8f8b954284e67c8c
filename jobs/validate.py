"""A job's settings checked before anything starts: `validate` raises `ConfigError` naming the
first invalid setting, in the words of its option (`--steps`, `--offload`, ...). A setting's own choices
and bounds are declared with it and checked where its value enters (fleetgen/settings.py `check_value`):
here are the rules across settings, and those no declaration can say (a model's sizes, a scorer's package)."""

from __future__ import annotations

from pathlib import Path

from fleetgen.errors import ConfigError
from fleetgen.jobs.config import DEVICES, REQUIRED, JobConfig, option
from fleetgen.offload.weight_formats import refusal
from fleetgen.scores import SCORERS, ScoreSpec
from fleetgen.workers.families.model_dir import HUB_ID, size_multiple
from fleetgen.workers.output.video import MAX_CRF
from fleetgen.workers.rows.batches import template_fields


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: JobConfig, required: tuple[str, ...] = REQUIRED) -> JobConfig:
    """Raise `ConfigError` naming the first invalid setting; return the config unchanged. (The
    settings parsed into records — quantize, cache, attention — were checked when it was built.)
    `required`: the settings that must be given (a Ray Data stage's input and output are its dataset's)."""
    for name, value in zip(REQUIRED, (config.input, config.output, config.source.model), strict=True):
        _check(bool(value) or name not in required, f"{option(name)} is required.")
    for check in (_check_generation, _check_model_sizes, _check_media, _check_execution, _check_columns):
        check(config)
    return config


def _check_generation(c: JobConfig) -> None:
    """The numbers every image is made with, and how the quantization meets the offload."""
    g, offload = c.generation, c.fit.offload
    for component, name in g.quantize.mapping.items():  # the combination table, before any worker starts
        if offload in ("block", "leaf", "disk"):
            why = refusal(name, "block" if offload == "disk" else offload, False, offload == "disk")
            _check(why is None, f"`--quantize {component}={name}` with `--offload {offload}`: {why}.")
    if g.prompt_template is not None:
        try:
            template_fields(g.prompt_template)
        except ValueError as err:
            raise ConfigError(
                f"`--prompt-template` `{g.prompt_template}`: {err}; name columns like "
                "`a {style} photo of a {label}`."
            ) from err
    check_scorers(g.score)
    ranked = (g.rank_by or "").removeprefix("-")
    if g.best_of > 1 or g.rank_by:
        _check(
            g.best_of > 1 and bool(g.rank_by),
            "`--best-of N` (N > 1) and `--rank-by NAME` go together: N candidates per image, the best by NAME kept.",
        )
        _check(
            ranked in g.score.names,
            f"`--rank-by {g.rank_by}` names a score the job does not compute; it scores: "
            f"{', '.join(g.score.names) or 'none (add --score)'}.",
        )


def check_scorers(spec: ScoreSpec) -> None:
    """Each scorer's library is installed (else what to install) and its model a hub id or a path that
    exists: `ConfigError` naming the first that is not (`fleetgen run` and `fleetgen score` alike)."""
    import importlib.util

    for name, model in spec.scorers:
        scorer = SCORERS[name]
        _check(
            importlib.util.find_spec(scorer.module) is not None,
            f"`--score {name}` needs the {scorer.package} package: pip install {scorer.package}.",
        )
        local = model.startswith(("/", "./", "../", "~")) or not HUB_ID.fullmatch(model)
        _check(
            not local or Path(model).expanduser().exists(),
            f"`--score {name}={model}`: no such file or directory (nor a hub id like org/name).",
        )


def _check_model_sizes(c: JobConfig) -> None:
    """The model exists where a local path names it, and the sizes are what it takes."""
    local = c.source.model.startswith(("/", "./", "../", "~"))  # a hub id is `org/name`
    _check(
        not local or Path(c.source.model).expanduser().exists(),
        f"`--model` `{c.source.model}` does not exist. Pass a pipeline directory or a hub id like `org/name`.",
    )
    multiple = size_multiple(c.source.model)  # from a local model's configs; else 8, as every SD-family VAE needs
    for name, v in (("width", c.generation.width), ("height", c.generation.height)):
        if v is None:
            continue  # the family's default (jobs/models.py), checked there
        if multiple is None:
            _check(v >= 8 and v % 8 == 0, f"{option(name)} must be a positive multiple of 8, got `{v}`.")
        else:
            _check(
                v > 0 and v % multiple[0] == 0,
                f"{option(name)} `{v}` is not a multiple of {multiple[0]}, which "
                f"the model at {c.source.model} needs ({multiple[1]}).",
            )


def _check_media(c: JobConfig) -> None:
    """What is stored: image and video formats, clips' frames and rate, the output format."""
    g = c.generation
    _check(
        not g.store_inputs or g.output_format in ("webdataset", "parquet"),
        "`--store-inputs` puts each input beside its image in webdataset or parquet output; with "
        f"`--output-format {g.output_format}` the inputs are your own objects already (the manifest names them).",
    )
    _check(
        0 <= g.crf <= MAX_CRF[g.video_format],
        f"`--crf` must be 0 to {MAX_CRF[g.video_format]} for {g.video_format}, got `{g.crf}`.",
    )


def _check_execution(c: JobConfig) -> None:
    """How the job runs: workers, placement, retries, devices and memory budgets."""
    _check(
        c.gpus_per_worker is None or 0 < c.gpus_per_worker <= 1 or float(c.gpus_per_worker).is_integer(),
        f"`--gpus-per-worker` must be a fraction in (0, 1] or a whole number, got `{c.gpus_per_worker}`.",
    )
    _check(
        DEVICES.fullmatch(c.source.device) is not None,
        f"`--device` must be auto, cpu, cuda or cuda:N; got `{c.source.device}`.",
    )
    if c.worker_memory is not None:
        budgets = c.worker_budgets()
        _check(c.fit.gpu_memory is None, "`--worker-memory` and `--gpu-memory` both set budgets: pass one of them.")
        limit = c.max_workers
        _check(
            limit in (None, len(budgets)),
            f"`--workers` is {limit} but `--worker-memory` lists {len(budgets)} budgets (one worker per budget).",
        )


def _check_columns(c: JobConfig) -> None:
    names = list(c.columns.values())
    _check(len(set(names)) == len(names), f"Column options must name different columns, got {names}.")
    _check(
        c.keep_columns is None or c.drop_columns is None,
        "`--keep-columns` and `--drop-columns` both choose the carried columns: pass one of them.",
    )
