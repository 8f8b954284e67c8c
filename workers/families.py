"""Pipeline families: how each kind of text-to-image pipeline is called, and its defaults.

One table. The worker asks it how to call its pipeline (which arguments, how a negative prompt is
applied, which tokenizer bounds a prompt); the driver asks it for the defaults a job resolves
(steps, guidance, dtype); the planner gets plain numbers from it (whether guidance doubles the
denoiser's batch). Any other text-to-image `DiffusionPipeline` is called through the generic entry,
with only the arguments its `__call__` accepts.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fleetgen.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    pipelines: tuple[str, ...]  # diffusers pipeline class names (model_index.json `_class_name`)
    steps: int  # default denoising steps
    guidance: float  # default guidance scale (0 where the model is guidance-distilled without it)
    dtype: str  # default dtype on CUDA (CPU computes in float32)
    negative: str  # how a negative prompt is applied: "negative_prompt" | "true_cfg" (Flux) | "none"
    tokenizer: str  # the pipeline attribute whose tokenizer reads the whole prompt (the longest limit)
    max_sequence_length: int | None  # passed to the pipeline and the prompt limit; None: the tokenizer's own
    cfg: bool  # guidance > 1 runs the denoiser on a doubled batch (classifier-free guidance)
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

    def doubles_batch(self, guidance: float, true_cfg_scale: float | None) -> bool:
        """Whether the denoiser runs on twice the images per step."""
        if self.negative == "true_cfg":
            return bool(true_cfg_scale and true_cfg_scale > 1)
        return self.cfg and guidance > 1

    def to_dict(self) -> dict:
        return asdict(self)


# PixArt and Sana by default rewrite the prompt (`clean_caption`, which needs bs4 and ftfy) and
# generate at the nearest trained aspect-ratio bin, then resize: fleetgen generates exactly the prompt
# and the size it was given (pick one of the model's trained sizes), the same on every worker.
_AS_ASKED = {"clean_caption": False, "use_resolution_binning": False}

FAMILIES = {
    f.name: f
    for f in (
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
            note="SD 1.x/2.x; CLIP reads 77 tokens",
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
            note="two CLIP encoders, 77 tokens each",
            upcasts_vae=True,
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
            note="CLIP encoders read 77 tokens, T5 reads up to 256",
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
            note="FLUX.1-dev: guidance-distilled (the guidance is an input, not a second pass); negative "
            "prompts need `--true-cfg-scale` > 1, which doubles the compute",
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
            note="FLUX.1-schnell: timestep-distilled, 4 steps, no guidance",
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
            note="T5 reads up to 300 tokens",
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
            note="Gemma reads up to 300 tokens",
        ),
    )
}
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
FAMILIES[GENERIC.name] = GENERIC


def detect(model_index: dict, transformer_config: dict | None = None) -> Family:
    """The family of a pipeline from its `model_index.json` (and, for Flux, its transformer's
    config: FLUX.1-schnell has no guidance embedding)."""
    cls = model_index.get("_class_name", "")
    found = [f for f in FAMILIES.values() if cls in f.pipelines]
    if not found:
        return GENERIC
    if (
        found[0].name == "flux"
        and transformer_config is not None
        and not transformer_config.get("guidance_embeds", True)
    ):
        return FAMILIES["flux-schnell"]
    return found[0]


def read_family(model_dir: str | Path) -> Family:
    """The family of a local pipeline directory (with or without weights)."""
    root = Path(model_dir).expanduser()
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"`--model` {model_dir} has no readable model_index.json: {err}") from err
    transformer = root / "transformer" / "config.json"
    return detect(index, json.loads(transformer.read_text()) if transformer.exists() else None)


def call_kwargs(
    pipe,
    family: Family,
    prompts: list[str],
    negatives: list[str | None],
    *,
    steps: int,
    guidance: float,
    width: int,
    height: int,
    true_cfg_scale: float | None,
    generator,
    extra: dict | None = None,
) -> dict:
    """The arguments of one pipeline call for this family, keeping only those `pipe.__call__` takes.
    `extra`: per-row settings of the field table, by the keyword each is passed as."""
    kwargs = {
        "prompt": prompts,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "width": width,
        "height": height,
        "generator": generator,
        "output_type": "pil",
        **family.extra,
        **(extra or {}),
    }
    if family.max_sequence_length:
        kwargs["max_sequence_length"] = family.max_sequence_length
    if any(negatives) and family.negative != "none":
        kwargs["negative_prompt"] = [n or "" for n in negatives]
    if family.negative == "true_cfg" and true_cfg_scale:
        kwargs["true_cfg_scale"] = true_cfg_scale
    accepted = inspect.signature(pipe.__call__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in accepted}


def takes_negative_prompt(pipe) -> bool:
    return "negative_prompt" in inspect.signature(pipe.__call__).parameters


def prompt_limit(pipe, family: Family) -> tuple[object | None, int | None]:
    """(the tokenizer that reads the whole prompt, how many tokens it takes), or (None, None)."""
    tokenizer = getattr(pipe, family.tokenizer, None) or getattr(pipe, "tokenizer", None)
    if tokenizer is None:
        return None, None
    limit = family.max_sequence_length or getattr(tokenizer, "model_max_length", None)
    return tokenizer, limit if limit and limit < 100_000 else None
