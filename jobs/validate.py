"""A job's settings checked before anything starts: `validate` raises `ConfigError` naming the
first invalid setting, in the words of its option (`--steps`, `--offload`, ...)."""

from __future__ import annotations

from pathlib import Path

from fleetgen.errors import ConfigError
from fleetgen.jobs.config import _REQUIRED, DEVICES, DTYPES, JobConfig, _option, parse_lora
from fleetgen.offload.phasing import PHASES_CHOICES
from fleetgen.offload.planner import OFFLOAD_CHOICES
from fleetgen.offload.weight_formats import refusal
from fleetgen.scores import MAX_CANDIDATES, SCORERS, ScoreSpec
from fleetgen.units import parse_size
from fleetgen.workers.families.model_dir import HUB_ID, size_multiple
from fleetgen.workers.families.table import TASKS
from fleetgen.workers.output.fields import MAX_FPS, MAX_FRAMES, MAX_IMAGES_PER_ROW
from fleetgen.workers.output.formats import format_names
from fleetgen.workers.output.layout import IMAGE_FORMATS
from fleetgen.workers.output.video import MAX_CRF, VIDEO_FORMATS
from fleetgen.workers.rows.batches import template_fields
from fleetgen.workers.rows.inputs import RESIZE_RULES
from fleetgen.workers.rows.shard import SETTING_ROLES


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: JobConfig) -> JobConfig:
    """Raise `ConfigError` naming the first invalid setting; return the config unchanged. (The
    settings parsed into records — quantize, cache, attention — were checked when it was built.)"""
    for name in _REQUIRED:
        _check(bool(getattr(config, name)), f"{_option(name)} is required.")
    for check in (_check_generation, _check_model_sizes, _check_media, _check_execution, _check_columns):
        check(config)
    return config


