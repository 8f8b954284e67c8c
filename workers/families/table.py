"""The family table: how each kind of pipeline is called, for which tasks, and its defaults.

Defaults come from each model's card (its published example call) and the pipeline's own
`__call__`; where two checkpoints share a pipeline class (FLUX.1 dev/schnell, FLUX.2 klein
distilled/base, Z-Image/Turbo, HunyuanImage 2.1/distilled, HiDream full/dev/fast) each is an entry
of its own and workers/families/detect.py tells them apart. No torch here: the driver reads this table.
"""

from __future__ import annotations

from dataclasses import replace

from fleetgen.workers.families.entry import GUIDANCE_ARGS, Family  # noqa: F401 - the table's words
from fleetgen.workers.families.table_video import VIDEO_TABLE
from fleetgen.workers.families.tasks import (  # noqa: F401 - TASKS, TEXT and Task are this table's words too
    CHROMA_TASKS,
    FLUX1_TASKS,
    FLUX2_TASKS,
    KLEIN_TASKS,
    KONTEXT_TASKS,
    QWEN_EDIT_PLUS_TASKS,
    QWEN_EDIT_TASKS,
    QWEN_TASKS,
    SD3_TASKS,
    SD_TASKS,
    SDXL_TASKS,
    TASKS,
    TEXT,
    ZIMAGE_TASKS,
    Task,
)

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
    "tasks": ZIMAGE_TASKS,
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
        tasks=SD_TASKS,
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
        tasks=SDXL_TASKS,
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
        tasks=SD3_TASKS,
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
        tasks=FLUX1_TASKS,
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
        tasks=FLUX1_TASKS,
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
        tasks=KONTEXT_TASKS,
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
        tasks=FLUX2_TASKS,
        **_FLUX2,
    ),
    Family(
        "flux2-klein",
        steps=4,
        guidance=1.0,
        cfg=False,
        uses_guidance=False,
        note="FLUX.2 [klein] (4B, 9B), step-distilled: 4 steps, no CFG; takes no negative prompt",
        tasks=KLEIN_TASKS,
        **_KLEIN,
    ),
    Family(
        "flux2-klein-base",
        steps=50,
        guidance=4.0,
        cfg=True,
        cfg_batched=False,
        note="FLUX.2 [klein] base: CFG against an empty prompt (a second pass); takes no negative prompt",
        tasks=KLEIN_TASKS,
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
        tasks=QWEN_TASKS,
        **_BF16,
    ),
    Family(
        "qwen-image-edit",
        ("QwenImageEditPipeline",),
        note="Qwen-Image-Edit (20 B): edits an input image by instruction; the input's latents join the "
        "transformer's sequence, and Qwen2.5-VL reads it with the prompt",
        tasks=QWEN_EDIT_TASKS,
        **_QWEN_EDIT,
    ),
    Family(
        "qwen-image-edit-plus",
        ("QwenImageEditPlusPipeline",),
        note="Qwen-Image-Edit-2509 (Plus): edits with 1 to 3 reference images (its card's optimum)",
        tasks=QWEN_EDIT_PLUS_TASKS,
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
        tasks=CHROMA_TASKS,
        **_BF16,
    ),
    Family("hidream", steps=50, guidance=5.0, note="HiDream-I1-Full (17 B, mixture of experts)", **_HIDREAM),
    Family("hidream-dev", steps=28, guidance=0.0, note="HiDream-I1-Dev: distilled, 28 steps, no CFG", **_HIDREAM),
    Family("hidream-fast", steps=16, guidance=0.0, note="HiDream-I1-Fast: distilled, 16 steps, no CFG", **_HIDREAM),
    *VIDEO_TABLE,  # workers/families/table_video.py
)
# Phased plans decode in a phase of their own (workers/pipeline/phases.py) where the pipeline's tail is
# `vae.decode(...)`, then its image or video processor, and nothing between reads the decoded pixels:
# tested equal to per batch (tests/workers/pipeline/test_phases.py). Elsewhere the VAE decodes beside the
# denoiser, and the entry says why.
DECODE_APART = frozenset(
    {"sd3", "flux", "flux-schnell", "flux2", "flux2-klein", "flux2-klein-base", "qwen-image", "z-image-turbo"}
    | {"z-image", "chroma", "wan", "wan2.2"}
)
_DECODE_IN_PHASE_2 = {
    "sd": "its safety checker reads the decoded images before they are post-processed",
    "sdxl": "it casts its VAE to float32 around the decode and watermarks the decoded images",
    "ltx-video": "its decode takes a timestep and adds noise to the latents first",
    "ltx-2": "its decode takes a timestep and adds noise to the latents first; its audio decodes beside",
}
TABLE = tuple(
    replace(f, decode_apart="" if f.name in DECODE_APART else _DECODE_IN_PHASE_2.get(f.name, f.decode_apart))
    for f in TABLE
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
    phased="not a known family: its prompt encoding is not known to be called apart from the rest",
)
FAMILIES = {f.name: f for f in (*TABLE, GENERIC)}
# Entries without a tiny pipeline (workers/tiny/registry.py): Qwen-Image-Edit's `Qwen2VLProcessor`
# cannot be built without torchvision in transformers 5.24 (its video processor needs it, even
# given none), and torchvision does not load beside the CPU torch build CI uses. Wan 2.2 TI2V-5B's
# 48-channel VAE (patchified, residual) has no test-sized config in diffusers to build it from.
# They are planned and validated, not run end to end on CPU.
NO_TINY = frozenset({"qwen-image-edit", "qwen-image-edit-plus", "wan-ti2v"})
