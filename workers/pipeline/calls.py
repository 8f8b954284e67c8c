"""How a family's pipeline is called: the arguments of one call (only those its `__call__` takes),
what is set on the pipeline instead, the task's inputs, what a prompt's record says before it is
made, the loaded pipeline turned into the task's class, and (`Calls`) a batch of work items to its
call's arguments and the call's output to pictures."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

from fleetgen.errors import FleetgenError, one_line
from fleetgen.workers.families.table import Family, Task
from fleetgen.workers.output.fields import extra_settings
from fleetgen.workers.output.video import clips_of
from fleetgen.workers.rows.batches import Look, WorkItem


def call_kwargs(
    pipe,
    family: Family,
    prompts: list[str],
    negatives: list[str | None],
    look: Look,
    *,
    true_cfg_scale: float | None,
    generator,
    extra: dict | None = None,
) -> dict:
    """The arguments of one pipeline call for this family (its images share `look`), keeping only
    those `pipe.__call__` takes. `extra`: per-row settings of the field table, by the keyword each
    is passed as, and the task's inputs."""
    guidance = look.guidance
    kwargs = {
        "prompt": prompts,
        "num_inference_steps": look.steps,
        "width": look.width,
        "height": look.height,
        "generator": generator,
        "output_type": "pil",
        **family.extra,
        **(extra or {}),
    }
    if family.guidance_arg != "guider":  # the guider's scale is set on it (prepare_call)
        kwargs[family.guidance_arg] = guidance
    if family.max_sequence_length:
        kwargs["max_sequence_length"] = family.max_sequence_length
    if family.negative != "none" and (any(negatives) or family.negative_default is not None):
        kwargs["negative_prompt"] = [n or family.negative_default or "" for n in negatives]
    if family.negative == "true_cfg" and true_cfg_scale:
        kwargs["true_cfg_scale"] = true_cfg_scale
    accepted = inspect.signature(pipe.__call__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in accepted}


def prepare_call(pipe, family: Family, *, guidance: float, width: int, height: int) -> None:
    """What a call of this family needs set on the pipeline rather than passed to it: the scale of
    its guider objects (HunyuanImage 2.1), and the area it rescales every size to (HiDream)."""
    if family.guidance_arg == "guider":
        for name in ("guider", "ocr_guider"):
            guider = getattr(pipe, name, None)
            if guider is not None and guider.guidance_scale != guidance:
                setattr(pipe, name, guider.new(guidance_scale=guidance))  # its other settings as loaded
    if family.pins_area:
        # The pipeline scales width and height by sqrt(default area / asked area), then floors each to
        # its multiple: a default area a hair above the asked one makes the scale 1 (+1e-9, which the
        # floor drops), so the asked size, a multiple already, is the size made.
        pipe.default_sample_size = math.sqrt(width * height) / pipe.vae_scale_factor * (1 + 1e-9)


def takes_negative_prompt(pipe) -> bool:
    return "negative_prompt" in inspect.signature(pipe.__call__).parameters


def prompt_limit(pipe, family: Family) -> tuple[object | None, int | None]:
    """(the tokenizer that reads the whole prompt, how many tokens it takes), or (None, None)."""
    tokenizer = getattr(pipe, family.tokenizer, None) or getattr(pipe, "tokenizer", None)
    if tokenizer is None:
        return None, None
    limit = family.max_sequence_length or getattr(tokenizer, "model_max_length", None)
    return tokenizer, limit if limit and limit < 100_000 else None


def prompt_note(pipe, family: Family, prompt: str, negative: str | None, strict: bool) -> dict:
    """What an image's record says about its prompt before it is made. Prompts longer than the
    text encoder that reads the whole prompt takes (T5 or Gemma where the family has one, else
    CLIP) are truncated by the pipeline: a warning, or an error with `strict` (`--strict-prompts`)."""
    warning = None
    if negative and not takes_negative_prompt(pipe):
        warning = f"negative prompt ignored: {type(pipe).__name__} takes none"
    tokenizer, limit = prompt_limit(pipe, family)
    if tokenizer is None or not limit:
        return {"warning": warning}
    n = len(tokenizer(prompt, truncation=False).input_ids)
    if n > limit and strict:
        return {
            "status": "error",
            "error": f"prompt is {n} tokens; the text encoder takes {limit} (`--strict-prompts`)",
            "warning": warning,
        }
    if n > limit:
        warning = "; ".join(filter(None, [warning, f"prompt truncated to {limit} of {n} tokens"]))
    return {"warning": warning}


