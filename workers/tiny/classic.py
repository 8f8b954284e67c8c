"""Tiny random-weight pipelines of the other families (SDXL, SD3, PixArt-Sigma, Sana, Flux), built
from their real diffusers classes as `workers/tiny/model.py` builds SD's."""

from __future__ import annotations

import torch

from fleetgen.workers.tiny.parts import _clip, _evaluated, _t5, _tokenizer, _vae


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


@_evaluated
def build_tiny_pixart_sigma(seed: int = 0):
    """PixArt-Σ at tiny size: a T5 encoder (300 tokens) and an ada-norm-single DiT."""
    from diffusers import DDIMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    tokenizer = _tokenizer(model_max_length=512)
    torch.manual_seed(seed)
    transformer = PixArtTransformer2DModel(
        sample_size=32,
        num_layers=2,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=3,
        caption_channels=32,
        in_channels=4,
        cross_attention_dim=24,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    )
    return PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=_t5(tokenizer, seed + 1),
        vae=_vae(seed + 2),
        transformer=transformer,
        scheduler=DDIMScheduler(),
    )


@_evaluated
def build_tiny_sana(seed: int = 0):
    """Sana at tiny size: a Gemma-2 text encoder (300 tokens), a linear DiT and a DC-AE."""
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = _tokenizer(model_max_length=512)
    torch.manual_seed(seed)
    transformer = SanaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=4,
        num_cross_attention_heads=2,
        cross_attention_head_dim=4,
        cross_attention_dim=8,
        caption_channels=8,
        sample_size=32,
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    torch.manual_seed(seed + 2)
    text_encoder = Gemma2Model(
        Gemma2Config(
            head_dim=16,
            hidden_size=8,
            intermediate_size=64,
            max_position_embeddings=8192,
            num_attention_heads=2,
            num_hidden_layers=1,
            num_key_value_heads=2,
            vocab_size=len(tokenizer),
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=1,
        )
    )
    return SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )


@_evaluated
def build_tiny_flux(seed: int = 0, guidance_embeds: bool = False):
    """A Flux-like pipeline at tiny size (2 double + 4 single blocks, CLIP + T5 text encoders);
    with `guidance_embeds` a FLUX.1-dev (guidance-distilled), without a FLUX.1-schnell."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _tokenizer()
    tokenizer_2 = _tokenizer(model_max_length=32)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
        guidance_embeds=guidance_embeds,
    )
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=len(tokenizer),
            max_position_embeddings=77,
            projection_dim=32,
        )
    )
    torch.manual_seed(seed + 2)
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=1,
            eos_token_id=1,
        )
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        block_out_channels=(32, 32),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
