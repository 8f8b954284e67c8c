"""The records `jobs/` and `cluster/` exchange with a worker: what a job asks of every image (and the
one workload the planner derives from it), what a worker needs to start, and what it reports back.
Plain, picklable data: no torch here, so the driver, `status` and `verify` import it without loading
a framework."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fleetgen.attention import AttentionSpec, parse_attention
from fleetgen.caches import CacheSpec, parse_cache
from fleetgen.errors import ConfigError
from fleetgen.offload.architectures import NAMES as ARCHITECTURES
from fleetgen.offload.cost import Workload
from fleetgen.offload.phasing import PHASES_CHOICES
from fleetgen.offload.planner import OFFLOAD_CHOICES
from fleetgen.offload.weight_formats import QuantizeSpec, parse_quantize
from fleetgen.scores import MAX_CANDIDATES, SCORERS, KeepRule, ScoreSpec, parse_keep, parse_scores
from fleetgen.settings import build, nested, setting, with_values
from fleetgen.units import format_size, parse_size
from fleetgen.workers.families.table import FAMILIES, GENERIC, TASKS, Task
from fleetgen.workers.output.fields import MAX_FPS, MAX_FRAMES, MAX_IMAGES_PER_ROW
from fleetgen.workers.output.formats import FORMATS, format_names, get_format
from fleetgen.workers.output.layout import IMAGE_FORMATS
from fleetgen.workers.output.video import VIDEO_FORMATS
from fleetgen.workers.rows.batches import Adapter, Look, Recipe, parse_lora
from fleetgen.workers.rows.inputs import RESIZE_RULES
from fleetgen.workers.rows.shard import Columns

DTYPE_NAMES = ("float32", "float16", "bfloat16")  # `--dtype` besides auto (workers/pipeline/load.py maps them)
DTYPES = ("auto", *DTYPE_NAMES)

# Why a Ray Data stage (cluster/ray_data.py) has no output setting of a job: its rows go to a sink.
STAGE_SINKS = "a Ray Data pipeline stores its rows with its own sinks (`write_parquet`, `write_webdataset`, ...)"


@dataclass(frozen=True)
class GenerationSettings:
    """What every image of a job shares: part of the job's fingerprint. Each field is a setting
    (fleetgen/settings.py: an option of `fleetgen run`, a keyword of `fleetgen.run`, a TOML key). The
    ones left None are the model family's, filled in on the driver before any worker starts
    (jobs/models.py `resolve_defaults`). The settings that change pixels in a form of their own
    (`quantize`, `cache`, ...) are parsed once, here, from the string as typed, and carried as records."""

    family: str | None = setting(
        None,
        "the model's entry in the family table (docs/reference/families.md), where the checkpoint does not say, e.g. "
        "z-image for the base model (default: detected from model_index.json, the transformer's config, the name)",
        group="job",
    )
    steps: int | None = setting(
        None, "denoising steps (default: the model family's, e.g. 30 for SD, 28 for FLUX.1-dev)", at_least=1, plan=True
    )
    guidance: float | None = setting(
        None, "guidance scale (default: the model family's, e.g. 7.5 for SD, 3.5 for FLUX.1-dev)", at_least=0, plan=True
    )
    true_cfg_scale: float | None = setting(
        None,
        "Flux: apply negative prompts with true CFG at this scale (> 1; doubles the compute)",
        more_than=0,
        plan=True,
    )
    quantize: QuantizeSpec = setting(
        QuantizeSpec(),
        "none (default), auto (each worker's planner may quantize where that is faster or the only fit), or "
        "a format per component, e.g. transformer=fp8,text_encoder=int8 (fp8, int8, nf4, bnb-int8, gguf:PATH); "
        "changes pixels",
        shown=lambda v: v.label,
        plan=True,
    )
    cache: CacheSpec = setting(
        CacheSpec(),
        "step cache on the denoiser: none (default), first-block[:THRESHOLD] (skip the other blocks while "
        "the first one's output changes less than THRESHOLD, default 0.05; one image per call) or "
        "taylorseer[:interval=N,warmup=W,order=K] (compute every N-th step, predict the rest) or "
        "magcache[:threshold=T,max_skip=K,retention=R] (FLUX.1: skip whole steps by its published ratios); "
        "changes pixels",
        shown=lambda v: v.label,
        plan=True,
    )
    attention: AttentionSpec = setting(
        AttentionSpec(),
        "attention kernel of the denoiser: native (default: torch SDPA), auto (each worker measures the exact "
        "kernels it has and keeps the fastest), or a diffusers backend (flash, _flash_3, _native_cudnn, xformers, "
        "...; an exact one may differ per worker, sage changes pixels and is the job's)",
        shown=lambda v: v.backend,
    )
    task: str | None = setting(
        None,
        "what the model does with each row (default: what its pipeline class does); e.g. "
        "`--task image-to-image` or `--task inpaint` on an SD directory (its weights serve both)",
        choices=TASKS,
        plan=True,
    )
    strength: float | None = setting(
        None,
        "image-to-image, inpaint: how far from the input, 0 to 1 (default: the task's, e.g. 0.8 for SD "
        "img2img); a `strength` column sets it per row",
        at_least=0,
        at_most=1,
    )
    resize: str = setting(
        "crop",
        "how an input image becomes the image's size: crop (default: scale to cover, cut the middle), "
        "pad (scale to fit, pad black), fit (scale to the size, aspect or not)",
        choices=RESIZE_RULES,
    )
    store_inputs: bool = setting(
        False,
        "webdataset/parquet output: carry each image's input beside it (<id>.input.png; an "
        "`input_image` column), for before/after datasets",
        stage="each row keeps its input columns as they were: the input is beside the image already",
    )
    store_frames: bool = setting(
        False,
        "video tasks: store every frame of a clip as a PNG beside it (<id>.frame-0000.png ...; parquet: a "
        "`frames` column), lossless, for datasets that train on frames",
        stage="a stage's row holds the clip (`video`); decode its frames where the pipeline needs them",
    )
    width: int | None = setting(
        None, "pixels, a multiple of 8 (default 512, `fleetgen plan` 1024; video families: their card's)", plan=True
    )
    height: int | None = setting(
        None, "pixels, a multiple of 8 (default 512, `fleetgen plan` 1024; video families: their card's)", plan=True
    )
    seed: int = setting(0, "job seed: rows without a `seed` column derive theirs from it and their id", at_least=0)
    image_format: str = setting("png", "how each image is stored", choices=IMAGE_FORMATS)
    num_frames: int | None = setting(
        None,
        "video tasks: frames per clip (default: the family's, e.g. 81 for Wan, which makes 4k+1); "
        "a `num_frames` column sets it per row",
        at_least=1,
        at_most=MAX_FRAMES,
        plan=True,
    )
    fps: float | None = setting(
        None,
        "video tasks: frames per second of the stored clip (default: the family's, e.g. 16 for Wan); an "
        "`fps` column sets it per row",
        more_than=0,
        at_most=MAX_FPS,
    )
    video_format: str = setting("mp4", "video tasks: mp4 (H.264, yuv420p) or webm (AV1)", choices=tuple(VIDEO_FORMATS))
    crf: int = setting(18, "video tasks: the encoder's quality, 0 (lossless) to 51; lower is larger")
    output_format: str = setting(
        "files",
        lambda: "default files; " + "; ".join(f"{n}: {FORMATS[n].description}" for n in format_names()),
        choices=format_names,
        stage=STAGE_SINKS,
    )
    prompt_template: str | None = setting(
        None,
        "build each prompt from columns, e.g. 'a {style} photo of a {label}' "
        "(the manifest keeps the rendered prompt and the template)",
        group="synthesis",
    )
    images_per_prompt: int = setting(
        1,
        "images per row; ids become <id>-<k>, each with its own stable seed; a `num_images` column overrides "
        "it per row",
        group="synthesis",
        at_least=1,
        at_most=MAX_IMAGES_PER_ROW,
    )
    lora: tuple[Adapter, ...] = setting(
        (),
        "a LoRA adapter on every image (repeatable); a row's `lora` column replaces them for that row",
        group="synthesis",
        metavar="PATH_OR_ID[:SCALE]",
        shown=lambda v: [a.label for a in v],
    )
    score: ScoreSpec = setting(
        ScoreSpec(),
        "score every image on its worker right after decoding, into `score_<name>` fields: "
        + "; ".join(f"{s.name} ({s.doc})" for s in SCORERS.values())
        + ". MODEL: a hub id (ORG/NAME[@REV], pinned to a commit like --model) or a local directory "
        "(default: each scorer's published model)",
        group="synthesis",
        metavar="NAME[=MODEL],...",
        shown=lambda v: v.label,
        plan=True,
    )
    keep: KeepRule = setting(
        KeepRule(),
        "store only the images whose scores pass, e.g. 'clip>=0.26 and nsfw<0.5' (the rest are `filtered` "
        "rows with their scores)",
        group="synthesis",
        metavar="RULE",
        shown=lambda v: v.label,
    )
    best_of: int = setting(
        1,
        "make N candidates per image (each its own seed) and store the best by --rank-by; every candidate's "
        "scores stay in the manifest",
        group="synthesis",
        metavar="N",
        at_least=1,
        at_most=MAX_CANDIDATES,
    )
    rank_by: str | None = setting(
        None, "the score --best-of ranks by, highest first (`-NAME`: lowest first)", group="synthesis", metavar="NAME"
    )

    def __post_init__(self) -> None:
        for name, parse in (("quantize", parse_quantize), ("cache", parse_cache), ("attention", parse_attention)):
            object.__setattr__(self, name, parse(getattr(self, name)))
        object.__setattr__(self, "score", parse_scores(self.score))
        object.__setattr__(self, "keep", parse_keep(self.keep, self.score))
        if isinstance(self.lora, str):
            raise ConfigError(f"`lora` takes a list of adapters (PATH_OR_ID[:SCALE]), got the string `{self.lora}`.")
        object.__setattr__(self, "lora", tuple(parse_lora(v) for v in self.lora))

    @property
    def resolved(self) -> bool:
        """Whether the family's defaults are filled in (jobs/models.py): what a worker needs."""
        return None not in (self.family, self.task, self.steps, self.guidance, self.width, self.height)

    def record(self) -> dict:
        """The settings as job.json's fingerprint holds them: each parsed setting by its one spelling
        (an exact attention kernel as `exact`: each worker's own choice)."""
        out = asdict(self)
        out.update(quantize=self.quantize.label, cache=self.cache.label, attention=self.attention.label)
        # job.json's spellings since its first version: a job made then resumes
        out.update(scores=self.score.label, keep=self.keep.label, loras=out.pop("lora"))
        del out["score"]
        return out

    def workload(
        self,
        max_batch: int = 4,
        offload: str = "auto",
        size: tuple[int, int] | None = None,
        references: int = 1,
        phases: str = "auto",
    ) -> Workload:
        """What the planner plans for: this job's images (at `size`, the largest of the job where rows
        have sizes of their own), at most `max_batch` per call, with `references` input images each
        (an edit model's that join the denoiser's sequence). The one translation from a job to the
        planner: `fleetgen plan`, `fleetgen calibrate` and every worker use it. `phases`: whether the
        text encoders may run in a phase of their own (off where `phase_refusal` says why not)."""
        family, task = FAMILIES.get(self.family, GENERIC), self.task_spec()
        width, height = size or (self.width, self.height)
        # one row per call where the task takes its references together, or a first-block cache decides per call
        one_per_call = not task.batched or self.cache.per_call
        return Workload(
            width=width,
            height=height,
            steps=self.steps,
            cfg=family.doubles_batch(self.guidance, self.true_cfg_scale),
            cfg_calls=family.extra_calls(self.guidance, self.true_cfg_scale),
            max_batch=1 if one_per_call else max_batch,
            offload=offload,
            quantize=self.quantize,
            cache=self.cache,
            input_images=min(references, task.images),
            in_sequence=task.in_sequence,
            frames=(self.num_frames or 0) if task.video else 0,
            phases="off" if self.phase_refusal() else phases,
            # a task that takes images has the VAE encode them in phase 2: it decodes there too
            decode_apart=not family.decode_apart and not task.takes_images,
        )

    def phase_refusal(self) -> str:
        """Why this job's images cannot be made phased (offload/phasing.py), or ""."""
        return FAMILIES.get(self.family, GENERIC).phased

    def media_format(self) -> str:
        """What each object of the job is encoded as: the video format for video tasks, else the image format."""
        return self.video_format if self.task_spec().video else self.image_format

    def task_spec(self) -> Task:
        family = FAMILIES.get(self.family)
        found = family.task(self.task) if family is not None else None
        return found or Task(self.task, "")

    def companions(self) -> tuple[str, ...]:
        """The image columns stored beside each image: its inputs (`--store-inputs`), a clip's poster
        and (`--store-frames`) its frames."""
        task = self.task_spec()
        inputs = ("input_image", "mask_image") if task.mask else ("input_image",)
        video = ("poster", *(("frames",) if self.store_frames else ())) if task.video else ()
        return (inputs if self.store_inputs else ()) + video

    def recipe(self, size_multiple: int = 8) -> Recipe:
        task = self.task_spec()
        given = {"strength": self.strength, "num_frames": self.num_frames, "fps": self.fps}
        extra = tuple((k, v) for k, v in given.items() if v is not None)
        family = FAMILIES.get(self.family)
        return Recipe(
            Look(self.width, self.height, self.steps, self.guidance, self.lora, extra),
            seed=self.seed,
            images_per_prompt=self.images_per_prompt,
            template=self.prompt_template,
            size_multiple=size_multiple,
            dotless_ids=get_format(self.output_format).dotless_ids,
            input_images=task.images,
            mask=task.mask,
            frame_step=family.frame_step if family is not None and task.video else 0,
            candidates=self.best_of,
        )


