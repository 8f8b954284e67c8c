"""Denoiser FLOPs counted, not estimated: torch's FlopCounterMode over one forward of the denoiser built
on the `meta` device (no weights, no compute), at three image sizes, fitted exactly as
`fixed + per_token × tokens + per_token² × tokens²` (the text's own work; the matmuls over every image
token; attention's scores among them). Stored per denoiser architecture — its class and config, so a
real checkpoint of a shipped architecture finds its count — in `architectures/flops.json`;
`python -m fleetgen.offload.flops` rewrites it and a test checks it against a fresh count.

Counted where fleetgen knows how to call the class (`INPUTS`); elsewhere the cost model estimates
2 FLOPs per parameter per token plus attention (offload/cost.py `_flops`)."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

STORED = Path(__file__).with_name("architectures") / "flops.json"
SIDES = (512, 768, 1024)  # pixels a side of the three counts


def config_key(cls: str, config: dict) -> str:
    """A denoiser architecture: its class and its config's own keys (not `_name_or_path` and the like)."""
    own = {k: v for k, v in sorted(config.items()) if not k.startswith("_")}
    return hashlib.sha256(json.dumps([cls, own], sort_keys=True, default=str).encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def _stored() -> dict:
    return json.loads(STORED.read_text()) if STORED.exists() else {}


def counted(cls: str, config: dict | None) -> tuple[float, float, float] | None:
    """(fixed, per token, per token²) FLOPs of one forward of one image, as stored; None if not counted."""
    if not config:
        return None
    found = _stored().get(config_key(cls, dict(config)))
    return tuple(found["terms"]) if found else None


# How to call each class for one image of `side` pixels a side, on the meta device: its keyword arguments
# from its config (text of TEXT_TOKENS tokens). A latent pixel is `scale` image pixels a side.
TEXT = 512


def _flux(m, side, t):
    c, tokens = m.config, (side // 16) ** 2
    return dict(
        hidden_states=t(1, tokens, c.in_channels),
        encoder_hidden_states=t(1, TEXT, c.joint_attention_dim),
        pooled_projections=t(1, c.pooled_projection_dim),
        timestep=t(1),
        img_ids=t(tokens, 3),
        txt_ids=t(TEXT, 3),
        guidance=t(1) if c.guidance_embeds else None,
    )


def _sd3(m, side, t):
    c = m.config
    return dict(
        hidden_states=t(1, c.in_channels, side // 8, side // 8),
        encoder_hidden_states=t(1, 333, c.joint_attention_dim),  # 77 CLIP + 256 T5 tokens, as the pipeline joins them
        pooled_projections=t(1, c.pooled_projection_dim),
        timestep=t(1),
    )


def _unet(m, side, t):
    c = m.config
    kwargs = dict(
        sample=t(1, c.in_channels, side // 8, side // 8),
        timestep=t(1),
        encoder_hidden_states=t(1, 77, c.cross_attention_dim),
    )
    if c.addition_embed_type == "text_time":  # SDXL: pooled text and six size conditions
        pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": t(1, pooled), "time_ids": t(1, 6)}
    return kwargs


def _qwen(m, side, t):
    c, lat = m.config, side // 16
    return dict(
        hidden_states=t(1, lat * lat, c.in_channels),
        encoder_hidden_states=t(1, TEXT, c.joint_attention_dim),
        encoder_hidden_states_mask=t(1, TEXT),
        timestep=t(1),
        img_shapes=[[(1, lat, lat)]],
    )


INPUTS = {
    "FluxTransformer2DModel": _flux,
    "SD3Transformer2DModel": _sd3,
    "UNet2DConditionModel": _unet,
    "QwenImageTransformer2DModel": _qwen,
}


def count(module, side: int) -> float:
    """FLOPs of one forward of `module` (built on `meta`) for one image of `side` pixels a side."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    dtype = next(module.parameters()).dtype

    def t(*shape):
        return torch.zeros(*shape, device="meta", dtype=dtype if len(shape) > 1 else torch.float32)

    kwargs = {k: v for k, v in INPUTS[type(module).__name__](module, side, t).items() if v is not None}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(**kwargs, return_dict=False)
    return float(counter.get_total_flops())


def terms(module, tokens_at) -> tuple[float, float, float]:
    """(fixed, per token, per token²) from three counts, solved exactly; `tokens_at(side)`: the
    denoiser's image tokens at that side."""
    import numpy as np

    ts = [tokens_at(s) for s in SIDES]
    flops = [count(module, s) for s in SIDES]
    a = np.array([[1.0, t, t * t] for t in ts])
    return tuple(float(x) for x in np.linalg.solve(a, np.array(flops)))


def write_stored(names: list[str] | None = None) -> dict:
    """Count every shipped architecture's denoiser whose class `INPUTS` knows, and store the terms."""
    from fleetgen.offload.architectures import NAMES, build_on_meta
    from fleetgen.offload.profiles import PER_STEP

    out = dict(_stored()) if names else {}
    for name in names or NAMES:
        modules = build_on_meta(name)
        for part in (n for n in PER_STEP if n in modules):
            module = modules[part]
            cls = type(module).__name__
            if cls not in INPUTS:
                continue
            latent = 8 * (1 if cls == "UNet2DConditionModel" else 2)  # a token: 8x8 pixels (UNet) or 16x16

            def tokens_at(side, latent=latent):
                return (side // latent) ** 2

            out[config_key(cls, dict(module.config))] = {
                "architecture": name,
                "component": part,
                "class": cls,
                "terms": list(terms(module, tokens_at)),
                "counted_at": [f"{s}x{s}" for s in SIDES],
            }
    STORED.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    _stored.cache_clear()
    return out


if __name__ == "__main__":
    import sys

    for key, entry in write_stored(sys.argv[1:] or None).items():
        print(key, entry["architecture"], entry["class"], [f"{x:.4g}" for x in entry["terms"]])
