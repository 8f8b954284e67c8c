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
from fleetgen.offload.phasing import PHASES_CHOICES
from fleetgen.offload.planner import OFFLOAD_CHOICES
from fleetgen.offload.weight_formats import QuantizeSpec, parse_quantize, refusal
from fleetgen.units import parse_size
from fleetgen.workers.families.model_dir import is_hub_id, size_multiple
from fleetgen.workers.families.table import TASKS, TEXT
from fleetgen.workers.output.fields import MAX_FPS, MAX_FRAMES, MAX_IMAGES_PER_ROW, default_column
from fleetgen.workers.output.formats import format_names
from fleetgen.workers.output.layout import IMAGE_FORMATS
from fleetgen.workers.output.storage import resolve_url
from fleetgen.workers.output.video import MAX_CRF, VIDEO_FORMATS
from fleetgen.workers.rows.batches import Adapter, template_fields
from fleetgen.workers.rows.inputs import RESIZE_RULES
from fleetgen.workers.rows.shard import SETTING_ROLES, Columns
from fleetgen.workers.spec import DTYPE_NAMES, GenerationSettings

DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = ("auto", *DTYPE_NAMES)
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # org/name


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


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _option(name: str) -> str:
    return f"`--{name.replace('_', '-')}`"


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
