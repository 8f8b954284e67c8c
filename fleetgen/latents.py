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
    if vae.get("scale_factor_spatial"):  # Wan 2.2's 48-channel VAE: 8 x its patch of 2
        return int(vae["scale_factor_spatial"])
    if "spatio_temporal_scaling" in vae:  # LTX-Video: its patch x 2 per scaling stage (4 x 2^3 = 32)
        return int(vae.get("patch_size") or 1) * 2 ** sum(bool(x) for x in vae["spatio_temporal_scaling"])
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


def vae_temporal(vae: dict) -> int:
    """Frames per latent frame (after the first) of a video VAE; 1 for image VAEs. Wan's VAEs say
    `scale_factor_temporal` or their `temperal_downsample` stages (2 of 3: 4 frames), LTX's
    `temporal_compression_ratio`."""
    if vae.get("temporal_compression_ratio"):
        return int(vae["temporal_compression_ratio"])
    if vae.get("scale_factor_temporal"):
        return int(vae["scale_factor_temporal"])
    if "temperal_downsample" in vae:
        return 2 ** sum(bool(x) for x in vae["temperal_downsample"])
    if "spatio_temporal_scaling" in vae:  # LTX-Video: 1 x 2^3 = 8
        return int(vae.get("patch_size_t") or 1) * 2 ** sum(bool(x) for x in vae["spatio_temporal_scaling"])
    return 1


def latent_frames(frames: int, temporal: int) -> int:
    """Latent frames of a clip of `frames` (0: an image, one)."""
    return (frames - 1) // temporal + 1 if frames else 1


def expert_shares(boundary: float | None, shift: float | None) -> dict[str, float]:
    """The share of the steps each of Wan 2.2 A14B's experts runs: `transformer` (high noise) while
    the timestep is at or above `boundary` x 1000, `transformer_2` after. The schedule's sigmas go
    from 1 to 0 evenly before the flow shift s (sigma' = s sigma / (1 + (s - 1) sigma)); sigma' >= b
    where sigma >= b / (s - (s - 1) b): at b = 0.875, s = 12 (T2V-A14B) the high-noise expert runs
    63 % of the steps. {} for one denoiser."""
    if not boundary:
        return {}
    s = shift or 1.0
    high = 1 - boundary / (s - (s - 1) * boundary)
    return {"transformer": high, "transformer_2": 1 - high}
