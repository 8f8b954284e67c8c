"""What a job is: one frozen `JobConfig`, from command-line options, a TOML file or the Python
API's keywords, validated before anything starts.

A job holds the records its workers are given — the weights' `Source`, the `GenerationSettings`
every image shares, each worker's `Fit` (workers/spec.py) — the input's column names by
role, and the settings only the driver reads, declared below. Every setting is declared once, where
it is carried (fleetgen/settings.py); `job_settings()` is the table of all of them, from which the
command line, the TOML coercion, the API's keywords and docs/reference/options.md are made."""

from __future__ import annotations

import difflib
import functools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fleetgen.errors import ConfigError
from fleetgen.settings import Row, build, canonical, coerce, columns, nested, setting, table, value_at, with_values
from fleetgen.workers.families.model_dir import is_hub_id
from fleetgen.workers.output.fields import roles
from fleetgen.workers.output.storage import resolve_url
from fleetgen.workers.rows.shard import ROLES
from fleetgen.workers.spec import STAGE_SINKS, Fit, GenerationSettings, Source

DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")

# The `--help` groups, in the order the help and docs/reference/options.md list them.
GROUPS = {
    "job": "job",
    "generation": "generation (part of the job fingerprint)",
    "synthesis": "dataset synthesis (part of the job fingerprint)",
    "execution": "execution",
}

# Why a Ray Data stage has no retry setting of a job: Ray Data retries its own tasks and actors.
STAGE_RETRIES = (
    "a stage's actors restart, and its batches are retried, 3 times at most: `ray_remote_args` "
    "(`max_restarts`, `max_task_retries`) change that"
)


def _column_rows() -> list[Row]:
    """One setting per role of the field table (workers/output/fields.py): `--<role>-column NAME`."""
    by_role, out = {f.role: f for f in roles()}, []
    for f in (by_role[role] for role in ROLES):  # prompt, id, seed, negative prompt, then the per-row settings
        if f.setting:
            text = f"per-row {f.role.replace('_', ' ')} (default `{f.default_column}`, used when present; `none` to ignore it)"
        else:
            text = f"default {f.default_column}" + ("" if f.role == "prompt" else " (used when present)")
        group = "synthesis" if f.setting else "generation"
        out.append(
            Row(
                help=text,
                group=group,
                scope="row",
                fingerprint=True,
                name=f"{f.role}_column",
                path=(f.role,),
                type="str",
                default=f.default_column,
            )
        )
    return out


def _column_defaults() -> dict[str, str]:
    return {f.role: f.default_column for f in roles()}


@dataclass(frozen=True)
class JobConfig:
    """A job: every setting of `fleetgen run`, frozen. Built from flat options with `JobConfig.of`
    (or `make_config`, which also reads a TOML file and validates)."""

    input: str = setting(
        "",
        "Parquet file, directory or glob (any fsspec URL)",
        group="job",
        fingerprint=True,
        stage="the stage's input is the dataset it is given",
    )
    output: str = setting("", "output location (any fsspec URL)", group="job", fingerprint=False, stage=STAGE_SINKS)
    source: Source = nested(Source, group="execution", scope="worker", fingerprint=False)
    generation: GenerationSettings = nested(GenerationSettings, group="generation", scope="job", fingerprint=True)
    # {role: input column}: `prompt`, `id`, `seed`, `negative_prompt`, and each per-row setting's
    # (`steps`, `image`, ...); a column the input lacks is not used
    columns: dict[str, str] = columns(_column_rows, _column_defaults)
    rows_per_shard: int = setting(
        256,
        "rows per unit of work and of commit; a row group is split into such ranges",
        group="generation",
        fingerprint=True,
        stage="Ray Data hands the stage its blocks; `batch_rows` sets the rows of a call",
        at_least=1,
    )
    keep_columns: str | None = setting(
        None,
        "carry only these input columns into the outputs, e.g. label,style (default: every column)",
        group="synthesis",
        fingerprint=True,
    )
    drop_columns: str | None = setting(None, "carry every input column but these", group="synthesis", fingerprint=True)
    fit: Fit = nested(Fit, group="execution", scope="worker", fingerprint=False)
    max_workers: int | None = setting(
        None,
        "at most this many workers (default: locally one per GPU, else CPUs / --cpu-threads; "
        "on a cluster one per shard to do, up to 1000: the autoscaler adds nodes for them)",
        flags=("--workers", "--max-workers"),
        aliases=("workers",),
        at_least=1,
    )
    gpus_per_worker: float | None = setting(
        None,
        "Ray GPUs each worker asks for (default 1 for GPU workers; 0.5 packs two on one GPU, each planning "
        "within its share)",
    )
    placement_timeout: float = setting(
        300.0,
        "seconds to wait with no worker placed before giving up with exit 2",
        stage="Ray Data waits for its actor pool itself",
        more_than=0,
    )
    cpu_threads: int = setting(
        1,
        "torch threads per CPU worker; CPU kernels round differently per thread count, so a fixed number "
        "keeps images independent of how many workers run",
        at_least=1,
    )
    max_attempts: int = setting(3, "tries per shard before it is marked failed", stage=STAGE_RETRIES, at_least=1)
    max_restarts: int = setting(
        3, "restarts of a worker whose process died, before it is dropped", stage=STAGE_RETRIES, at_least=0
    )
    commit_interval: float = setting(
        60.0,
        "seconds between a running shard's commits of what it has made (parts), so that a lost worker costs "
        "at most that much work, not its shard; 0: whole shards only",
        stage="a stage commits nothing: its rows are the sink's",
        at_least=0,
    )
    stop_grace: float = setting(
        0.0,
        "seconds running shards get to commit after SIGTERM/SIGINT (0: abandon)",
        stage="a stage commits nothing: its rows are the sink's",
        at_least=0,
    )
    worker_memory: str | None = setting(
        None,
        "emulate a mixed fleet: one worker per budget, e.g. 16GiB,24GiB,80GiB",
        stage="a Ray Data actor pool's actors are alike: give `gpu_memory`",
    )
    ray_address: str | None = setting(
        None,
        "Ray cluster to join (default RAY_ADDRESS, else start a local one)",
        stage="the stage runs on the dataset's Ray",
    )
    overwrite: bool = setting(False, "replace a different job at --output", stage=STAGE_SINKS)
    retry_errors: bool = setting(
        False,
        "also redo the error rows of committed shards; their ok images are kept as they are",
        stage="a stage resumes nothing: filter the error rows and run them again",
    )
    allow_unsafe_commits: bool = setting(
        False,
        "run on an output store whose fsspec backend cannot create an object only if absent "
        "(local disks, s3://, gs:// and az:// can): two attempts of a shard could then both commit",
        stage=STAGE_SINKS,
    )

    @classmethod
    def of(cls, **options) -> JobConfig:
        """From flat options as the table names them (`steps=4, max_batch=2, steps_column="n"`),
        unvalidated (`validate` checks it)."""
        return build(cls, options)

    def with_options(self, **options) -> JobConfig:
        """This job with some settings replaced, named as the table names them."""
        return with_values(self, options)

    def worker_budgets(self) -> list[int]:
        """`--worker-memory` as bytes, one entry per worker ([] when not given)."""
        from fleetgen.units import parse_size

        if not self.worker_memory:
            return []
        return [parse_size(v.strip(), "--worker-memory") for v in self.worker_memory.split(",")]

    def column_list(self, name: str) -> list[str] | None:
        """`keep_columns` or `drop_columns` as a list (None when not given)."""
        value = getattr(self, name)
        return None if value is None else [c.strip() for c in value.split(",") if c.strip()]

    def to_dict(self) -> dict:
        """As job.json's `config` holds it: every setting by its name, the parsed ones by their one spelling."""
        return {r.name: r.show(value_at(self, r)) for r in job_settings()}


