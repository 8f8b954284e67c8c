"""fleetgen as Ray Data's diffusion stage: rows in, rows with their pictures out.

    import ray, fleetgen.ray_data

    ds = ray.data.read_parquet("s3://bucket/prompts/")  # any Ray Data source: a lakehouse table, a join ...
    ds = fleetgen.ray_data.generate(ds, "org/model", steps=20, max_batch=8)
    ds.write_parquet("s3://bucket/images/")  # any Ray Data sink

The options are `fleetgen.run`'s, with its defaults and its errors, refused before any actor starts; a job's
own (its output, resume, retries) are refused with what to do instead. Each actor is a fleetgen worker that
plans its own device. Every row keeps its input columns; the image record's fields come beside them (`id`,
`seed`, `status`, `error`, sizes, ... as a job's manifest names them), then `model`, `plan` (the worker's
offload plan and batch) and the picture as encoded bytes in `image` (PNG, or `image_format`), or the clip
in `video` for a video task. The seeds are a job's: the same rows and options give `fleetgen run`'s pixels.
A row that fails (an unreadable input image, a prompt the pipeline refuses) is a row with `status` error
and its `error`, not a failed pipeline. docs/guides/ray-data.md says when a job is the better tool.

Nothing is imported until a function is called: `import fleetgen.ray_data` loads no torch and no Ray.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset


def generate(
    ds: Dataset,
    model: str,
    *,
    config: str | None = None,
    concurrency: int | tuple[int, int] | None = None,
    batch_rows: int | None = None,
    stats: str | None = None,
    progress: TextIO | None = None,
    ray_remote_args: dict | None = None,
    **options,
) -> Dataset:
    """`ds` with a generation stage: one output row per image (`images_per_prompt`, `best_of` and a
    `num_images` column make several per input row). `options`: `fleetgen.run`'s (`steps=20`,
    `gpu_memory="24GiB"`, `quantize=...`, `score=...`, column names, ...); `config`: a TOML file with the
    same settings, which `options` override. `workers=N`: a pool of N actors; `concurrency`: Ray Data's,
    an int or `(min, max)` for an autoscaling pool (default: up to one actor per GPU, or per
    `cpu_threads` CPUs on CPU, one CPU left for Ray Data's reads). `batch_rows`: rows per actor call
    (default 16). `stats`: a location (any fsspec URL) where each actor keeps its record as a job's workers
    do (`workers/<name>.json`: plan, offload statistics, host copy), and `fleet(stats)` reads them.
    `progress`: where the stage's lines go (default standard error). `ray_remote_args`: passed to the
    actors (default `{"max_restarts": 3, "max_task_retries": 3}`: a batch that keeps killing its actor fails
    the stage instead of reloading the model for good). A pool that would leave Ray Data's reads no CPU is
    refused (an autoscaling one capped, with a line). Raises `ConfigError` / `InputError` before anything
    runs. The node's copies of the weights the actors leave are reclaimed on every node when this process
    exits (cluster/reclaim.py)."""
    from fleetgen.cluster.ray_data import apply
    from fleetgen.jobs.stage import DatasetFacts, resolve_stage
    from fleetgen.workers.output.storage import Output, resolve_url

    facts = DatasetFacts(unique=ds.unique, largest=ds.max)
    stage = resolve_stage(_arrow_schema(ds), model, options, facts, config)
    say = progress or sys.stderr
    for line in stage.lines:
        print(f"[fleetgen] {line}", file=say, flush=True)
    spec = stage.spec
    if stats is not None:
        where = Output(resolve_url(stats))
        where.check()  # a store that cannot be written: one line, before anything runs
        spec = dataclasses.replace(spec, output=where.url)
    c = stage.config
    out = apply(
        ds,
        spec,
        stage.base,
        workers=c.max_workers,
        gpus_per_worker=c.gpus_per_worker,
        cpu_threads=c.cpu_threads,
        concurrency=concurrency,
        batch_rows=batch_rows,
        say=lambda line: print(f"[fleetgen] {line}", file=say, flush=True),
        **(ray_remote_args or {}),
    )
    if c.fit.host_copy == "node":  # what actors ended without their exit handlers left, reclaimed at the end
        from fleetgen.cluster import reclaim_at_exit

        reclaim_at_exit()
    return out


def fleet(stats: str) -> str:
    """What the actors of a stage run with `stats` recorded there: per device kind, the plan kept and how
    it was chosen, predicted beside measured; per actor, its device, batch, images, speed and weights."""
    from fleetgen.jobs.status import fleet_text

    return fleet_text(stats)


def _arrow_schema(ds: Dataset) -> pa.Schema:
    """The dataset's columns as Arrow types (a pandas-block dataset's dtypes converted). A LoRA column's
    values and a size column's largest are read from the whole dataset (`DatasetFacts`): a pass over
    those columns before the stage runs."""
    import numpy as np
    import pyarrow as pa

    # without running the pipeline where its plan knows the schema (a read), else from its first row only
    schema = ds.schema(fetch_if_missing=False) or ds.limit(1).schema()
    if schema is None:
        from fleetgen.errors import InputError

        raise InputError("The dataset has no schema (no rows?): nothing to generate.")
    base = schema.base_schema
    if isinstance(base, pa.Schema):
        return base
    fields = []
    for name, kind in zip(schema.names, schema.types, strict=True):
        if isinstance(kind, pa.DataType):
            fields.append(pa.field(name, kind))
        elif isinstance(kind, np.dtype) and kind.kind != "O":
            fields.append(pa.field(name, pa.from_numpy_dtype(kind)))
        else:  # a pandas object column: text, as prompts are
            fields.append(pa.field(name, pa.string()))
    return pa.schema(fields)
