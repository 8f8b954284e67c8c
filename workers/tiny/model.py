"""A small random-weight Stable Diffusion pipeline built from real diffusers/transformers classes.

No hub access is needed: the tokenizer is built in memory with the `tokenizers` library. The demo,
the tests and the benchmarks load it back through `DiffusionPipeline.from_pretrained(dir)`, the same
path a real checkpoint takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fleetgen.workers.tiny.classic import (
    build_tiny_flux,
    build_tiny_pixart_sigma,
    build_tiny_sana,
    build_tiny_sd3,
    build_tiny_sdxl,
)
from fleetgen.workers.tiny.frontier import (
    build_tiny_flux2,
    build_tiny_flux2_klein,
    build_tiny_qwen_image,
    build_tiny_z_image,
)
from fleetgen.workers.tiny.frontier_more import build_tiny_chroma, build_tiny_hidream, build_tiny_hunyuanimage
from fleetgen.workers.tiny.parts import _evaluated, _tokenizer
from fleetgen.workers.tiny.video import (
    build_tiny_hunyuanvideo15,
    build_tiny_ltx,
    build_tiny_ltx2,
    build_tiny_wan,
    build_tiny_wan_i2v,
)

__all__ = [
    "SIZES",
    "TINY_FAMILIES",
    "build_random_pipeline",
    "build_tiny_flux",
    "build_tiny_pipeline",
    "build_tiny_pixart_sigma",
    "build_tiny_sana",
    "build_tiny_sd3",
    "build_tiny_sdxl",
    "write_tiny_lora",
    "write_tiny_model",
]


@dataclass(frozen=True)
class TinySize:
    """Widths of the tiny architectures. `tiny` ≈ 1.7 M params; `small` ≈ 85 M params."""

    unet_channels: tuple[int, ...]
    layers_per_block: int
    cross_attention_dim: int
    text_layers: int
    vae_channels: tuple[int, ...]
    attention_head_dim: int


SIZES = {"tiny": TinySize((32, 64), 1, 32, 2, (32, 64), 8), "small": TinySize((128, 256, 448), 2, 256, 4, (64, 128), 8)}


@_evaluated
def build_tiny_pipeline(seed: int = 0, size: str = "tiny"):
    """Return a `StableDiffusionPipeline` with random weights, identical for the same `seed`/`size`."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    if size not in SIZES:
        raise ValueError(f"`size` must be one of {sorted(SIZES)}, got `{size}`.")
    s = SIZES[size]
    tokenizer = _tokenizer()
    n = len(s.unet_channels)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=s.unet_channels,
        layers_per_block=s.layers_per_block,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",),
        cross_attention_dim=s.cross_attention_dim,
        attention_head_dim=s.attention_head_dim,
        norm_num_groups=32,
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        block_out_channels=s.vae_channels,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(s.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(s.vae_channels),
        latent_channels=4,
        norm_num_groups=32,
        sample_size=64,
    )
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_size=s.cross_attention_dim,
            intermediate_size=s.cross_attention_dim * 4,
            num_attention_heads=4,
            num_hidden_layers=s.text_layers,
            vocab_size=len(tokenizer),
            max_position_embeddings=77,
            layer_norm_eps=1e-5,
        )
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    from diffusers import StableDiffusionPipeline as _P  # noqa: F401  (keeps import local)

    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def write_tiny_model(directory: str | Path, seed: int = 0, size: str = "tiny", family: str = "sd") -> Path:
    """Write a tiny pipeline of `family` to `directory` (loadable with `DiffusionPipeline.from_pretrained`).
    `size` applies to the `sd` family."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"`family` must be one of {', '.join(TINY_FAMILIES)}, got `{family}`.")
    path = Path(directory)
    pipe = build_tiny_pipeline(seed=seed, size=size) if family == "sd" else TINY_FAMILIES[family](seed)
    pipe.save_pretrained(path)
    return path


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
    from fleetgen.workers.tiny.frontier import _chat_tokenizer

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
