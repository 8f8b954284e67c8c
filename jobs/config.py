"""What a job is: one frozen `JobConfig`, from command-line options and/or a TOML file, validated
before anything starts."""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from pathlib import Path

from fleetgen.attention import AttentionSpec, parse_attention
from fleetgen.caches import CacheSpec, parse_cache
from fleetgen.errors import ConfigError
from fleetgen.offload.weight_formats import QuantizeSpec, parse_quantize
from fleetgen.scores import KeepRule, ScoreSpec, parse_keep, parse_scores
from fleetgen.units import parse_size
from fleetgen.workers.families.model_dir import HUB_ID, is_hub_id
from fleetgen.workers.families.table import TEXT
from fleetgen.workers.output.fields import default_column
from fleetgen.workers.output.storage import resolve_url
from fleetgen.workers.rows.batches import Adapter
from fleetgen.workers.rows.shard import SETTING_ROLES, Columns
from fleetgen.workers.spec import DTYPE_NAMES, GenerationSettings

DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = ("auto", *DTYPE_NAMES)


@dataclass(frozen=True)
class _Job:
    input: str  # Parquet file, directory or glob; any fsspec URL
    output: str  # output location; any fsspec URL
    model: str  # local pipeline directory or hub id
    # generation: part of the job's fingerprint
    steps: int | None = None  # denoising steps per image; default: the model family's (workers/families/detect.py)
    guidance: float | None = None  # guidance scale; default: the model family's
    true_cfg_scale: float | None = None  # Flux: > 1 applies negative prompts with true CFG (doubles the compute)
    family: str | None = None  # pipeline family; resolved from the model's model_index.json (jobs/models.py)
    # The settings that change pixels are parsed once, here (`__post_init__`: a string as typed, or the record),
    # and carried as their records from then on.
    quantize: QuantizeSpec = QuantizeSpec()  # none | auto | COMPONENT=FORMAT,... (offload/weight_formats.py)
    cache: CacheSpec = (
        CacheSpec()
    )  # none | first-block[:THRESHOLD] | taylorseer[:...] | magcache[:...] (fleetgen/caches.py)
    attention: AttentionSpec = AttentionSpec()  # native | auto | a backend; only an inexact one (sage) is fingerprinted
    # scorers run on every image after decoding, NAME[=MODEL],... (fleetgen/scores.py); and which images
    # are stored by their scores, e.g. 'clip>=0.26 and nsfw<0.5': both decide what the output holds
    score: ScoreSpec = ScoreSpec()
    keep: KeepRule = KeepRule()
    best_of: int = 1  # candidates per image, the best by `rank_by` stored (the others: filtered rows with their scores)
    rank_by: str | None = None  # a score (`-name`: the lowest wins)
    task: str | None = None  # text-to-image | image-to-image | inpaint | edit; default: the model's pipeline class's
    strength: float | None = None  # image-to-image, inpaint: how far from the input (default: the task's)
    resize: str = "crop"  # crop | pad | fit: how input images become the job's size (workers/rows/inputs.py)
    store_inputs: bool = False  # webdataset/parquet outputs carry each image's input beside it
    store_frames: bool = False  # video tasks: each clip's frames as PNGs beside it
    revision: str | None = None  # hub models: branch, tag or commit; pinned to a commit in job.json (default main)
    variant: str | None = None  # hub/local weights variant, e.g. fp16 (files named *.fp16.safetensors)
    width: int | None = None  # pixels, a multiple of 8; default 512 (video families: their card's size)
    height: int | None = None  # pixels, a multiple of 8; default 512 (video families: their card's size)
    seed: int = 0  # job seed; rows without a seed derive theirs from it and their id
    image_format: str = "png"  # png | jpeg | webp
    num_frames: int | None = None  # video tasks: frames per clip; default: the family's (Wan: 81)
    fps: float | None = None  # video tasks: frames per second of the stored clip; default: the family's
    video_format: str = "mp4"  # video tasks: mp4 (H.264) | webm (AV1)
    crf: int = 18  # video tasks: the encoder's constant rate factor (0 lossless .. 51; lower is larger)
    output_format: str = "files"  # files | webdataset | parquet
    prompt_column: str = "prompt"
    id_column: str = "id"  # used when present; else ids come from row positions
    seed_column: str = "seed"  # used when present
    negative_prompt_column: str = "negative_prompt"  # used when present
    # per-row settings (`steps_column` ...): added below, one per role of the field table
    images_per_prompt: int = 1  # images per row; ids become `<id>-<k>`, seeds (job seed, id, k)
    prompt_template: str | None = None  # e.g. "a {style} photo of a {label}": the prompt from columns
    lora: tuple[str, ...] = ()  # LoRA adapters on every image, each PATH_OR_ID[:SCALE]
    keep_columns: str | None = None  # carry only these input columns into the outputs (a,b,c)
    drop_columns: str | None = None  # carry every input column but these
    rows_per_shard: int = 256  # rows per unit of work and of commit; a row group is split into such ranges
    # execution: may change between a run and its resume
    workers: int | None = None  # actors; default one per GPU, else one per `cpu_threads` CPUs (same as max_workers)
    max_workers: int | None = None  # at most this many workers; on a cluster default: one per shard (≤ 1000),
    #                                 the autoscaler starts nodes for them up to the cluster's own limits
    gpus_per_worker: float | None = None  # Ray GPUs each worker asks for; default 1 for GPU workers,
    #                                       a fraction packs several on one GPU (each plans within its share)
    placement_timeout: float = 300.0  # seconds the job waits with no worker placed before it ends (exit 2)
    compile: bool = False  # torch.compile each worker's denoisers (regional where they have repeated blocks)
    cpu_threads: int = 1  # torch threads per CPU worker; CPU kernels round differently per thread count,
    #                       so a fixed number keeps images independent of how many workers run
    max_batch: int = 4  # images per pipeline call
    max_attempts: int = 3  # tries per shard before it is marked failed
    max_restarts: int = 3  # restarts of a worker whose process died, before it is dropped
    stop_grace: float = 0.0  # seconds running shards get to commit after SIGTERM/SIGINT
    offload: str = "auto"  # auto | none | block | leaf | disk: how workers may place the pipeline
    phases: str = "auto"  # auto | on | off: text encoders in a phase of their own (keeps pixels; per worker)
    gpu_memory: str | None = None  # device budget per worker, e.g. "24GiB"; default: free device memory
    host_memory: str | None = None  # host RAM per worker for offloaded copies; default: its share of the node
    worker_memory: str | None = None  # emulate a mixed fleet: "16GiB,24GiB,80GiB" = one worker per budget
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (the family's on CUDA, float32 on CPU) | float32 | float16 | bfloat16
    ray_address: str | None = None  # default: RAY_ADDRESS, else a local Ray
    overwrite: bool = False  # replace a different job found at `output`
    trust_remote_code: bool = False  # let the model repo run its own code (off: never)
    strict_prompts: bool = False  # over-long prompts are error rows instead of being truncated
    retry_errors: bool = False  # also redo the error rows of committed shards (ok images stay as they are)
    allow_unsafe_commits: bool = False  # run on a store whose backend cannot create-if-absent atomically

    def __post_init__(self) -> None:
        for name, parse in (("quantize", parse_quantize), ("cache", parse_cache), ("attention", parse_attention)):
            object.__setattr__(self, name, parse(getattr(self, name)))
        object.__setattr__(self, "score", parse_scores(self.score))
        object.__setattr__(self, "keep", parse_keep(self.keep, self.score))

    def settings(self) -> GenerationSettings:
        """What every image shares, once the family's defaults are resolved (jobs/models.py)."""
        if self.family is None or self.steps is None or self.guidance is None or self.width is None:
            raise ValueError("settings() needs the family's defaults resolved (jobs.models.resolve_defaults)")
        return GenerationSettings(
            steps=self.steps,
            guidance=self.guidance,
            width=self.width,
            height=self.height,
            seed=self.seed,
            image_format=self.image_format,
            output_format=self.output_format,
            family=self.family,
            true_cfg_scale=self.true_cfg_scale,
            quantize=self.quantize.pinned(),
            images_per_prompt=self.images_per_prompt,
            prompt_template=self.prompt_template,
            loras=tuple(parse_lora(v) for v in self.lora),
            task=self.task or TEXT,
            strength=self.strength,
            **{k: getattr(self, k) for k in ("resize", "store_inputs", "store_frames", "num_frames", "fps")},
            video_format=self.video_format,
            crf=self.crf,
            cache=self.cache,
            attention=self.attention,
            scores=self.score,
            keep=self.keep,
            best_of=self.best_of,
            rank_by=self.rank_by,
        )

    def budgets(self) -> tuple[int | None, int | None]:
        """`gpu_memory`, `host_memory` in bytes (None: the worker measures)."""
        return tuple(
            None if v is None else parse_size(v, f"--{n.replace('_', '-')}")
            for n, v in (("gpu_memory", self.gpu_memory), ("host_memory", self.host_memory))
        )

    def worker_budgets(self) -> list[int]:
        """`--worker-memory` as bytes, one entry per worker ([] when not given)."""
        if not self.worker_memory:
            return []
        return [parse_size(v.strip(), "--worker-memory") for v in self.worker_memory.split(",")]

    def columns(self) -> Columns:
        """The column names asked for; `jobs.sharding.resolve_columns` checks them against the input."""
        return Columns(
            self.prompt_column,
            self.id_column,
            self.seed_column,
            self.negative_prompt_column,
            **{role: getattr(self, f"{role}_column") for role in SETTING_ROLES},
        )

    def column_list(self, name: str) -> list[str] | None:
        """`keep_columns` or `drop_columns` as a list (None when not given)."""
        value = getattr(self, name)
        return None if value is None else [c.strip() for c in value.split(",") if c.strip()]

    def to_dict(self) -> dict:
        """As job.json's `config` holds it: every option, the parsed settings by their one spelling."""
        return {
            **asdict(self),
            "quantize": self.quantize.label,
            "cache": self.cache.label,
            "attention": self.attention.backend,
            "score": self.score.label,
            "keep": self.keep.label,
        }


# Per-row settings: each `<role>_column`, when the input has that column, overrides the job's setting
# for its row (`steps_column = "steps"`, ...; workers/output/fields.py has one entry per role).
JobConfig = make_dataclass(
    "JobConfig",
    [(f"{role}_column", "str", field(default=default_column(role))) for role in SETTING_ROLES],
    bases=(_Job,),
    frozen=True,
)
JobConfig.__module__ = __name__
JobConfig.__doc__ = "A job: every option of `fleetgen run`, frozen. Validated by `validate`."

FIELDS = {f.name: f for f in fields(JobConfig)}
_REQUIRED = ("input", "output", "model")


def parse_lora(value: str) -> Adapter:
    """`PATH_OR_ID[:SCALE]`; a local path is made absolute (workers do not share the driver's
    working directory)."""
    source, scale = value, 1.0
    head, sep, tail = value.rpartition(":")
    if sep:
        try:
            source, scale = head, float(tail)
        except ValueError:
            pass  # not a scale: part of the path
    if not source:
        raise ConfigError(f"`--lora` must be PATH_OR_ID[:SCALE], got `{value}`.")
    if not math.isfinite(scale):
        raise ConfigError(f"`--lora` `{value}`: the scale must be a finite number.")
    local = Path(source).expanduser()
    if local.exists():
        source = str(local.resolve())
    elif (
        source.startswith(("/", "./", "../", "~"))
        or source.endswith((".safetensors", ".bin"))
        or not HUB_ID.fullmatch(source)
    ):
        raise ConfigError(f"`--lora` `{source}` is neither an existing file or directory nor a hub id like `org/name`.")
    return Adapter(source, scale)


def _option(name: str) -> str:
    return f"`--{name.replace('_', '-')}`"


def _coerce(name: str, value: object, source: str) -> object:
    """Type-check one setting from a TOML file (CLI values are typed by argparse)."""
    kind = FIELDS[name].type
    wanted = {
        "int": int,
        "float": (int, float),
        "str": str,
        "bool": bool,
        "int | None": int,
        "str | None": str,
        "float | None": (int, float),
        "tuple[str, ...]": list,
        "QuantizeSpec": str,  # parsed by JobConfig itself
        "CacheSpec": str,
        "AttentionSpec": str,
        "ScoreSpec": str,
        "KeepRule": str,
    }[kind]
    if (
        isinstance(value, bool)
        and kind != "bool"
        or not isinstance(value, wanted)
        or (kind.startswith("tuple") and not all(isinstance(v, str) for v in value))
    ):
        shown = "a list of strings" if kind.startswith("tuple") else kind.replace(" | None", "")
        raise ConfigError(f"`{name}` in {source} must be {shown}, got `{value!r}`.")
    if kind.startswith("tuple"):
        return tuple(value)
    return float(value) if kind.startswith("float") else value


def load_toml(path: str) -> dict:
    """Settings from a TOML file: top-level keys named like the options (`max_batch` or `max-batch`)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError as err:
        raise ConfigError(f"`--config` file `{path}` does not exist.") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"`--config` file `{path}` is not valid TOML: {err}") from err
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"Unknown setting `{key}` in {path}. Known settings: {', '.join(FIELDS)}.")
        out[name] = _coerce(name, value, path)
    return out


def resolve_paths(config: JobConfig) -> JobConfig:
    """`--input`, `--output` and a local `--model` as one spelling each, made once on the driver:
    local paths absolute and real (`./x`, `../x`, `~/x`, `file:///x`, symlinks, trailing slashes
    all name the same place), so that every key is built from the same root and workers, whose
    working directory is not the driver's, reach the same files."""
    model = config.model
    if not is_hub_id(model):
        model = resolve_url(model)
    return replace(config, input=resolve_url(config.input), output=resolve_url(config.output), model=model)


def make_config(options: dict, config_file: str | None = None) -> JobConfig:
    """Options given on the command line override the file; absent ones (None) fall through."""
    values = load_toml(config_file) if config_file else {}
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if v is not None})
    missing = [n for n in _REQUIRED if not values.get(n)]
    if missing:
        raise ConfigError(f"{', '.join(_option(n) for n in missing)} required (on the command line or in `--config`).")
    return validate(replace(JobConfig(input="", output="", model=""), **values))


def validate(config: JobConfig) -> JobConfig:
    """Raise `ConfigError` naming the first invalid setting; return the config unchanged (the checks:
    jobs/validate.py, which reads this module's record and constants)."""
    from fleetgen.jobs.validate import validate as checked

    return checked(config)
