"""Tasks: what a family's weights do besides text-to-image, each with the diffusers class that does
it (diffusers' `AutoPipelineFor*` mappings pair them) and what its call takes besides a prompt.
The family table (workers/families/table.py) names each family's tasks from here. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

TEXT = "text-to-image"
TEXT_TO_VIDEO, IMAGE_TO_VIDEO = "text-to-video", "image-to-video"
TASKS = (TEXT, "image-to-image", "inpaint", "edit", TEXT_TO_VIDEO, IMAGE_TO_VIDEO)  # `--task` choices


@dataclass(frozen=True)
class Task:
    """One thing a family's weights do, with the diffusers class that does it (diffusers'
    `AutoPipelineFor*` mappings pair them; a worker turns the loaded pipeline into this class with
    `from_pipe`, sharing its components) and what its call takes besides a prompt."""

    name: str  # TASKS
    pipeline: str  # diffusers class name
    images: int = 0  # input images per image made: 0 none, 1 one, N up to N references
    mask: bool = False  # takes `mask_image` (white: repaint, black: keep)
    strength: float | None = None  # the pipeline's default `strength`, where it takes one (how far from the input)
    batched: bool = True  # several rows' input images in one call (False: one row per call)
    # Reference images' latents join the denoiser's sequence (Kontext, Qwen-Image-Edit, FLUX.2): the
    # planner counts their tokens beside the image's own.
    in_sequence: bool = False
    extra: tuple[tuple[str, object], ...] = ()  # fixed call arguments of this task
    pins_area: str | None = None  # the keyword of the area the pipeline rescales every size to (Kontext's max_area)
    video: bool = False  # makes a clip per row (`num_frames` frames at `fps`), stored as one video object
    note: str = ""

    @property
    def takes_images(self) -> bool:
        return self.images > 0


def text_task(pipeline: str) -> Task:
    return Task(TEXT, pipeline)


def text_to_video(pipeline: str) -> Task:
    return Task(TEXT_TO_VIDEO, pipeline, video=True)


def image_to_video(pipeline: str, batched: bool = False) -> Task:
    """The clip starts from the row's input image (its first frame). Wan's image-to-video call
    takes one image, so one row per call."""
    return Task(IMAGE_TO_VIDEO, pipeline, images=1, batched=batched, video=True)


def img2img(pipeline: str, strength: float) -> Task:
    return Task("image-to-image", pipeline, images=1, strength=strength)


def inpaint(pipeline: str, strength: float) -> Task:
    return Task("inpaint", pipeline, images=1, mask=True, strength=strength)


def references(pipeline: str) -> Task:
    """FLUX.2: the same class edits from reference images (a list for the whole call, so one row per
    call); each reference's tokens join the transformer's sequence. diffusers' pipeline sets no
    limit; fleetgen takes at most 10 per row."""
    return Task("edit", pipeline, images=10, batched=False, in_sequence=True)


FLUX1_TASKS = (text_task("FluxPipeline"), img2img("FluxImg2ImgPipeline", 0.6), inpaint("FluxInpaintPipeline", 0.6))
SD_TASKS = (
    text_task("StableDiffusionPipeline"),
    img2img("StableDiffusionImg2ImgPipeline", 0.8),
    inpaint("StableDiffusionInpaintPipeline", 1.0),
)
SDXL_TASKS = (
    text_task("StableDiffusionXLPipeline"),
    img2img("StableDiffusionXLImg2ImgPipeline", 0.3),
    inpaint("StableDiffusionXLInpaintPipeline", 0.9999),
)
SD3_TASKS = (
    text_task("StableDiffusion3Pipeline"),
    img2img("StableDiffusion3Img2ImgPipeline", 0.6),
    inpaint("StableDiffusion3InpaintPipeline", 0.6),
)
KONTEXT_TASKS = (
    Task(
        "edit",
        "FluxKontextPipeline",
        images=1,
        in_sequence=True,
        # fleetgen resizes the input to the job's size (`--resize`), and pins the area the
        # pipeline would rescale the asked size to, so the size asked is the size made
        extra=(("_auto_resize", False),),
        pins_area="max_area",
    ),
    Task(
        "inpaint",
        "FluxKontextInpaintPipeline",
        images=1,
        mask=True,
        strength=1.0,
        in_sequence=True,
        extra=(("_auto_resize", False),),
        pins_area="max_area",
    ),
)
FLUX2_TASKS = (text_task("Flux2Pipeline"), references("Flux2Pipeline"))
KLEIN_TASKS = (text_task("Flux2KleinPipeline"), references("Flux2KleinPipeline"))
QWEN_TASKS = (
    text_task("QwenImagePipeline"),
    img2img("QwenImageImg2ImgPipeline", 0.6),
    inpaint("QwenImageInpaintPipeline", 0.6),
)
QWEN_EDIT_TASKS = (
    Task("edit", "QwenImageEditPipeline", images=1, batched=False, in_sequence=True),
    Task("inpaint", "QwenImageEditInpaintPipeline", images=1, mask=True, strength=0.6, batched=False, in_sequence=True),
)
QWEN_EDIT_PLUS_TASKS = (Task("edit", "QwenImageEditPlusPipeline", images=3, batched=False, in_sequence=True),)
CHROMA_TASKS = (
    text_task("ChromaPipeline"),
    img2img("ChromaImg2ImgPipeline", 0.9),
    inpaint("ChromaInpaintPipeline", 0.6),
)
ZIMAGE_TASKS = (
    text_task("ZImagePipeline"),
    img2img("ZImageImg2ImgPipeline", 0.6),
    inpaint("ZImageInpaintPipeline", 1.0),
)
WAN_TASKS = (text_to_video("WanPipeline"),)
WAN_I2V_TASKS = (image_to_video("WanImageToVideoPipeline"),)
LTX_TASKS = (text_to_video("LTXPipeline"), image_to_video("LTXImageToVideoPipeline", batched=True))
HUNYUANVIDEO15_TASKS = (text_to_video("HunyuanVideo15Pipeline"),)
# LTX-2's image-to-video call takes one image (re-compressed as H.264 before it conditions): one row per call
LTX2_TASKS = (text_to_video("LTX2Pipeline"), image_to_video("LTX2ImageToVideoPipeline"))
