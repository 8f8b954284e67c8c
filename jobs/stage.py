"""A Ray Data stage as the caller's process resolves it (`fleetgen.ray_data.generate`; cluster/ray_data.py
runs it): the options checked against the one settings table as `fleetgen run` checks them, with its
defaults and its errors; the dataset's columns by role, from its schema; the family's defaults, the
adapters, the largest size — all before any actor starts. No Ray here: what the stage must ask of the
dataset beyond its schema (a LoRA column's values, a size column's largest) it asks through `DatasetFacts`.

What a job has that a stage has not (each setting says why: `setting(stage=...)`): an output it commits
shard by shard, resume, `verify`. A stage's rows go where the pipeline writes them."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from fleetgen.errors import ConfigError, InputError
from fleetgen.jobs.config import JobConfig, job_settings, load_toml, make_config
from fleetgen.jobs.dataset import describe_columns
from fleetgen.jobs.driver import worker_spec
from fleetgen.jobs.models import MAX_ADAPTERS, describe, resolve_model
from fleetgen.jobs.sharding import InputFile, resolve_columns
from fleetgen.settings import canonical, check_names, names
from fleetgen.workers.families.model_dir import is_hub_id
from fleetgen.workers.output.rows import ADDED
from fleetgen.workers.output.storage import resolve_url
from fleetgen.workers.rows.shard import Columns
from fleetgen.workers.spec import WorkerSpec

COMMAND = "fleetgen.ray_data.generate"
WHERE = "the dataset"  # how errors name the stage's input


@dataclass(frozen=True)
class DatasetFacts:
    """What the stage asks of the dataset beyond its schema (cluster/ray_data.py answers from Ray Data):
    `unique(column)`, its distinct values; `largest(column)`, its largest value (None: all null)."""

    unique: Callable[[str], list]
    largest: Callable[[str], int | None]


@dataclass(frozen=True)
class Stage:
    config: JobConfig  # resolved: the family's defaults in, the model's revision pinned
    spec: WorkerSpec  # each actor's, under a name of its own
    columns: Columns
    media: str  # the column of what each row made: `image`, or `video` for a video task
    base: str  # what relative input-image paths are relative to (the caller's working directory)
    lines: tuple[str, ...]  # what the stage says of itself before it runs, as a job's driver does


def stage_settings() -> dict[str, str]:
    """{setting: why a stage refuses it} for the job's settings a Ray Data pipeline has no use for."""
    return {r.name: r.stage for r in job_settings() if r.stage}


def check_options(options: dict, where: str = COMMAND) -> None:
    """A misspelt name refused as `fleetgen.run` refuses it (naming the closest); a job's setting that a
    stage has no use for refused with why, and what to do instead."""
    rows = job_settings()
    check_names(list(options), rows, where)
    known, refused = names(rows), stage_settings()
    for name in options:
        row = known[name]
        if row.name in refused:
            raise ConfigError(f"`{where}` takes no `{name}`: {refused[row.name]}.")


def resolve_stage(
    schema: pa.Schema,
    model: str,
    options: dict,
    facts: DatasetFacts,
    config_file: str | None = None,
    base: str | None = None,
) -> Stage:
    """The stage `options` describe over a dataset of `schema` (ConfigError, InputError: refused here)."""
    check_options(options)
    if config_file:
        check_options(canonical(load_toml(config_file), job_settings()), f"{COMMAND}(config={config_file!r})")
    config = make_config({"model": model, **options}, config_file, required=("model",))
    if not is_hub_id(config.source.model):
        config = config.with_options(model=resolve_url(config.source.model))
    columns = resolve_columns(
        [InputFile(WHERE, 0, (), schema)],
        config.columns,
        config.generation.prompt_template,
        config.column_list("keep_columns"),
        config.column_list("drop_columns"),
    )
    if not columns["id"] and not columns["seed"]:
        raise InputError(
            f"{WHERE.capitalize()} has neither an id column (`{config.columns['id']}`) nor a seed column "
            f"(`{config.columns['seed']}`): a job derives a row's seed from its id, or its position in the input "
            "file, and a Ray Data block has no stable position. Add an id column (or pass `id_column=` naming "
            "one), or a seed column, so that the same row gets the same pixels on every run."
        )
    r = resolve_model(
        config,
        columns,
        lambda column: [str(v) for v in facts.unique(column)[: MAX_ADAPTERS + 1] if v is not None],
        facts.largest,
    )
    config = r.config
    media = "video" if config.generation.task_spec().video else "image"
    for name in columns.carry:
        if name in (*ADDED, media):
            raise InputError(
                f"Input column `{name}` would be carried into the stage's rows, which have a `{name}` column of "
                f"their own. Pass `drop_columns={name!r}` (a template can still read it), or rename it."
            )
    spec = worker_spec(config, "stage", columns, adapters=r.adapters, plan_size=r.plan_size)
    lines = [describe(config, r.family, r.sources), describe_columns(config, columns, r.adapters), r.pin_note]
    return Stage(config, spec, columns, media, base or os.path.join(os.getcwd(), WHERE), tuple(x for x in lines if x))