def makes_clips(generation: dict) -> bool:
    """Whether a job's recorded generation settings (job.json's fingerprint) are a video task's:
    every video task has its frames resolved, no image task has any."""
    return bool(generation.get("num_frames"))


@dataclass(frozen=True)
class Source:
    """Which weights a worker loads, and how. `model`, `revision` and `variant` are the job's (its
    fingerprint names the weights); the device, the dtype and trusting the model's code are each
    worker's to run with."""

    model: str = setting(
        "",
        lambda: (
            "pipeline directory or hub id (`fleetgen plan`: a pipeline directory, or a shipped architecture: "
            f"{', '.join(ARCHITECTURES)})"
        ),
        group="job",
        scope="job",
        fingerprint=True,
        plan=True,
    )
    revision: str | None = setting(
        None,
        "hub model: branch, tag or commit (default main, resolved once to a commit and "
        "pinned in job.json so workers and resumes use the same weights)",
        group="job",
        scope="job",
        fingerprint=True,
    )
    variant: str | None = setting(
        None, "weights variant, e.g. fp16 (loads *.fp16.safetensors)", group="job", scope="job", fingerprint=True
    )
    device: str = setting(
        "auto",
        "where workers compute: auto | cpu | cuda | cuda:N (default auto: GPU workers "
        "on a cluster or a machine with GPUs, else CPU)",
    )
    dtype: str = setting(
        "auto",
        "auto | float32 | float16 | bfloat16 (default auto: the family's on CUDA, float32 on CPU; `fleetgen plan`: "
        "the family's)",
        choices=DTYPES,
        plan=True,
    )
    trust_remote_code: bool = setting(False, "allow the model repo to run its own code (off by default)", scope="job")
    adapters: tuple[tuple[str, str], ...] = ()  # every LoRA the job uses (flags, `lora` column): (as named, location)