def as_task(pipe, task: Task, tag: str = "worker"):
    """The loaded pipeline as the class of the job's task: itself, or a pipeline of that class over
    the same components (diffusers' `from_pipe`: no weights are copied or loaded again)."""
    if not task.pipeline or type(pipe).__name__ == task.pipeline:
        return pipe
    import diffusers

    try:
        return getattr(diffusers, task.pipeline).from_pipe(pipe)
    except Exception as err:  # noqa: BLE001 - a component the task's class cannot take: say which task
        raise FleetgenError(
            f"{tag}: could not make a {task.pipeline} ({task.name}) from {type(pipe).__name__}: {one_line(err)}"
        ) from err


def warm_up_input(role: str, width: int, height: int):
    """A blank input of the image's size for the warm-up call."""
    from PIL import Image as PILImage

    return PILImage.new("L" if role == "mask" else "RGB", (width, height)), role


def task_kwargs(task: Task, width: int, height: int, inputs: list | None) -> dict:
    """The call arguments of a task beyond text-to-image: its fixed ones, the area it is pinned to,
    and the inputs (per image, (picture, role) pairs, the mask last): a list of images, one per
    prompt; for a task taking references, the one row's list."""
    extra = dict(task.extra)
    if task.pins_area:
        extra[task.pins_area] = width * height
    if task.takes_images:
        images = [[p for p, role in one if role == "image"] for one in inputs]
        if task.video and not task.batched:  # image-to-video one row per call (Wan): its image the first frame
            extra["image"] = images[0][0]
        else:
            extra["image"] = [one[0] for one in images] if task.images == 1 else images[0]
        if task.mask:
            extra["mask_image"] = [next(p for p, role in one if role == "mask") for one in inputs]
    return extra


def generators(seeds: list[int]):
    """One CPU generator per image, seeded with its seed (workers/rows/seeds.py): the noise of an image
    depends on its seed alone, never on the device, the batch or the plan that made it."""
    import torch

    return [torch.Generator("cpu").manual_seed(s) for s in seeds]


@dataclass
class Calls:
    """One loaded pipeline's calls: a batch of work items (one look) to its call's arguments, and the
    call's output (or a decode phase's) to the pictures it asked for."""

    pipe: object
    family: Family
    task: Task
    true_cfg_scale: float | None = None
    # per-row settings a look carries, by the keyword each is passed as (the field table)
    call_args: dict = field(default_factory=lambda: {f.name: f.call_arg for f in extra_settings()})

    def roles(self) -> list[str]:
        """The input pictures each image of the task reads, in order (the mask last)."""
        return (["image"] if self.task.takes_images else []) + (["mask"] if self.task.mask else [])

    def kwargs(self, prompts: list[str], negatives: list[str | None], look: Look, generator, inputs=None) -> dict:
        """`inputs`: per image, its input pictures (the mask last), as workers/rows/inputs.py loaded them."""
        extra = {self.call_args[name]: value for name, value in look.extra if self.call_args.get(name)}
        extra.update(task_kwargs(self.task, look.width, look.height, inputs))
        prepare_call(self.pipe, self.family, guidance=look.guidance, width=look.width, height=look.height)
        return call_kwargs(
            self.pipe,
            self.family,
            prompts,
            negatives,
            look,
            true_cfg_scale=self.true_cfg_scale,
            generator=generator,
            extra=extra,
        )

    def of(self, batch: list[WorkItem], inputs: dict | None = None):
        """The arguments of `batch`'s call, made afresh by each call of the function returned (its
        generators start at the images' seeds every time). `inputs`: {image id: its loaded inputs}."""
        look = batch[0].look
        return lambda: self.kwargs(
            [im.prompt for im in batch],
            [im.negative_prompt for im in batch],
            look,
            generators([im.seed for im in batch]),
            [[(x.picture, x.ref.role) for x in (inputs or {}).get(im.id, ())] for im in batch],
        )

    def pictures(self, out, look: Look) -> list:
        """A call's pictures (a decode phase's output alike): images, or clips; a pipeline that rescales
        is an error, as its records would say otherwise."""
        pictures = self._clips(out, dict(look.extra)) if self.task.video else out.images
        made = {getattr(p, "size", None) for p in pictures}
        if made != {(look.width, look.height)}:
            sizes = ", ".join(sorted(f"{w}x{h}" for w, h in made if w) or ["no images"])
            raise FleetgenError(f"{type(self.pipe).__name__} made {sizes} where {look.width}x{look.height} was asked")
        return pictures

    def _clips(self, out, extra: dict) -> list:
        """A video pipeline's output as clips (LTX-2's with their sound, at its vocoder's rate)."""
        audio = out.audio if self.family.audio else None
        rate = self.pipe.vocoder.config.output_sampling_rate if self.family.audio else 0
        fps = extra.get("fps") or self.family.fps
        return clips_of(out.frames, extra.get("num_frames"), fps, type(self.pipe).__name__, audio, rate)
