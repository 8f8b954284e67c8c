"""Tiny pipelines whose text encoders are Qwen language models: Qwen-Image (Qwen2.5-VL), Z-Image
(Qwen3) and HunyuanImage 2.1 (Qwen2.5-VL + ByT5) — the sizes of diffusers' own tests."""

from __future__ import annotations

import torch

from fleetgen.workers.tiny.parts import _byt5, _chat_tokenizer, _evaluated, _qwen25_vl, _tokenizer


@_evaluated
def build_tiny_qwen_image(seed: int = 0):
    """Qwen-Image at tiny size: a Qwen2.5-VL text encoder, the MMDiT, the Qwen-Image (Wan-style) VAE."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = _tokenizer(model_max_length=1024)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return QwenImagePipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=_qwen25_vl(tokenizer, seed + 2),
        tokenizer=tokenizer,
    )


@_evaluated
def build_tiny_z_image(seed: int = 0, shift: float = 3.0):
    """Z-Image at tiny size: a Qwen3 text encoder, the single-stream DiT. The base model and Turbo
    share the architecture; their published schedulers' `shift` differ (Turbo 3.0, base 6.0)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = _chat_tokenizer()
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=16,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # initialised with torch.empty: fixed, as diffusers' tests do
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[32, 32],
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=32,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    torch.manual_seed(seed + 2)
    text_encoder = Qwen3Model(
        Qwen3Config(
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=len(tokenizer),
            max_position_embeddings=1024,
            pad_token_id=1,
        )
    )
    return ZImagePipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )


@_evaluated
def build_tiny_hunyuanimage(seed: int = 0, distilled: bool = False):
    """HunyuanImage 2.1 at tiny size: Qwen2.5-VL and a ByT5 text encoder, guided by adaptive
    projected guidance (`distilled`: a guidance-embedding transformer and no guider)."""
    from diffusers import (
        AdaptiveProjectedMixGuidance,
        AutoencoderKLHunyuanImage,
        FlowMatchEulerDiscreteScheduler,
        HunyuanImagePipeline,
        HunyuanImageTransformer2DModel,
    )
    from transformers import ByT5Tokenizer

    tokenizer = _tokenizer(model_max_length=1024)
    torch.manual_seed(seed)
    transformer = HunyuanImageTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=4,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=(1, 1),
        guidance_embeds=distilled,
        text_embed_dim=32,
        text_embed_2_dim=32,
        rope_axes_dim=(4, 4),
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLHunyuanImage(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        sample_size=128,
    )
    guiders = (
        {"guider": None, "ocr_guider": None}
        if distilled
        else {
            "guider": AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=2),
            "ocr_guider": AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=3),
        }
    )
    return HunyuanImagePipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=_qwen25_vl(tokenizer, seed + 3, hidden=32),
        tokenizer=tokenizer,
        text_encoder_2=_byt5(seed + 2),
        tokenizer_2=ByT5Tokenizer(),
        **guiders,
    )
