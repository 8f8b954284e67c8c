"""How a pipeline's pixels map to latents and tokens, from its components' configs (plain dicts, no
torch): shared by the planner's profile (offload/), a model directory's size rule and a loaded
pipeline's (workers/)."""

from __future__ import annotations


def vae_scale(vae: dict) -> int:
    """Pixels per latent, from a VAE's config: AutoencoderKL (and FLUX.2's) list `block_out_channels`,
    Sana's AutoencoderDC `encoder_block_out_channels`, the Wan-style VAEs (Qwen-Image, Wan) their
    `temperal_downsample` stages, HunyuanImage's its `spatial_compression_ratio`."""
    if vae.get("spatial_compression_ratio"):
        return int(vae["spatial_compression_ratio"])
    if "temperal_downsample" in vae:
        return 2 ** len(vae["temperal_downsample"])
    return 2 ** (len(vae.get("block_out_channels") or vae.get("encoder_block_out_channels") or [0, 0, 0, 0]) - 1)


def denoiser_patch(cls: str, config: dict) -> int:
    """Latents per token side: FLUX.1, FLUX.2 and Chroma pack 2x2 latents in the pipeline; the others
    say `patch_size` (a number, or per axis as HunyuanImage's [1, 1] and Wan's [1, 2, 2]: the last is
    spatial) or Z-Image's `all_patch_size`."""
    if cls.startswith(("Flux", "Chroma")):
        return 2
    patch = config.get("patch_size") or config.get("all_patch_size") or 1
    return int(patch[-1] if isinstance(patch, (list, tuple)) else patch)
