"""What an entry of the family table (workers/families/table.py) says: how a kind of pipeline is
called, for which tasks (workers/families/tasks.py), and its defaults. No torch here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fleetgen.workers.families.tasks import Task, text_task

# How the job's `--guidance` reaches the pipeline (Family.guidance_arg).
GUIDANCE_ARGS = ("guidance_scale", "true_cfg_scale", "distilled_guidance_scale", "guider")


def frame_count_error(n: int, step: int, who: str = "the model") -> str | None:
    """Why a clip of `n` frames cannot be made where counts must be step x k + 1, or None."""
    if step > 1 and (n - 1) % step:
        below, above = (n - 1) // step * step + 1, ((n - 1) // step + 1) * step + 1
        return f"num_frames `{n}` is not {step}k+1, which {who} makes (e.g. {max(below, 1)} or {above})"
    return None


@dataclass(frozen=True)
class Family:
    name: str
    pipelines: tuple[str, ...]  # diffusers pipeline class names (model_index.json `_class_name`)
    steps: int  # default denoising steps
    guidance: float  # default guidance (0 where the model is distilled without it)
    dtype: str  # default dtype on CUDA (CPU computes in float32)
    # How a negative prompt is applied: "negative_prompt" (a second, unconditional pass, under
    # guidance above 1), "true_cfg" (FLUX.1: only with `--true-cfg-scale` above 1), "none" (the
    # pipeline takes none: a negative-prompt column is refused).
    negative: str
    tokenizer: str  # the pipeline attribute whose tokenizer reads the whole prompt (the longest limit)
    max_sequence_length: int | None  # passed to the pipeline and the prompt limit; None: the tokenizer's own
    cfg: bool  # guidance above 1 runs a second, unconditional pass of the denoiser
    extra: dict = field(default_factory=dict)  # fixed call arguments
    note: str = ""
    # What the pipeline's own input check demands of width and height, whatever the VAE (diffusers'
    # SD, SDXL and PixArt pipelines refuse sizes that are not multiples of 8); the VAE scale x patch
    # multiple of the model is added to it (workers/families/model_dir.py, workers/pipeline/load.py).
    size_floor: int = 8
    # The pipeline decodes with its VAE cast to float32 when the run dtype is float16 and the VAE's
    # config says `force_upcast` (SDXL): the planner counts that VAE at 4 bytes per weight and
    # activation, and never streams it (its pinned copy would stay float16).
    upcasts_vae: bool = False
    # The keyword the job's guidance is passed as: `guidance_scale`; `true_cfg_scale` (Qwen-Image,
    # whose `guidance_scale` is only for guidance-distilled checkpoints); `distilled_guidance_scale`
    # (HunyuanImage distilled); `guider` (set on the pipeline's guider objects, HunyuanImage 2.1).
    guidance_arg: str = "guidance_scale"
    # The second pass runs in the same denoiser call, on a doubled batch (SD, SDXL, HiDream), or as a
    # call of its own (FLUX.1 true CFG, Qwen-Image, Chroma, klein base, HunyuanImage's guider): the
    # planner doubles the activations only for the first.
    cfg_batched: bool = True
    # The negative prompt of rows without one, where the model needs one for its CFG to run at all
    # (Qwen-Image's card passes " ").
    negative_default: str | None = None
    text_encoder: str = ""  # the real model's text encoder(s) and token limit, for the table and the log
    sizes: tuple[str, ...] = ()  # the sizes its card recommends, WIDTHxHEIGHT
    # The pipeline rescales any asked size to its default area (HiDream): fleetgen pins that area to
    # the asked size before each call, so the size asked is the size made.
    pins_area: bool = False
    # False where the checkpoint ignores the guidance whatever its value (FLUX.1-schnell has no
    # guidance embedding; FLUX.2 klein's distilled model drops it): `--guidance` is refused, so no
    # record says a value the pipeline did not use.
    uses_guidance: bool = True
    # The tasks its weights serve, text-to-image first where it makes images from text alone
    # (default: text-to-image with its first pipeline class).
    tasks: tuple[Task, ...] = ()
    # Video families: the clip length and frame rate of the model's card, and its frame-count rule
    # (`num_frames` must be frame_step x k + 1: Wan's VAE compresses 4 frames into one latent frame
    # after the first, and its pipeline silently rounds any other count).
    frames: int = 0
    fps: float = 0.0
    frame_step: int = 1
    # Denoiser calls of their own per step besides guidance's, whatever the guidance (LTX-2 at
    # diffusers' defaults: a spatio-temporal-guidance pass and a modality-isolation pass, each on one
    # batch): the planner counts their compute.
    more_calls: int = 0
    # The pipeline's output carries an audio track per clip (`audio`, from its vocoder), stored as the
    # clip's sound (LTX-2).
    audio: bool = False
    # Why its images cannot be made phased (offload/phasing.py: the text encoders a chunk of prompts at a
    # time, then the denoiser), or "": tested equal to the per-batch images (tests/workers/pipeline/test_phases.py).
    phased: str = ""
    # Why its VAE cannot decode in a phase of its own (phase 3: the call's `vae.decode` recorded in phase 2,
    # run with the VAE alone on the device), or "": tested equal to the per-batch images.
    decode_apart: str = "its decode is not checked apart from the pipeline"

    def __post_init__(self) -> None:
        if not self.tasks and self.pipelines:
            object.__setattr__(self, "tasks", (text_task(self.pipelines[0]),))

    @property
    def video(self) -> bool:
        return any(t.video for t in self.tasks)

    def frames_rule(self, n: int) -> str | None:
        """Why `n` frames is not a count this family makes, or None."""
        return frame_count_error(n, self.frame_step, self.name)

    def task(self, name: str) -> Task | None:
        return next((t for t in self.tasks if t.name == name), None)

    def task_of(self, pipeline: str) -> Task | None:
        """The task a pipeline class of this family does (a directory's `_class_name`)."""
        return next((t for t in self.tasks if t.pipeline == pipeline), None)

    def classes(self) -> tuple[str, ...]:
        """Every pipeline class of the family: its own and its tasks'."""
        return tuple(dict.fromkeys([*self.pipelines, *(t.pipeline for t in self.tasks)]))

    def guided(self, guidance: float, true_cfg_scale: float | None = None) -> bool:
        """Whether the second (negative or unconditional) pass runs at these settings."""
        if self.negative == "true_cfg":
            return bool(true_cfg_scale and true_cfg_scale > 1)
        return self.cfg and guidance > 1

    def doubles_batch(self, guidance: float, true_cfg_scale: float | None) -> bool:
        """Whether the denoiser's activations are for twice the images per step."""
        if self.negative == "true_cfg":  # FLUX.1's true CFG: counted doubled, as it always has been
            return self.guided(guidance, true_cfg_scale)
        return self.cfg_batched and self.guided(guidance, true_cfg_scale)

    def calls_twice(self, guidance: float, true_cfg_scale: float | None) -> bool:
        """Whether the second pass is a denoiser call of its own (twice the compute per step)."""
        return self.guided(guidance, true_cfg_scale) and not self.doubles_batch(guidance, true_cfg_scale)

    def extra_calls(self, guidance: float, true_cfg_scale: float | None) -> int:
        """Denoiser calls per step beyond the first, each a call of its own (the planner's `cfg_calls`)."""
        return int(self.calls_twice(guidance, true_cfg_scale)) + self.more_calls

    def to_dict(self) -> dict:
        return asdict(self)