@dataclass(frozen=True)
class Fit:
    """How each worker fits the pipeline to its device and runs it: its own choices, none of which
    changes an image's pixels (they are in its record, not in the fingerprint)."""

    max_batch: int = setting(
        4, "images per pipeline call, at most (each worker sizes its own batch up to it)", at_least=1, plan=True
    )
    offload: str = setting(
        "auto", "how workers place the pipeline (default auto: planned per device)", choices=OFFLOAD_CHOICES, plan=True
    )
    phases: str = setting(
        "auto",
        "text encoders in a phase of their own, a chunk of prompts at a time, then the denoiser (default "
        "auto: where each worker's plan predicts it faster; keeps pixels)",
        choices=PHASES_CHOICES,
        plan=True,
    )
    compile: bool = setting(
        False,
        "torch.compile each worker's denoisers (regional where they have repeated blocks; keeps pixels; "
        "compile time in workers/<w>.json)",
    )
    gpu_memory: int | None = setting(
        None,
        "device budget per worker, e.g. 24GiB (default: free memory; on CPU workers, plan as if the device had "
        "this much)",
        shown=format_size,
        written="size",
    )
    host_memory: int | None = setting(
        None,
        "host RAM per worker for offloaded copies (default: the node's RAM split between its workers; "
        "`fleetgen plan`: 80 % of this machine's)",
        shown=format_size,
        written="size",
        plan=True,
    )
    strict_prompts: bool = setting(
        False, "a prompt longer than the text encoder takes is an error row (default: truncate, noted per row)"
    )
    plan_trials: str = setting(
        "auto",
        "time the plans the model ranks closest on the worker's own device, a few denoiser steps each with the "
        "job's shapes, and keep the fastest measured; once per device kind, shared through the output (default "
        "auto: where the best are closer than the speed model's error; keeps pixels)",
        choices=("auto", "on", "off"),
    )
    host_copy: str = setting(
        "node",
        "where the host copy of the weights lives: `node`, one copy in the node's shared memory (/dev/shm) that "
        "every worker of the node maps (on CUDA, pinned in place), or `worker`, a copy per worker (default node; "
        "falls back to a copy per worker, with one line, where shared memory is missing or too small; keeps pixels)",
        choices=("node", "worker"),
        plan=True,
    )
    # this worker's share of its node's RAM where its host budget is that share (cluster/actor.py): what it pays of
    # the node's shared copy of the weights; 0: its budget is its own (given, or what the probe read free)
    node_share: float = 0.0
    plan_size: tuple[int, int] | None = None  # the largest (width, height) of the job, planned for (the driver's)
    shard_images: int = 0  # images in a shard (the driver's): what the plan trials' cap is a share of

    def __post_init__(self) -> None:
        for name in ("gpu_memory", "host_memory"):  # as typed (`24GiB`), or bytes
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, parse_size(value, f"--{name.replace('_', '-')}"))


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start; picklable, so Ray can ship it to an actor. The job's
    records as the driver resolved them, and what it decided for this worker."""

    name: str  # worker name in stats and manifests, e.g. "w0"
    output: str  # the job's output URL
    source: Source = nested(Source, group="execution", scope="worker", fingerprint=False)
    settings: GenerationSettings = nested(GenerationSettings, group="generation", scope="job", fingerprint=True)
    columns: Columns = field(default_factory=Columns)
    fit: Fit = nested(Fit, group="execution", scope="worker", fingerprint=False)
    threads: int | None = None  # torch CPU threads; None leaves torch's default
    lock_token: str | None = None  # the driver's `OUT/_LOCK` token: no commit once the lock names another (or none)
    commit_interval: float = 0.0  # seconds between a shard's part commits (workers/output/parts.py); 0: whole shards

    @classmethod
    def of(cls, name: str, model: str, output: str, settings: GenerationSettings, columns: Columns, **options):
        """From flat options, each put in the record it belongs to (`max_batch=2, device="cpu"`)."""
        return build(cls, {"model": model, **options}, name=name, output=output, settings=settings, columns=columns)

    def with_options(self, **options) -> WorkerSpec:
        """This spec with flat options replaced where they live (`max_batch=1`, `device="cpu"`)."""
        return with_values(self, options)


@dataclass(frozen=True)
class BatchDone:
    """Progress: one pipeline call finished."""

    shard_id: str
    worker: str
    images: int
    errors: int
    rows: float = 0.0  # input rows this call finished: each image is 1/N of a row that makes N
    frames: int = 0  # video tasks: frames of the clips it made
    made: int = 0  # images it set out to make (a decode phase's: 0, its batches counted them)


@dataclass(frozen=True)
class PartCommitted:
    """A shard's attempt committed a part: rows `[first, end)`; of their images, `made` by this attempt,
    `images` stored (ok) and `errors` error rows."""

    shard_id: str
    worker: str
    first: int
    end: int
    made: int
    images: int
    errors: int


@dataclass(frozen=True)
class ShardResult:
    shard_id: str
    worker: str
    ok: int
    errors: int
    seconds: float  # wall time of the whole shard, reading to commit
    committed_by_other: bool = False  # another attempt of this shard committed first; this one wrote nothing more
    counts: dict | None = None  # the committed manifest's counts (its footer's), so the driver need not read it
    version: str | None = None  # the committed manifest's version, as a listing of shards/ would show it
    stopped: bool = False  # its process was told to stop (SIGTERM): it committed what it made; the rest is to do
    redone: int = 0  # images it made that another attempt's commit made too (thrown away)
