"""Tiny Stable Diffusion pipelines: SD 1.x (`tiny` and `small` sizes), SDXL and SD3, from their real
diffusers and transformers classes with the in-memory tokenizer of workers/tiny/parts.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetgen.workers.tiny.parts import _clip, _evaluated, _t5, _tokenizer, _vae


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


@_evaluated
def build_tiny_sdxl(seed: int = 0):
    """SDXL at tiny size: two CLIP encoders (the second with projection), a text-time UNet."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    tokenizer, tokenizer_2 = _tokenizer(), _tokenizer()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=1,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="scaled_linear", timestep_spacing="leading"
    )
    return StableDiffusionXLPipeline(
        vae=_vae(seed + 1),
        text_encoder=_clip(tokenizer, seed + 2),
        text_encoder_2=_clip(tokenizer_2, seed + 3, projection=True),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )


@_evaluated
def build_tiny_sd3(seed: int = 0):
    """SD3 at tiny size: two CLIP encoders with projection and a T5 (tokenizer_3 reads 256 tokens)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    tokenizer, tokenizer_2, tokenizer_3 = _tokenizer(), _tokenizer(), _tokenizer(model_max_length=512)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=64,
        pooled_projection_dim=64,
        out_channels=4,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        tokenizer=tokenizer,
        text_encoder=_clip(tokenizer, seed + 1, projection=True),
        tokenizer_2=tokenizer_2,
        text_encoder_2=_clip(tokenizer_2, seed + 2, projection=True),
        tokenizer_3=tokenizer_3,
        text_encoder_3=_t5(tokenizer_3, seed + 3, d_model=64),
        vae=_vae(seed + 4, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035),
    )
