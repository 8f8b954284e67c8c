"""The denoiser FLOP counter (a maintenance tool, as bench/fit_speed.py is): torch's FlopCounterMode over one
forward of each shipped denoiser built on the `meta` device (no weights, no compute), at three image sizes
(a clip's: two frame counts, two sizes), fitted exactly as `fixed + per_token × tokens + per_token² ×
tokens²` (the text's own work; the matmuls over every image token; attention's scores among them), stored
in offload/architectures/flops.json, which the runtime only reads (offload/flops.py `counted`).

    python -m bench.flops [ARCHITECTURE ...]   # recount (all by default) and rewrite the stored terms

Counted where this module knows how to call the class (`INPUTS`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fleetgen.latents import latent_frames
from fleetgen.offload.flops import IMAGE_ONLY, STORED, _stored, config_key

# How to call each class for one image (or clip) on the meta device: its keyword arguments from its config
# and the latent's shape (`Shape`: latent rows, columns and frames, and the denoiser's tokens as the
# profile counts them); text of TEXT tokens.
TEXT = 512


@dataclass(frozen=True)
class Shape:
    height: int  # latent rows (image rows / the VAE's scale)
    width: int
    frames: int  # latent frames (1 for an image)
    tokens: int  # the denoiser's tokens, as PipelineProfile.image_tokens counts them


def _flux(m, s, t):
    c = m.config
    return dict(
        hidden_states=t(1, s.tokens, c.in_channels),
        encoder_hidden_states=t(1, TEXT, c.joint_attention_dim),
        pooled_projections=t(1, c.pooled_projection_dim),
        timestep=t(1),
        img_ids=t(s.tokens, 3),
        txt_ids=t(TEXT, 3),
        guidance=t(1) if c.guidance_embeds else None,
    )


def _flux2(m, s, t):
    c = m.config
    return dict(
        hidden_states=t(1, s.tokens, c.in_channels),
        encoder_hidden_states=t(1, TEXT, c.joint_attention_dim),
        timestep=t(1),
        img_ids=t(1, s.tokens, 4),
        txt_ids=t(1, TEXT, 4),
        guidance=t(1) if c.guidance_embeds else None,
    )


def _chroma(m, s, t):
    c = m.config
    return dict(
        hidden_states=t(1, s.tokens, c.in_channels),
        encoder_hidden_states=t(1, TEXT, c.joint_attention_dim),
        timestep=t(1),
        img_ids=t(s.tokens, 3),
        txt_ids=t(TEXT, 3),
    )


def _sd3(m, s, t):
    c = m.config
    return dict(
        hidden_states=t(1, c.in_channels, s.height, s.width),
        encoder_hidden_states=t(1, 333, c.joint_attention_dim),  # 77 CLIP + 256 T5 tokens, as the pipeline joins them
        pooled_projections=t(1, c.pooled_projection_dim),
        timestep=t(1),
    )


def _unet(m, s, t):
    c = m.config
    kwargs = dict(
        sample=t(1, c.in_channels, s.height, s.width),
        timestep=t(1),
        encoder_hidden_states=t(1, 77, c.cross_attention_dim),
    )
    if c.addition_embed_type == "text_time":  # SDXL: pooled text and six size conditions
        pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": t(1, pooled), "time_ids": t(1, 6)}
    return kwargs


def _qwen(m, s, t):
    c = m.config
    return dict(
        hidden_states=t(1, s.tokens, c.in_channels),
        encoder_hidden_states=t(1, TEXT, c.joint_attention_dim),
        encoder_hidden_states_mask=t(1, TEXT),
        timestep=t(1),
        img_shapes=[[(1, s.height // 2, s.width // 2)]],
    )


def _z_image(m, s, t):
    c = m.config
    return dict(x=[t(c.in_channels, s.frames, s.height, s.width)], t=t(1), cap_feats=[t(TEXT, c.cap_feat_dim)])


def _hunyuan_image(m, s, t):
    """Qwen2.5-VL text and ByT5 glyph text. (HunyuanVideo 1.5 is not counted: its forward branches on its
    image embedding's values, which `meta` does not have.)"""
    c = m.config
    return dict(
        hidden_states=t(1, c.in_channels, s.height, s.width),
        timestep=t(1),
        encoder_hidden_states=t(1, 1000, c.text_embed_dim),
        encoder_attention_mask=t(1, 1000),
        encoder_hidden_states_2=t(1, 128, c.text_embed_2_dim),
        encoder_attention_mask_2=t(1, 128),
    )


def _wan(m, s, t):
    c = m.config
    return dict(
        hidden_states=t(1, c.in_channels, s.frames, s.height, s.width),
        timestep=t(1),
        encoder_hidden_states=t(1, TEXT, c.text_dim),
    )


INPUTS = {
    "FluxTransformer2DModel": _flux,
    "Flux2Transformer2DModel": _flux2,
    "ChromaTransformer2DModel": _chroma,
    "SD3Transformer2DModel": _sd3,
    "UNet2DConditionModel": _unet,
    "QwenImageTransformer2DModel": _qwen,
    "ZImageTransformer2DModel": _z_image,
    "HunyuanImageTransformer2DModel": _hunyuan_image,
    "WanTransformer3DModel": _wan,
}
# Where the counts are taken: (width, height, frames); a clip's at two frame counts and two sizes.
IMAGE_SIZES = ((512, 512, 0), (768, 768, 0), (1024, 1024, 0))
CLIP_SIZES = ((512, 512, 9), (512, 512, 17), (768, 768, 9))


def shape_of(prof, width: int, height: int, frames: int = 0) -> Shape:
    """The latent `prof`'s denoiser sees for one image (or clip) of this size."""
    return Shape(
        height // prof.vae_scale,
        width // prof.vae_scale,
        latent_frames(frames, prof.vae_temporal),
        prof.image_tokens(width, height, frames),
    )


def count(module, shape: Shape) -> float:
    """FLOPs of one forward of `module` (built on `meta`) for one image or clip of latent `shape`."""
    import torch
    import torch.fx.experimental._config
    from torch.utils.flop_counter import FlopCounterMode

    dtype = next(module.parameters()).dtype

    def t(*dims):
        return torch.zeros(*dims, device="meta", dtype=dtype if len(dims) > 1 else torch.float32)

    kwargs = {k: v for k, v in INPUTS[type(module).__name__](module, shape, t).items() if v is not None}
    # a text mask's selections (HunyuanImage's) count every token: no data on `meta` to select by
    assume_all = torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True)
    with assume_all, FlopCounterMode(display=False) as counter, torch.no_grad():
        module(**kwargs, return_dict=False)
    return float(counter.get_total_flops())


