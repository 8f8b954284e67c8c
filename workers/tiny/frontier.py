"""Tiny random-weight pipelines of the 2025-26 families (FLUX.2 dev and klein, Qwen-Image, Z-Image;
HunyuanImage 2.1, Chroma and HiDream-I1 are in workers/tiny/frontier_more.py), built from their real diffusers and transformers classes at
the sizes diffusers' own tests use (tests/pipelines/<family>/), with the in-memory tokenizers of
workers/tiny/parts.py instead of hub downloads.

Where a pipeline reads hidden states of fixed text-encoder layers (FLUX.2 dev: 10, 20, 30; klein: 9,
18, 27) the tiny encoder has that many layers, each a few thousand parameters, so the pipeline is
called exactly as the real one is.
"""

from __future__ import annotations

import torch

from fleetgen.workers.tiny.parts import _evaluated, _tokenizer

# A chat template for the in-memory tokenizer: the text of every message, role first, as the
# Mistral, Qwen and Llama templates render it for text-only prompts (image parts are dropped).
_CHAT = (
    "{%- for m in messages -%}{{ m['role'] }} "
    "{%- if m['content'] is string %} {{ m['content'] }}"
    "{%- else %}{%- for c in m['content'] %}{%- if c['type'] == 'text' %} {{ c['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %} {% endfor -%}"
    "{%- if add_generation_prompt %}assistant{%- endif %}"
)


def _chat_tokenizer(model_max_length: int = 512):
    tokenizer = _tokenizer(model_max_length=model_max_length)
    tokenizer.chat_template = _CHAT
    tokenizer.padding_side = "right"
    return tokenizer


def _flux2_vae(seed: int):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    return AutoencoderKLFlux2(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _flux2_transformer(seed: int, joint_attention_dim: int, guidance_embeds: bool):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=joint_attention_dim,
        timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=guidance_embeds,
    )


@_evaluated
def build_tiny_flux2(seed: int = 0):
    """FLUX.2 [dev] at tiny size: a Mistral-3 text encoder (31 layers: the pipeline stacks layers
    10, 20 and 30), a guidance-embedding transformer, the FLUX.2 VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = _chat_tokenizer()
    hidden = 8
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 16,
            "max_position_embeddings": 1024,
            "num_attention_heads": 2,
            "num_hidden_layers": 31,
            "num_key_value_heads": 1,
            "head_dim": 4,
            "sliding_window": None,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 16,
            "image_size": 30,
            "patch_size": 6,
            "num_channels": 3,
        },
        image_token_index=2,
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed + 1)
    text_encoder = Mistral3ForConditionalGeneration(config)
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_flux2_vae(seed + 2),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_flux2_transformer(seed, 3 * hidden, guidance_embeds=True),
    )


@_evaluated
def build_tiny_flux2_klein(seed: int = 0, is_distilled: bool = True):
    """FLUX.2 [klein] at tiny size: a Qwen3 text encoder (28 layers: the pipeline stacks 9, 18, 27);
    `is_distilled` (the 4-step model) or the base model (real CFG)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _chat_tokenizer()
    hidden = 8
    torch.manual_seed(seed + 1)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=hidden,
            intermediate_size=16,
            num_hidden_layers=28,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            vocab_size=len(tokenizer),
            max_position_embeddings=1024,
            pad_token_id=1,
        )
    )
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_flux2_vae(seed + 2),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_flux2_transformer(seed, 3 * hidden, guidance_embeds=False),
        is_distilled=is_distilled,
    )


def _qwen25_vl(tokenizer, seed: int, hidden: int = 16):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = len(tokenizer) + 3  # the vision tokens after the text vocabulary
    q = hidden // 16  # the rotary sections of half a head (2 heads): a quarter, a quarter, a half
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": hidden,
            "intermediate_size": hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_scaling": {"mrope_section": [q, q, 2 * q], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "vocab_size": vocab,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": hidden,
        },
        hidden_size=hidden,
        vocab_size=vocab,
        vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 2,
        vision_token_id=vocab - 1,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


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
