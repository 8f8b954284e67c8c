"""Tiny pipelines of the Flux line: FLUX.1 (dev, schnell), FLUX.2 dev and klein, Chroma — the sizes of
diffusers' own tests (tests/pipelines/<family>/), in-memory tokenizers.

Where a pipeline reads hidden states of fixed text-encoder layers (FLUX.2 dev: 10, 20, 30; klein: 9,
18, 27) the tiny encoder has that many layers, each a few thousand parameters, so the pipeline is
called exactly as the real one is.
"""

from __future__ import annotations

import torch

from fleetgen.workers.tiny.parts import _chat_tokenizer, _evaluated, _t5, _tokenizer


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
