"""The records `jobs/` and `cluster/` exchange with a worker: what a job asks of every image (and the
one workload the planner derives from it), what a worker needs to start, and what it reports back.
Plain, picklable data: no torch here, so the driver, `status` and `verify` import it without loading
a framework."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fleetgen.attention import AttentionSpec
from fleetgen.caches import CacheSpec
from fleetgen.offload.cost import Workload
from fleetgen.offload.weight_formats import QuantizeSpec
from fleetgen.scores import KeepRule, ScoreSpec
from fleetgen.workers.families.table import FAMILIES, GENERIC, TEXT, Task
from fleetgen.workers.output.formats import get_format
from fleetgen.workers.rows.batches import Adapter, Look, Recipe
from fleetgen.workers.rows.shard import Columns

DTYPE_NAMES = ("float32", "float16", "bfloat16")  # `--dtype` besides auto (workers/pipeline/load.py maps them)


@dataclass(frozen=True)
class GenerationSettings:
    """What every image of a job shares. Part of the job fingerprint."""

    steps: int = 30  # denoising steps per image
    guidance: float = 7.5  # classifier-free guidance scale
    width: int = 512  # pixels; must suit the model (a multiple of its VAE scale factor)
    height: int = 512
    seed: int = 0  # job seed: rows without a `seed` column derive theirs from it
    image_format: str = "png"  # png | jpeg | webp
    output_format: str = "files"  # files | webdataset | parquet
    family: str = "sd"  # pipeline family (workers/families/detect.py): how the pipeline is called
    true_cfg_scale: float | None = None  # Flux: > 1 applies negative prompts (true CFG)
    quantize: QuantizeSpec = QuantizeSpec()  # storage format per component (offload/weight_formats.py)
    images_per_prompt: int = 1  # images per row (a row's `num_images` column overrides it)
    prompt_template: str | None = None  # builds each prompt from columns, e.g. "a {style} photo of a {label}"
    loras: tuple[Adapter, ...] = ()  # adapters on every image (a row's `lora` column replaces them)
    task: str = TEXT  # text-to-image | image-to-image | inpaint | edit (workers/families/table.py)
    strength: float | None = None  # tasks that take one: the job's (a row's `strength` replaces it)
    resize: str = "crop"  # how input images become the image's size (workers/rows/inputs.py)
    store_inputs: bool = False  # webdataset and parquet outputs carry each image's input beside it
    store_frames: bool = False  # video tasks: every frame of a clip also stored as a PNG beside it
    num_frames: int | None = None  # video tasks: frames per clip (a row's `num_frames` replaces it)
    fps: float | None = None  # video tasks: frames per second (a row's `fps` replaces it)
    video_format: str = "mp4"  # video tasks: mp4 (H.264) | webm (AV1) (workers/output/video.py)
    crf: int = 18  # video tasks: the encoder's constant rate factor (lower: larger, closer to the frames made)
    cache: CacheSpec = CacheSpec()  # step cache on the denoiser (fleetgen/caches.py): changes pixels
    attention: AttentionSpec = AttentionSpec()  # the kernel asked for; the fingerprint holds only an inexact one
    scores: ScoreSpec = ScoreSpec()  # scorers run on every image after decoding (fleetgen/scores.py)
    keep: KeepRule = KeepRule()  # which images are stored, by their scores
    best_of: int = 1  # candidates made per image, the best stored (by `rank_by`, a score; `-name`: the lowest)
    rank_by: str | None = None

    def record(self) -> dict:
        """The settings as job.json's fingerprint holds them: each parsed setting by its one spelling
        (an exact attention kernel as `exact`: each worker's own choice)."""
        out = asdict(self)
        out.update(quantize=self.quantize.label, cache=self.cache.label, attention=self.attention.label)
        out.update(scores=self.scores.label, keep=self.keep.label)
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
            Look(self.width, self.height, self.steps, self.guidance, self.loras, extra),
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
class WorkerSpec:
    """Everything a worker needs to start; picklable, so Ray can ship it to an actor."""

    name: str  # worker name in stats and manifests, e.g. "w0"
    model: str  # local directory or hub id, loaded with DiffusionPipeline.from_pretrained
    output: str  # the job's output URL
    settings: GenerationSettings
    columns: Columns
    max_batch: int = 4  # images per pipeline call
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (the family's on CUDA, float32 on CPU) | float32 | float16 | bfloat16
    threads: int | None = None  # torch CPU threads; None leaves torch's default
    offload: str = "auto"  # auto | none | block | leaf | disk (see offload.planner)
    gpu_memory: int | None = None  # device budget in bytes; default: free device memory (CPU: no planning)
    host_memory: int | None = None  # host RAM for offloaded copies; default: 80% of available
    trust_remote_code: bool = False  # never run a model repo's own code unless asked
    strict_prompts: bool = False  # a prompt longer than the text encoder takes is an error, not truncated
    revision: str | None = None  # hub models: the commit the driver pinned
    variant: str | None = None  # weights variant, e.g. fp16
    adapters: tuple[tuple[str, str], ...] = ()  # every LoRA the job uses (flags, `lora` column): (as named, location)
    plan_size: tuple[int, int] | None = None  # the largest (width, height) in the job, planned for
    compile: bool = False  # torch.compile the denoisers (regional where they have repeated blocks)
    attention: AttentionSpec = AttentionSpec()  # the kernel: native | auto (the fastest exact one here) | a backend
    lock_token: str | None = None  # the driver's `OUT/_LOCK` token: no commit once the lock names another (or none)
    phases: str = "auto"  # auto | on | off: the text encoders in a phase of their own (offload/phasing.py)

    def source(self) -> Source:
        return Source(
            self.model, self.device, self.dtype, self.trust_remote_code, self.revision, self.variant, self.adapters
        )

    def fit(self) -> Fit:
        return Fit(
            self.max_batch,
            self.offload,
            self.gpu_memory,
            self.host_memory,
            self.compile,
            self.attention,
            self.plan_size,
            self.phases,
        )


@dataclass(frozen=True)
class BatchDone:
    """Progress: one pipeline call finished."""

    shard_id: str
    worker: str
    images: int
    errors: int
    rows: float = 0.0  # input rows this call finished: each image is 1/N of a row that makes N
    frames: int = 0  # video tasks: frames of the clips it made


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


@dataclass(frozen=True)
class Source:
    """Which weights to load, and how (the job's adapters with them)."""

    model: str  # local directory or hub id, loaded with DiffusionPipeline.from_pretrained
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (the family's on CUDA, float32 on CPU) | float32 | float16 | bfloat16
    trust_remote_code: bool = False
    revision: str | None = None
    variant: str | None = None
    adapters: tuple[tuple[str, str], ...] = ()  # (as named, location)


@dataclass(frozen=True)
class Fit:
    """How a worker may fit its pipeline to its device: each worker's own choices, none of which
    changes pixels (budgets, placements, batch, compile, an exact attention kernel)."""

    max_batch: int = 4  # images per pipeline call, at most
    offload: str = "auto"  # auto | none | block | leaf | disk: which placements may be used
    gpu_memory: int | None = None  # device budget in bytes; default: free device memory (CPU: no planning)
    host_memory: int | None = None  # host RAM for offloaded copies; default: 80 % of available
    compile: bool = False  # torch.compile the denoisers, after the cache (workers/pipeline/compiling.py)
    attention: AttentionSpec = AttentionSpec()  # native | auto | a diffusers backend (workers/pipeline/attention.py)
    plan_size: tuple[int, int] | None = None  # the largest (width, height) of the job, planned for
    phases: str = "auto"  # auto | on | off: the text encoders in a phase of their own, a chunk at a time
