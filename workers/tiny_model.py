"""A small random-weight Stable Diffusion pipeline built from real diffusers/transformers classes.

No hub access is needed: the tokenizer is built in memory with the `tokenizers` library. The demo,
the tests and the benchmarks load it back through `DiffusionPipeline.from_pretrained(dir)`, the same
path a real checkpoint takes.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch

# Vocabulary: lower-case words of the sample prompts are not needed verbatim; single letters,
# digits and a few hundred common words keep the tokenizer real without shipping a vocab file.
_WORDS = (
    "a an the of in on at with and or by for from to under over near above below photo painting "
    "drawing sketch portrait landscape city forest river mountain sea sky night day sunset sunrise "
    "cat dog bird fish horse fox owl robot car train ship house tower bridge garden flower tree "
    "red orange yellow green blue purple black white gold silver small big old new bright dark "
    "watercolor oil digital pixel art style detailed minimal cinematic lighting snow rain fog desert"
).split()


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


def _evaluated(builder):
    """Builders return pipelines in eval mode, as `from_pretrained` does (T5's dropout is on in
    train mode: two calls with one seed would differ)."""
    import functools

    @functools.wraps(builder)
    def build(*args, **kwargs):
        pipe = builder(*args, **kwargs)
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.eval()
        return pipe

    return build


def _tokenizer(model_max_length: int = 77):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|startoftext|>", "<|endoftext|>", "<unk>"]
    words = specials + sorted(set(_WORDS) | set(string.ascii_lowercase) | set(string.digits))
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", vocab["<|startoftext|>"]), ("<|endoftext|>", vocab["<|endoftext|>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )


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


def _clip(tokenizer, seed: int, projection: bool = False, hidden: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=77,
        projection_dim=32,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5(tokenizer, seed: int, d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=d_model,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=1,
            eos_token_id=1,
        )
    )


def _vae(seed: int, **kw):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        block_out_channels=(32, 32),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=32,
        **kw,
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


TINY_FAMILIES = {
    "sd": build_tiny_pipeline,
    "sdxl": build_tiny_sdxl,
    "sd3": build_tiny_sd3,
    "flux": lambda seed: build_tiny_flux(seed, guidance_embeds=True),
    "flux-schnell": build_tiny_flux,
    "pixart-sigma": build_tiny_pixart_sigma,
    "sana": build_tiny_sana,
}


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

    from offload.architectures import _component_class, resolve

    root = resolve(architecture)
    index = json.loads((root / "model_index.json").read_text())
    cls = getattr(diffusers, index["_class_name"])
    components, previous = {}, torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)  # initialised in `dtype`: no full-precision copy at any time
        for name, spec in index.items():
            if name.startswith("_") or not isinstance(spec, list):
                continue
            module_cls = _component_class(*spec)
            config = json.loads((root / name / "config.json").read_text())
            with torch.device(device):
                if spec[0] == "diffusers":
                    components[name] = module_cls.from_config(config).eval()
                else:
                    components[name] = module_cls(module_cls.config_class.from_dict(config)).eval()
    finally:
        torch.set_default_dtype(previous)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if name in components:
            t5 = "T5" in type(components[name]).__name__
            components[name.replace("text_encoder", "tokenizer")] = _tokenizer(model_max_length=512 if t5 else 77)
    scheduler = "EulerDiscreteScheduler" if "unet" in components else "FlowMatchEulerDiscreteScheduler"
    kwargs = {"add_watermarker": False} if cls.__name__.startswith("StableDiffusionXL") else {}
    return cls(scheduler=getattr(diffusers, scheduler)(), **components, **kwargs)
