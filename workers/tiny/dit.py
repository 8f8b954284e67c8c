"""Tiny pipelines of the other diffusion transformers: PixArt-Sigma, Sana and HiDream-I1 — the sizes of
diffusers' own tests, in-memory tokenizers."""

from __future__ import annotations

import torch

from fleetgen.workers.tiny.parts import _clip, _evaluated, _t5, _tokenizer, _vae


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
def build_tiny_hidream(seed: int = 0):
    """HiDream-I1 at tiny size: two CLIP encoders with projection, a T5 and a Llama-3 encoder, the
    mixture-of-experts transformer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
    from transformers import LlamaConfig, LlamaForCausalLM

    # HiDream's CLIP encoders are long-CLIP (248 positions; the pipeline reads 128 tokens).
    tokenizers = [_tokenizer(248), _tokenizer(248), _tokenizer(model_max_length=512), _tokenizer(model_max_length=512)]
    tokenizers[3].pad_token = tokenizers[3].eos_token
    torch.manual_seed(seed)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=[32, 16],
        text_emb_dim=64,
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(128, 128),
        llama_layers=(0, 1),
    )
    torch.manual_seed(seed + 5)
    llama = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=len(tokenizers[3]),
            max_position_embeddings=1024,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=1,
        )
    )
    return HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(seed + 1, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_clip(tokenizers[0], seed + 2, projection=True, positions=248),
        tokenizer=tokenizers[0],
        text_encoder_2=_clip(tokenizers[1], seed + 3, projection=True, positions=248),
        tokenizer_2=tokenizers[1],
        text_encoder_3=_t5(tokenizers[2], seed + 4),
        tokenizer_3=tokenizers[2],
        text_encoder_4=llama,
        tokenizer_4=tokenizers[3],
        transformer=transformer,
    )