def terms(module, shapes: list[Shape]) -> tuple[float, float, float]:
    """(fixed, per token, per token²) from three counts at distinct token counts, solved exactly."""
    import numpy as np

    a = np.array([[1.0, s.tokens, s.tokens**2] for s in shapes])
    return tuple(float(x) for x in np.linalg.solve(a, np.array([count(module, s) for s in shapes])))


def write_stored(names: list[str] | None = None) -> dict:
    """Count every shipped architecture's denoisers whose class `INPUTS` knows, and store the terms."""
    from fleetgen.offload.architectures import HERE, NAMES, build_on_meta
    from fleetgen.offload.profiles import PER_STEP, stored_profile

    out = dict(_stored()) if names else {}
    for name in names or NAMES:
        modules = build_on_meta(name)
        prof = stored_profile(HERE / name, "bfloat16", False, ())
        sizes = CLIP_SIZES if prof.vae_temporal > 1 and name not in IMAGE_ONLY else IMAGE_SIZES
        shapes = [shape_of(prof, *size) for size in sizes]
        for part in (n for n in PER_STEP if n in modules):
            module = modules[part]
            cls = type(module).__name__
            if cls not in INPUTS:
                continue
            out[config_key(cls, dict(module.config))] = {
                "architecture": name,
                "component": part,
                "class": cls,
                "terms": list(terms(module, shapes)),
                "counted_at": [f"{w}x{h}" + (f"x{f}" if f else "") for w, h, f in sizes],
            }
    STORED.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    _stored.cache_clear()
    return out


if __name__ == "__main__":
    import sys

    for key, entry in write_stored(sys.argv[1:] or None).items():
        print(key, entry["architecture"], entry["class"], [f"{x:.4g}" for x in entry["terms"]])
