"""Every tiny pipeline by family (`fleetgen tiny-model DIR --family NAME`), written as a model directory
(loaded back through `DiffusionPipeline.from_pretrained(dir)`, the path a real checkpoint takes), a
random LoRA for it, and the shipped architectures at their real size with random weights."""

from __future__ import annotations

from pathlib import Path

import torch

from fleetgen.workers.tiny.dit import build_tiny_hidream, build_tiny_pixart_sigma, build_tiny_sana
from fleetgen.workers.tiny.flux import build_tiny_chroma, build_tiny_flux, build_tiny_flux2, build_tiny_flux2_klein
from fleetgen.workers.tiny.parts import _tokenizer
from fleetgen.workers.tiny.qwen import build_tiny_hunyuanimage, build_tiny_qwen_image, build_tiny_z_image
from fleetgen.workers.tiny.sd import build_tiny_pipeline, build_tiny_sd3, build_tiny_sdxl
from fleetgen.workers.tiny.video import (
    build_tiny_hunyuanvideo15,
    build_tiny_ltx,
    build_tiny_ltx2,
    build_tiny_wan,
    build_tiny_wan_i2v,
)

TINY_FAMILIES = {
    "sd": build_tiny_pipeline,
    "sdxl": build_tiny_sdxl,
    "sd3": build_tiny_sd3,
    "flux": lambda seed: build_tiny_flux(seed, guidance_embeds=True),
    "flux-schnell": build_tiny_flux,
    "flux-kontext": lambda seed: _as_class(build_tiny_flux(seed, guidance_embeds=True), "FluxKontextPipeline"),
    "pixart-sigma": build_tiny_pixart_sigma,
    "sana": build_tiny_sana,
    "flux2": build_tiny_flux2,
    "flux2-klein": build_tiny_flux2_klein,
    "flux2-klein-base": lambda seed: build_tiny_flux2_klein(seed, is_distilled=False),
    "qwen-image": build_tiny_qwen_image,
    "z-image-turbo": build_tiny_z_image,
    "z-image": lambda seed: build_tiny_z_image(seed, shift=6.0),  # the base model's published shift
    "hunyuanimage": build_tiny_hunyuanimage,
    "hunyuanimage-distilled": lambda seed: build_tiny_hunyuanimage(seed, distilled=True),
    "chroma": build_tiny_chroma,
    "hidream": build_tiny_hidream,
    "hidream-dev": build_tiny_hidream,
    "hidream-fast": build_tiny_hidream,
    "wan": build_tiny_wan,
    "wan2.2": lambda seed: build_tiny_wan(seed, experts=2),
    "wan-i2v": build_tiny_wan_i2v,
    "ltx-video": build_tiny_ltx,
    "ltx-2": build_tiny_ltx2,
    "hunyuanvideo-1.5": build_tiny_hunyuanvideo15,
}


def write_tiny_model(directory: str | Path, seed: int = 0, size: str = "tiny", family: str = "sd") -> Path:
    """Write a tiny pipeline of `family` to `directory` (loadable with `DiffusionPipeline.from_pretrained`).
    `size` applies to the `sd` family."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"`family` must be one of {', '.join(TINY_FAMILIES)}, got `{family}`.")
    path = Path(directory)
    pipe = build_tiny_pipeline(seed=seed, size=size) if family == "sd" else TINY_FAMILIES[family](seed)
    pipe.save_pretrained(path)
    return path


def _as_class(pipe, cls: str):
    """The same components as another pipeline class of the family (FLUX.1 Kontext is FLUX.1's)."""
    import diffusers

    return getattr(diffusers, cls).from_pipe(pipe)


def write_tiny_lora(path: str | Path, model_dir: str | Path, seed: int = 0, rank: int = 4) -> Path:
    """Write a random LoRA for the tiny `sd` pipeline at `model_dir` (its UNet's attention
    projections) as a diffusers LoRA file, loadable with `load_lora_weights(path)`. Both LoRA
    matrices are random, so an adapter visibly changes the images."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet = UNet2DConditionModel.from_pretrained(Path(model_dir) / "unet")
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in unet.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(
        path.parent, unet_lora_layers=get_peft_model_state_dict(unet), weight_name=path.name, safe_serialization=True
    )
    return path


def build_random_pipeline(architecture: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """A shipped architecture (offload/architectures: `sdxl`, `flux.1-dev`, ...) at its real size with
    random weights, built directly on `device` (then left there: the caller moves it), for measuring
    real sizes with no checkpoint. Tokenizers are the small in-memory ones above (their ids fit any
    vocabulary); schedulers take their defaults."""
    import json

    import diffusers

    from fleetgen.offload.architectures import _component_class, is_diffusers, resolve

    root = resolve(architecture)
    index = json.loads((root / "model_index.json").read_text())
    cls = getattr(diffusers, index["_class_name"])
    components, previous = {}, torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)  # initialised in `dtype`: no full-precision copy at any time
        for name, spec in index.items():
            if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:  # [null, null]: absent
                continue
            module_cls = _component_class(*spec)
            if module_cls is None:  # a scheduler or tokenizer named in model_index.json: made below
                continue
            config = json.loads((root / name / "config.json").read_text())
            with torch.device(device):
                if is_diffusers(spec[0]):
                    components[name] = module_cls.from_config(config).eval()
                else:
                    components[name] = module_cls(module_cls.config_class.from_dict(config)).eval()
    finally:
        torch.set_default_dtype(previous)
    from fleetgen.workers.tiny.parts import _chat_tokenizer

    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"):
        if name in components:
            kind = type(components[name]).__name__
            tokenizer = (
                _chat_tokenizer()  # the language-model encoders are prompted through a chat template
                if kind.startswith(("Mistral", "Qwen", "Llama"))
                else _tokenizer(model_max_length=512 if "T5" in kind else 77)
            )
            components[name.replace("text_encoder", "tokenizer")] = tokenizer
    scheduler = "EulerDiscreteScheduler" if "unet" in components else "FlowMatchEulerDiscreteScheduler"
    kwargs = {"add_watermarker": False} if cls.__name__.startswith("StableDiffusionXL") else {}
    # plain settings of model_index.json (FLUX.2 klein's `is_distilled`)
    kwargs.update({k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)})
    return cls(scheduler=getattr(diffusers, scheduler)(), **components, **kwargs)
