"""Tiny random-weight video pipelines of the real classes (the sizes of diffusers' own tests,
tests/pipelines/wan/, ltx/ and hunyuan_video1_5/): Wan 2.1 text-to-video, Wan 2.2's two experts,
Wan image-to-video, LTX-Video, LTX-2 (with sound), HunyuanVideo 1.5."""

from __future__ import annotations

import torch

from fleetgen.workers.tiny.parts import _byt5, _evaluated, _t5, _tokenizer


def _wan_parts(seed: int, in_channels: int = 16, experts: int = 1, image_dim: int | None = None) -> dict:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    tokenizer = _tokenizer(model_max_length=512)
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    transformers = []
    for k in range(experts):
        torch.manual_seed(seed + 1 + k)
        transformers.append(
            WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=2,
                attention_head_dim=12,
                in_channels=in_channels,
                out_channels=16,
                text_dim=32,
                freq_dim=256,
                ffn_dim=32,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32,
                image_dim=image_dim,
            )
        )
    # the published schedulers: UniPC on flow sigmas, shift 3 (480p)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    parts = {
        "tokenizer": tokenizer,
        "text_encoder": _t5(tokenizer, seed + 10, umt5=True),
        "vae": vae,
        "transformer": transformers[0],
        "scheduler": scheduler,
    }
    if experts == 2:
        parts.update(transformer_2=transformers[1], boundary_ratio=0.875)  # Wan 2.2 T2V-A14B's boundary
    return parts


@_evaluated
def build_tiny_wan(seed: int = 0, experts: int = 1):
    """Wan 2.1 text-to-video (`experts=2`: Wan 2.2 A14B's high- and low-noise transformers)."""
    from diffusers import WanPipeline

    return WanPipeline(**_wan_parts(seed, experts=experts))


@_evaluated
def build_tiny_wan_i2v(seed: int = 0, image_encoder: bool = False):
    """Wan image-to-video as Wan 2.2 I2V has it: no CLIP image encoder; the first frame's latents
    and a mask join the noise channels (16 + 4 + 16 = 36 in). `image_encoder`: as Wan 2.1 I2V has
    it, a CLIP vision encoder whose embeddings the transformer also reads (its `image_dim`)."""
    from diffusers import WanImageToVideoPipeline

    parts = _wan_parts(seed, in_channels=36, image_dim=4 if image_encoder else None)
    if not image_encoder:
        return WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None)
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed + 20)
    config = CLIPVisionConfig(
        hidden_size=4,
        projection_dim=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        intermediate_size=16,
        patch_size=1,
    )
    return WanImageToVideoPipeline(
        **parts,
        image_encoder=CLIPVisionModelWithProjection(config),
        image_processor=CLIPImageProcessor(crop_size=32, size=32),
    )


@_evaluated
def build_tiny_ltx(seed: int = 0):
    """LTX-Video: a T5 encoder, the LTX transformer (patch 1), its VAE with matching encoder and
    decoder (4x spatial, 4x temporal here; the real one 32x and 8x)."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    tokenizer = _tokenizer(model_max_length=128)
    torch.manual_seed(seed)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=1,
        caption_channels=32,
    )
    torch.manual_seed(seed + 1)
    channels, scaling = (8, 8, 8, 8), (True, True, False, False)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=channels,
        spatio_temporal_scaling=scaling,
        layers_per_block=(1, 1, 1, 1, 1),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        decoder_block_out_channels=channels,  # the decoder mirrors the encoder (its defaults are the real size)
        decoder_spatio_temporal_scaling=scaling,
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4,
        upsample_factor=(1,) * 4,
    )
    return LTXPipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=_t5(tokenizer, seed + 2),
        tokenizer=tokenizer,
    )


@_evaluated
def build_tiny_hunyuanvideo15(seed: int = 0):
    """HunyuanVideo 1.5 text-to-video: a Qwen2.5-VL text model and ByT5, its transformer (patch 1)
    and VAE (4x spatial, 2x temporal here; the real one 16x and 4x), guided by its CFG guider."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from fleetgen.workers.tiny.parts import _chat_tokenizer

    tokenizer = _chat_tokenizer()
    torch.manual_seed(seed)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        text_embed_2_dim=32,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        target_size=16,
        task_type="t2v",
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )
    torch.manual_seed(seed + 2)
    rope = {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_scaling=rope,
            rope_theta=1e6,
            vocab_size=len(tokenizer) + 3,
        )
    )
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=_byt5(seed + 3),
        tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def _ltx2_text(seed: int, tokenizer, hidden: int, layers: int):
    """Gemma 3 (its vision tower unused) and the text connectors, `hidden` wide."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config={
                "hidden_size": hidden,
                "intermediate_size": 32,
                "num_hidden_layers": layers,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "vocab_size": len(tokenizer),
                "sliding_window": 16,
                "max_position_embeddings": 2048,
            },
            vision_config={
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 28,
                "patch_size": 14,
            },
            mm_tokens_per_image=4,
        )
    )
    torch.manual_seed(seed + 2)  # after the transformer's seed + 1: the weights as before
    connector = {"num_attention_heads": 4, "attention_head_dim": 8, "num_layers": 1, "num_learnable_registers": None}
    connectors = LTX2TextConnectors(
        caption_channels=hidden,
        text_proj_in_factor=layers + 1,
        **{f"{side}_connector_{k}": v for side in ("video", "audio") for k, v in connector.items()},
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )
    return text_encoder, connectors


def _ltx2_audio(seed: int):
    """The audio VAE and a vocoder whose upsampling (10 x 4 x 4) matches the VAE's hop of 160 samples."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    torch.manual_seed(seed + 5)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,  # the audio VAE's channels x mel bins
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[20, 8, 8],
        upsample_factors=[10, 4, 4],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )
    return audio_vae, vocoder


@_evaluated
def build_tiny_ltx2(seed: int = 0):
    """LTX-2, video with sound: a Gemma 3 text encoder (its vision tower unused), the text connectors,
    the audio-video transformer, the video VAE (2x spatial and temporal here; the real one 32x and
    8x), the audio VAE and a vocoder whose upsampling (10 x 4 x 4) matches the audio VAE's hop of
    160 samples, so a clip's sound lasts as long as its frames (the real vocoder: 24 kHz stereo)."""
    from diffusers import (
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )

    tokenizer = _tokenizer(model_max_length=1024)
    hidden, layers = 32, 2  # the connectors' width is their heads x head size: 4 x 8
    torch.manual_seed(seed + 1)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        qk_norm="rms_norm_across_heads",
        caption_channels=hidden,
        rope_double_precision=False,
        rope_type="split",
    )
    text_encoder, connectors = _ltx2_text(seed, tokenizer, hidden, layers)
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    audio_vae, vocoder = _ltx2_audio(seed)
    return LTX2Pipeline(
        transformer=transformer,
        vae=vae,
        audio_vae=audio_vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        vocoder=vocoder,
    )
