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


SIZES = {
    "tiny": TinySize((32, 64), 1, 32, 2, (32, 64), 8),
    "small": TinySize((128, 256, 448), 2, 256, 4, (64, 128), 8),
}


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
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1,
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


def write_tiny_model(directory: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write the tiny pipeline to `directory` (loadable with `DiffusionPipeline.from_pretrained`)."""
    path = Path(directory)
    build_tiny_pipeline(seed=seed, size=size).save_pretrained(path)
    return path


def build_tiny_flux(seed: int = 0):
    """A Flux-like pipeline at tiny size (2 double + 4 single blocks, CLIP + T5 text encoders)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _tokenizer()
    tokenizer_2 = _tokenizer(model_max_length=32)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6],
    )
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=77, projection_dim=32,
    ))
    torch.manual_seed(seed + 2)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=1, eos_token_id=1,
    ))
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        block_out_channels=(32, 32), in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32, sample_size=32,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                        transformer=transformer)