@functools.cache
def job_settings() -> list[Row]:
    """The table: every setting of a job, in declaration order (the field table's plugins loaded)."""
    return table(JobConfig, group="execution", scope="job", fingerprint=False)


REQUIRED = ("input", "output", "model")


def option(name: str) -> str:
    """How messages name a setting: `--max-batch`."""
    row = next((r for r in job_settings() if r.name == name), None)
    return f"`{row.option if row else '--' + name.replace('_', '-')}`"


def load_toml(path: str) -> dict:
    """Settings from a TOML file: top-level keys named like the options (`max_batch` or `max-batch`)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError as err:
        raise ConfigError(f"`--config` file `{path}` does not exist.") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"`--config` file `{path}` is not valid TOML: {err}") from err
    rows = {n: r for r in job_settings() for n in (r.name, *r.aliases)}
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in rows:
            close = difflib.get_close_matches(name, list(rows), n=1)
            hint = f" Did you mean `{close[0]}`?" if close else f" Known settings: {', '.join(rows)}."
            raise ConfigError(f"Unknown setting `{key}` in {path}.{hint}")
        out[name] = coerce(rows[name], value, path)
    return out


def resolve_paths(config: JobConfig) -> JobConfig:
    """`--input`, `--output` and a local `--model` as one spelling each, made once on the driver:
    local paths absolute and real (`./x`, `../x`, `~/x`, `file:///x`, symlinks, trailing slashes
    all name the same place), so that every key is built from the same root and workers, whose
    working directory is not the driver's, reach the same files."""
    model = config.source.model
    if not is_hub_id(model):
        model = resolve_url(model)
    return config.with_options(input=resolve_url(config.input), output=resolve_url(config.output), model=model)


def make_config(options: dict, config_file: str | None = None, required: tuple[str, ...] = REQUIRED) -> JobConfig:
    """Options given on the command line (or as keywords) override the file; absent ones (None) fall
    through. `required`: what must be given (a Ray Data stage's input and output are its dataset's)."""
    values = load_toml(config_file) if config_file else {}
    given = canonical(
        {k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if v is not None}, job_settings()
    )
    values = {**canonical(values, job_settings()), **given}
    missing = [n for n in required if not values.get(n)]
    if missing:
        raise ConfigError(f"{', '.join(option(n) for n in missing)} required (on the command line or in `--config`).")
    return validate(JobConfig.of(**values), required)


def validate(config: JobConfig, required: tuple[str, ...] = REQUIRED) -> JobConfig:
    """Raise `ConfigError` naming the first invalid setting; return the config unchanged (the checks:
    jobs/validate.py, which reads this module's record and constants)."""
    from fleetgen.jobs.validate import validate as checked

    return checked(config, required)
