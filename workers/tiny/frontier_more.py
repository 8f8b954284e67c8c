"""Tiny random-weight HunyuanImage 2.1, Chroma and HiDream-I1 pipelines, built from their real
diffusers and transformers classes as workers/tiny/frontier.py builds FLUX.2, Qwen-Image and
Z-Image (the sizes of diffusers' own tests, in-memory tokenizers)."""

from __future__ import annotations

import torch

from fleetgen.workers.tiny.frontier import _qwen25_vl
from fleetgen.workers.tiny.parts import _byt5, _clip, _evaluated, _t5, _tokenizer, _vae


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


@_evaluated
def build_tiny_chroma(seed: int = 0):
    """Chroma at tiny size: one T5 encoder, the FLUX.1-schnell-derived transformer with its
    modulation approximator; real CFG with negative prompts."""
    from diffusers import AutoencoderKL, ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tokenizer = _tokenizer(model_max_length=512)
    torch.manual_seed(seed)
    transformer = ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=[4, 4, 8],
        approximator_hidden_dim=32,
        approximator_layers=1,
        approximator_num_channels=16,
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    return ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=_t5(tokenizer, seed + 2),
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        image_encoder=None,
        feature_extractor=None,
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