def _check_generation(c: JobConfig) -> None:
    """The numbers every image is made with, and how the quantization meets the offload."""
    _check(c.steps is None or c.steps >= 1, f"`--steps` must be a positive integer, got `{c.steps}`.")
    _check(c.guidance is None or c.guidance >= 0, f"`--guidance` must be 0 or more, got `{c.guidance}`.")
    _check(
        c.true_cfg_scale is None or c.true_cfg_scale > 0,
        f"`--true-cfg-scale` must be more than 0, got `{c.true_cfg_scale}`.",
    )
    for component, name in c.quantize.mapping.items():  # the combination table, before any worker starts
        if c.offload in ("block", "leaf", "disk"):
            why = refusal(name, "block" if c.offload == "disk" else c.offload, False, c.offload == "disk")
            _check(why is None, f"`--quantize {component}={name}` with `--offload {c.offload}`: {why}.")
    _check(c.seed >= 0, f"`--seed` must be 0 or more, got `{c.seed}`.")
    _check(c.task is None or c.task in TASKS, f"`--task` must be one of {', '.join(TASKS)}; got `{c.task}`.")
    _check(c.strength is None or 0 <= c.strength <= 1, f"`--strength` must be between 0 and 1, got `{c.strength}`.")
    _check(c.resize in RESIZE_RULES, f"`--resize` must be one of {', '.join(RESIZE_RULES)}; got `{c.resize}`.")
    _check(
        1 <= c.images_per_prompt <= MAX_IMAGES_PER_ROW,
        f"`--images-per-prompt` must be 1 to {MAX_IMAGES_PER_ROW}, got `{c.images_per_prompt}`.",
    )
    if c.prompt_template is not None:
        try:
            template_fields(c.prompt_template)
        except ValueError as err:
            raise ConfigError(
                f"`--prompt-template` `{c.prompt_template}`: {err}; name columns like "
                "`a {style} photo of a {label}`."
            ) from err
    for value in c.lora:
        parse_lora(value)
    check_scorers(c.score)
    _check(1 <= c.best_of <= MAX_CANDIDATES, f"`--best-of` must be 1 to {MAX_CANDIDATES}, got `{c.best_of}`.")
    ranked = (c.rank_by or "").removeprefix("-")
    if c.best_of > 1 or c.rank_by:
        _check(
            c.best_of > 1 and bool(c.rank_by),
            "`--best-of N` (N > 1) and `--rank-by NAME` go together: N candidates per image, the best by NAME kept.",
        )
        _check(
            ranked in c.score.names,
            f"`--rank-by {c.rank_by}` names a score the job does not compute; it scores: "
            f"{', '.join(c.score.names) or 'none (add --score)'}.",
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
    local = c.model.startswith(("/", "./", "../", "~"))  # a hub id is `org/name`
    _check(
        not local or Path(c.model).expanduser().exists(),
        f"`--model` `{c.model}` does not exist. Pass a pipeline directory or a hub id like `org/name`.",
    )
    multiple = size_multiple(c.model)  # from a local model's configs; else 8, as every SD-family VAE needs
    for name in ("width", "height"):
        v = getattr(c, name)
        if v is None:
            continue  # the family's default (jobs/models.py), checked there
        if multiple is None:
            _check(v >= 8 and v % 8 == 0, f"{_option(name)} must be a positive multiple of 8, got `{v}`.")
        else:
            _check(
                v > 0 and v % multiple[0] == 0,
                f"{_option(name)} `{v}` is not a multiple of {multiple[0]}, which "
                f"the model at {c.model} needs ({multiple[1]}).",
            )


def _check_media(c: JobConfig) -> None:
    """What is stored: image and video formats, clips' frames and rate, the output format."""
    _check(
        not c.store_inputs or c.output_format in ("webdataset", "parquet"),
        "`--store-inputs` puts each input beside its image in webdataset or parquet output; with "
        f"`--output-format {c.output_format}` the inputs are your own objects already (the manifest names them).",
    )
    _check(
        c.image_format in IMAGE_FORMATS,
        f"`--image-format` must be one of {', '.join(IMAGE_FORMATS)}; got `{c.image_format}`.",
    )
    _check(
        c.video_format in VIDEO_FORMATS,
        f"`--video-format` must be one of {', '.join(VIDEO_FORMATS)}; got `{c.video_format}`.",
    )
    _check(
        0 <= c.crf <= MAX_CRF[c.video_format],
        f"`--crf` must be 0 to {MAX_CRF[c.video_format]} for {c.video_format}, got `{c.crf}`.",
    )
    _check(
        c.num_frames is None or 1 <= c.num_frames <= MAX_FRAMES,
        f"`--num-frames` must be 1 to {MAX_FRAMES}, got `{c.num_frames}`.",
    )
    _check(c.fps is None or 0 < c.fps <= MAX_FPS, f"`--fps` must be more than 0 and at most {MAX_FPS}, got `{c.fps}`.")
    _check(
        c.output_format in format_names(),
        f"`--output-format` must be one of {', '.join(format_names())}; got `{c.output_format}`.",
    )


def _check_execution(c: JobConfig) -> None:
    """How the job runs: workers, placement, retries, devices and memory budgets."""
    for name in ("workers", "max_workers"):
        v = getattr(c, name)
        _check(v is None or v >= 1, f"{_option(name)} must be 1 or more, got `{v}`.")
    _check(
        c.workers is None or c.max_workers is None or c.workers == c.max_workers,
        f"`--workers` ({c.workers}) and `--max-workers` ({c.max_workers}) disagree: they name the same limit, pass one.",
    )
    _check(
        c.gpus_per_worker is None or 0 < c.gpus_per_worker <= 1 or float(c.gpus_per_worker).is_integer(),
        f"`--gpus-per-worker` must be a fraction in (0, 1] or a whole number, got `{c.gpus_per_worker}`.",
    )
    _check(c.placement_timeout > 0, f"`--placement-timeout` must be more than 0 seconds, got `{c.placement_timeout}`.")
    _check(c.max_restarts >= 0, f"`--max-restarts` must be 0 or more, got `{c.max_restarts}`.")
    _check(c.stop_grace >= 0, f"`--stop-grace` must be 0 or more, got `{c.stop_grace}`.")
    for name in ("max_batch", "rows_per_shard", "max_attempts", "cpu_threads"):
        v = getattr(c, name)
        _check(v >= 1, f"{_option(name)} must be 1 or more, got `{v}`.")
    _check(DEVICES.fullmatch(c.device) is not None, f"`--device` must be auto, cpu, cuda or cuda:N; got `{c.device}`.")
    _check(c.dtype in DTYPES, f"`--dtype` must be one of {', '.join(DTYPES)}; got `{c.dtype}`.")
    _check(c.offload in OFFLOAD_CHOICES, f"`--offload` must be one of {', '.join(OFFLOAD_CHOICES)}; got `{c.offload}`.")
    _check(c.phases in PHASES_CHOICES, f"`--phases` must be one of {', '.join(PHASES_CHOICES)}; got `{c.phases}`.")
    for name in ("gpu_memory", "host_memory"):
        if getattr(c, name) is not None:
            parse_size(getattr(c, name), f"--{name.replace('_', '-')}")
    if c.worker_memory is not None:
        budgets = c.worker_budgets()
        _check(c.gpu_memory is None, "`--worker-memory` and `--gpu-memory` both set budgets: pass one of them.")
        limit = c.max_workers or c.workers
        _check(
            limit in (None, len(budgets)),
            f"`--workers` is {limit} but `--worker-memory` lists {len(budgets)} budgets (one worker per budget).",
        )


def _check_columns(c: JobConfig) -> None:
    names = [
        c.prompt_column,
        c.id_column,
        c.seed_column,
        c.negative_prompt_column,
        *(getattr(c, f"{role}_column") for role in SETTING_ROLES),
    ]
    _check(len(set(names)) == len(names), f"Column options must name different columns, got {names}.")
    _check(
        c.keep_columns is None or c.drop_columns is None,
        "`--keep-columns` and `--drop-columns` both choose the carried columns: pass one of them.",
    )
