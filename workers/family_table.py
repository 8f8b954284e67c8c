"""The family table: how each kind of pipeline is called, for which tasks, and its defaults.

Defaults come from each model's card (its published example call) and the pipeline's own
`__call__`; where two checkpoints share a pipeline class (FLUX.1 dev/schnell, FLUX.2 klein
distilled/base, Z-Image/Turbo, HunyuanImage 2.1/distilled, HiDream full/dev/fast) each is an entry
of its own and workers/families.py tells them apart. No torch here: the driver reads this table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# How the job's `--guidance` reaches the pipeline (Family.guidance_arg).
GUIDANCE_ARGS = ("guidance_scale", "true_cfg_scale", "distilled_guidance_scale", "guider")

TEXT = "text-to-image"
TASKS = (TEXT, "image-to-image", "inpaint", "edit")  # `--task` choices


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
    note: str = ""

    @property
    def takes_images(self) -> bool:
        return self.images > 0


def text_task(pipeline: str) -> Task:
    return Task(TEXT, pipeline)


def img2img(pipeline: str, strength: float) -> Task:
    return Task("image-to-image", pipeline, images=1, strength=strength)


def inpaint(pipeline: str, strength: float) -> Task:
    return Task("inpaint", pipeline, images=1, mask=True, strength=strength)


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
    # multiple of the model is added to it (workers/model_dir.py, workers/pipeline.py).
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

    def __post_init__(self) -> None:
        if not self.tasks and self.pipelines:
            object.__setattr__(self, "tasks", (text_task(self.pipelines[0]),))

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

    def to_dict(self) -> dict:
        return asdict(self)


# PixArt and Sana by default rewrite the prompt (`clean_caption`, which needs bs4 and ftfy) and
# generate at the nearest trained aspect-ratio bin, then resize: fleetgen generates exactly the prompt
# and the size it was given (pick one of the model's trained sizes), the same on every worker.
_AS_ASKED = {"clean_caption": False, "use_resolution_binning": False}
_SQUARE = ("1024x1024",)
_BF16 = {"dtype": "bfloat16"}
_FLUX2 = {**_BF16, "negative": "none", "tokenizer": "tokenizer", "max_sequence_length": 512, "sizes": _SQUARE}
_KLEIN = {**_FLUX2, "pipelines": ("Flux2KleinPipeline",), "text_encoder": "Qwen3 (4 B or 8 B), 512 tokens"}
_ZIMAGE = {
    **_BF16,
    "pipelines": ("ZImagePipeline",),
    "tasks": (
        text_task("ZImagePipeline"),
        img2img("ZImageImg2ImgPipeline", 0.6),
        inpaint("ZImageInpaintPipeline", 1.0),
    ),
    "negative": "negative_prompt",
    "tokenizer": "tokenizer",
    "max_sequence_length": 512,
    "cfg": True,
    "text_encoder": "Qwen3 4B, 512 tokens",
    "sizes": _SQUARE,
}
_HUNYUAN = {
    **_BF16,
    "pipelines": ("HunyuanImagePipeline",),
    "tokenizer": "tokenizer",
    "max_sequence_length": None,
    "size_floor": 64,  # the pipeline resizes sizes that are not multiples of twice its VAE's 32
    "text_encoder": "Qwen2.5-VL 7B, and ByT5 for quoted text",
    "sizes": ("2048x2048", "2560x1536", "1536x2560"),
}
_HIDREAM = {
    **_BF16,
    "pipelines": ("HiDreamImagePipeline",),
    "negative": "negative_prompt",
    "tokenizer": "tokenizer_4",
    "max_sequence_length": 128,
    "cfg": True,
    "pins_area": True,
    "text_encoder": "long CLIP-L and CLIP-G, T5-XXL and Llama-3.1-8B, 128 tokens each",
    "sizes": ("1024x1024", "768x1360", "1360x768", "880x1168", "1168x880", "1248x832", "832x1248"),
}

_FLUX1_TASKS = (text_task("FluxPipeline"), img2img("FluxImg2ImgPipeline", 0.6), inpaint("FluxInpaintPipeline", 0.6))
_QWEN_SIZES = ("1328x1328", "1664x928", "928x1664", "1584x1056", "1056x1584")
_QWEN_EDIT = {
    **_BF16,
    "steps": 50,
    "guidance": 4.0,
    "negative": "negative_prompt",
    "tokenizer": "tokenizer",
    "max_sequence_length": None,  # the edit pipelines take no max_sequence_length
    "cfg": True,
    "cfg_batched": False,
    "guidance_arg": "true_cfg_scale",
    "negative_default": " ",
    "text_encoder": "Qwen2.5-VL 7B (reads the input images too)",
    "sizes": _QWEN_SIZES,
}


def _references(pipeline: str) -> Task:
    """FLUX.2: the same class edits from reference images (a list for the whole call, so one row per
    call); each reference's tokens join the transformer's sequence. diffusers' pipeline sets no
    limit; fleetgen takes at most 10 per row."""
    return Task("edit", pipeline, images=10, batched=False, in_sequence=True)


TABLE = (
    Family(
        "sd",
        ("StableDiffusionPipeline",),
        steps=30,
        guidance=7.5,
        dtype="float16",
        negative="negative_prompt",
        tokenizer="tokenizer",
        max_sequence_length=None,
        cfg=True,
        note="SD 1.x/2.x",
        text_encoder="CLIP, 77 tokens",
        sizes=("512x512",),
        tasks=(
            text_task("StableDiffusionPipeline"),
            img2img("StableDiffusionImg2ImgPipeline", 0.8),
            inpaint("StableDiffusionInpaintPipeline", 1.0),
        ),
    ),
    Family(
        "sdxl",
        ("StableDiffusionXLPipeline",),
        steps=30,
        guidance=5.0,
        dtype="float16",
        negative="negative_prompt",
        tokenizer="tokenizer_2",
        max_sequence_length=None,
        cfg=True,
        upcasts_vae=True,
        text_encoder="two CLIP encoders, 77 tokens each",
        sizes=_SQUARE,
        tasks=(
            text_task("StableDiffusionXLPipeline"),
            img2img("StableDiffusionXLImg2ImgPipeline", 0.3),
            inpaint("StableDiffusionXLInpaintPipeline", 0.9999),
        ),
    ),
    Family(
        "sd3",
        ("StableDiffusion3Pipeline",),
        steps=28,
        guidance=7.0,
        dtype="bfloat16",
        negative="negative_prompt",
        tokenizer="tokenizer_3",
        max_sequence_length=256,
        cfg=True,
        text_encoder="two CLIP encoders (77 tokens) and T5 (256)",
        sizes=_SQUARE,
        tasks=(
            text_task("StableDiffusion3Pipeline"),
            img2img("StableDiffusion3Img2ImgPipeline", 0.6),
            inpaint("StableDiffusion3InpaintPipeline", 0.6),
        ),
    ),
    Family(
        "flux",
        ("FluxPipeline",),
        steps=28,
        guidance=3.5,
        dtype="bfloat16",
        negative="true_cfg",
        tokenizer="tokenizer_2",
        max_sequence_length=512,
        cfg=False,
        cfg_batched=False,
        note="FLUX.1-dev: guidance-distilled (the guidance is an input, not a second pass); negative "
        "prompts need `--true-cfg-scale` > 1, which doubles the compute",
        text_encoder="CLIP (77 tokens) and T5-XXL (512)",
        sizes=_SQUARE,
        tasks=_FLUX1_TASKS,
    ),
    Family(
        "flux-schnell",
        ("FluxPipeline",),
        steps=4,
        guidance=0.0,
        dtype="bfloat16",
        negative="true_cfg",
        tokenizer="tokenizer_2",
        max_sequence_length=256,
        cfg=False,
        cfg_batched=False,
        uses_guidance=False,
        note="FLUX.1-schnell: timestep-distilled, 4 steps, no guidance",
        text_encoder="CLIP (77 tokens) and T5-XXL (256)",
        sizes=_SQUARE,
        tasks=_FLUX1_TASKS,
    ),
    Family(
        "flux-kontext",
        ("FluxKontextPipeline",),
        steps=28,
        guidance=2.5,
        dtype="bfloat16",
        negative="true_cfg",
        tokenizer="tokenizer_2",
        max_sequence_length=512,
        cfg=False,
        cfg_batched=False,
        note="FLUX.1 Kontext [dev]: edits an input image by instruction; the input's latents join the "
        "transformer's sequence (twice the tokens); guidance-distilled like FLUX.1-dev",
        text_encoder="CLIP (77 tokens) and T5-XXL (512)",
        sizes=_SQUARE,
        tasks=(
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
        ),
    ),
    Family(
        "pixart-sigma",
        ("PixArtSigmaPipeline",),
        steps=20,
        guidance=4.5,
        dtype="float16",
        negative="negative_prompt",
        tokenizer="tokenizer",
        max_sequence_length=300,
        cfg=True,
        extra=_AS_ASKED,
        text_encoder="T5-XXL, 300 tokens",
        sizes=_SQUARE,
    ),
    Family(
        "sana",
        ("SanaPipeline",),
        steps=20,
        guidance=4.5,
        dtype="bfloat16",
        negative="negative_prompt",
        tokenizer="tokenizer",
        max_sequence_length=300,
        cfg=True,
        extra=_AS_ASKED,
        text_encoder="Gemma-2 2B, 300 tokens",
        sizes=_SQUARE,
    ),
    Family(
        "flux2",
        ("Flux2Pipeline",),
        steps=50,
        guidance=4.0,
        cfg=False,
        note="FLUX.2 [dev]: a 32 B transformer; guidance-distilled (the guidance is an input, not a second "
        "pass); takes no negative prompt",
        text_encoder="Mistral Small 3.1 (24 B), 512 tokens",
        tasks=(text_task("Flux2Pipeline"), _references("Flux2Pipeline")),
        **_FLUX2,
    ),
    Family(
        "flux2-klein",
        steps=4,
        guidance=1.0,
        cfg=False,
        uses_guidance=False,
        note="FLUX.2 [klein] (4B, 9B), step-distilled: 4 steps, no CFG; takes no negative prompt",
        tasks=(text_task("Flux2KleinPipeline"), _references("Flux2KleinPipeline")),
        **_KLEIN,
    ),
    Family(
        "flux2-klein-base",
        steps=50,
        guidance=4.0,
        cfg=True,
        cfg_batched=False,
        note="FLUX.2 [klein] base: CFG against an empty prompt (a second pass); takes no negative prompt",
        tasks=(text_task("Flux2KleinPipeline"), _references("Flux2KleinPipeline")),
        **_KLEIN,
    ),
    Family(
        "qwen-image",
        ("QwenImagePipeline",),
        steps=50,
        guidance=4.0,
        negative="negative_prompt",
        tokenizer="tokenizer",
        max_sequence_length=512,
        cfg=True,
        cfg_batched=False,
        guidance_arg="true_cfg_scale",
        negative_default=" ",
        note="Qwen-Image (20 B): the guidance is its true CFG scale, which runs only with a negative "
        'prompt (" " where a row has none, as its card does); `guidance_scale` is left to the pipeline',
        text_encoder="Qwen2.5-VL 7B, 512 tokens",
        sizes=_QWEN_SIZES,
        tasks=(
            text_task("QwenImagePipeline"),
            img2img("QwenImageImg2ImgPipeline", 0.6),
            inpaint("QwenImageInpaintPipeline", 0.6),
        ),
        **_BF16,
    ),
    Family(
        "qwen-image-edit",
        ("QwenImageEditPipeline",),
        note="Qwen-Image-Edit (20 B): edits an input image by instruction; the input's latents join the "
        "transformer's sequence, and Qwen2.5-VL reads it with the prompt",
        tasks=(
            Task("edit", "QwenImageEditPipeline", images=1, batched=False, in_sequence=True),
            Task(
                "inpaint",
                "QwenImageEditInpaintPipeline",
                images=1,
                mask=True,
                strength=0.6,
                batched=False,
                in_sequence=True,
            ),
        ),
        **_QWEN_EDIT,
    ),
    Family(
        "qwen-image-edit-plus",
        ("QwenImageEditPlusPipeline",),
        note="Qwen-Image-Edit-2509 (Plus): edits with 1 to 3 reference images (its card's optimum)",
        tasks=(Task("edit", "QwenImageEditPlusPipeline", images=3, batched=False, in_sequence=True),),
        **_QWEN_EDIT,
    ),
    Family(
        "z-image-turbo",
        steps=9,
        guidance=0.0,
        note="Z-Image-Turbo (6 B), distilled: 9 steps (8 transformer passes), guidance 0; negative "
        "prompts apply only with guidance above 1",
        **_ZIMAGE,
    ),
    Family("z-image", steps=50, guidance=4.0, note="Z-Image (6 B) base model: CFG with negative prompts", **_ZIMAGE),
    Family(
        "hunyuanimage",
        steps=50,
        guidance=3.5,
        negative="negative_prompt",
        cfg=True,
        cfg_batched=False,
        guidance_arg="guider",
        note="HunyuanImage 2.1 (17 B): guidance through the pipeline's adaptive projected guiders "
        "(a second pass); a 32x VAE, made for 2K",
        **_HUNYUAN,
    ),
    Family(
        "hunyuanimage-distilled",
        steps=8,
        guidance=3.25,
        negative="none",
        cfg=False,
        guidance_arg="distilled_guidance_scale",
        note="HunyuanImage 2.1 distilled: 8 steps, guidance as an input (one pass); takes no negative prompt",
        **_HUNYUAN,
    ),
    Family(
        "chroma",
        ("ChromaPipeline",),
        steps=40,
        guidance=3.0,
        negative="negative_prompt",
        tokenizer="tokenizer",
        max_sequence_length=512,
        cfg=True,
        cfg_batched=False,
        note="Chroma1-HD (8.9 B, from FLUX.1-schnell): real CFG with negative prompts",
        text_encoder="T5-XXL, 512 tokens",
        sizes=_SQUARE,
        tasks=(
            text_task("ChromaPipeline"),
            img2img("ChromaImg2ImgPipeline", 0.9),
            inpaint("ChromaInpaintPipeline", 0.6),
        ),
        **_BF16,
    ),
    Family("hidream", steps=50, guidance=5.0, note="HiDream-I1-Full (17 B, mixture of experts)", **_HIDREAM),
    Family("hidream-dev", steps=28, guidance=0.0, note="HiDream-I1-Dev: distilled, 28 steps, no CFG", **_HIDREAM),
    Family("hidream-fast", steps=16, guidance=0.0, note="HiDream-I1-Fast: distilled, 16 steps, no CFG", **_HIDREAM),
)

GENERIC = Family(
    "generic",
    (),
    steps=30,
    guidance=7.5,
    dtype="float16",
    negative="negative_prompt",
    tokenizer="tokenizer",
    max_sequence_length=None,
    cfg=True,
    note="not a known family: called with the arguments its __call__ accepts",
)
FAMILIES = {f.name: f for f in (*TABLE, GENERIC)}
# Entries without a tiny pipeline (workers/tiny_model.py): Qwen-Image-Edit's `Qwen2VLProcessor`
# cannot be built without torchvision in transformers 5.24 (its video processor needs it, even
# given none), and torchvision does not load beside the CPU torch build CI uses. They are planned
# and validated, not run end to end on CPU.
NO_TINY = frozenset({"qwen-image-edit", "qwen-image-edit-plus"})
