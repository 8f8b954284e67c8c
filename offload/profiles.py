"""What the planner knows of a pipeline: bytes per component and per offload group
(`PipelineProfile`), with no torch — so `fleetgen plan` on a shipped architecture reads its stored
profile (`offload/architectures/<name>/profiles.json`) instead of importing diffusers, transformers
and torch to build the model on the `meta` device. `offload/profile.py` computes profiles from
modules; `python -m fleetgen.offload.profiles` writes the stored ones, and a test checks them against
the meta build.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from fleetgen.latents import latent_frames

# The denoiser runs once per step; everything else once per pipeline call.
PER_STEP = ("unet", "transformer", "transformer_2", "prior", "decoder")
STORED = "profiles.json"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ComponentProfile:
    name: str
    cls: str
    params: int  # parameter count
    bytes: int  # parameters + buffers at the run dtype
    per_step: bool  # runs every denoising step (the denoiser) or once per pipeline call
    blocks: tuple[int, ...]  # bytes of each offloadable block at block level (1 block per group)
    unmatched: int  # bytes resident for the whole forward at block level
    largest_leaf: int  # bytes of the largest leaf layer
    leaves: int  # leaf layers: the number of groups (and transfers per forward) at leaf level
    non_leaf: int  # bytes outside leaf layers (norms, bare parameters): resident during the forward at leaf level
    block_modules: tuple[str, ...]  # passed to apply_group_offloading so text encoders split by layer
    tied: bool  # shares a weight between modules (refused with leaf level + disk)
    hidden: int  # width of the main activations (for activation estimates)
    adapters: bool = False  # holds LoRA layers (never offloaded to disk: diffusers computes wrong images)
    upcast: bool = False  # the pipeline casts it to float32 to run it (SDXL's VAE): counted at 4 bytes, never streamed
    pinned: int = 0  # host bytes of its page-locked copy with streams: torch's host allocator rounds each tensor
    #                  up to a power of two (FLUX's transformer: 23.8 GB of weights, 37.2 GB pinned); 0: `bytes`
    fmt: str = "none"  # the storage format these counts are for (offload/quantize.py); none: the live tensors
    # parameters weighted by the share of the denoiser's tokens each one runs over, for its FLOPs: a UNet's
    # levels run at 1/4, 1/16, ... of the full resolution's tokens (SDXL's UNet: 185 M of its 2.57 G);
    # 0: every parameter over every token (a transformer)
    token_params: int = 0
    # a denoiser's FLOPs per forward of one image as torch's FLOP counter counted them on its meta build
    # (offload/flops.py): (fixed, per image token, per image token squared); () where not counted
    flops_terms: tuple[float, ...] = ()

    def block_floor(self, k: int) -> int:
        """Device bytes while running at block level with `k` blocks per group."""
        groups = [sum(self.blocks[i : i + k]) for i in range(0, len(self.blocks), k)] or [0]
        return self.unmatched + max(groups)


@dataclass(frozen=True)
class PipelineProfile:
    model: str
    dtype_bytes: int
    components: dict[str, ComponentProfile]
    latent_channels: int
    vae_scale: int  # pixels per latent pixel
    vae_channels: int  # channels of the VAE decoder's full-resolution feature maps
    patch: int  # latent pixels per token (transformers); 1 for UNets
    vae_dtype_bytes: int = 0  # bytes per value of the VAE's decode (4 when the pipeline upcasts it); 0: dtype_bytes
    # {component: {format: the component counted in that format}} for the formats it could be given
    variants: dict[str, dict[str, ComponentProfile]] = field(default_factory=dict)
    vae_temporal: int = 1  # video VAEs: frames per latent frame after the first (Wan: 4)
    # denoisers that run on alternate step ranges (Wan 2.2 A14B's experts): {name: share of the steps}
    step_shares: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.components.values())

    def image_tokens(self, width: int, height: int, frames: int = 0) -> int:
        """The denoiser's tokens for one image of this size (a clip of `frames`: every latent frame's)."""
        side = self.vae_scale * self.patch
        return (width // side) * (height // side) * latent_frames(frames, self.vae_temporal)

    def holding(self, formats: dict[str, str]) -> PipelineProfile:
        """This profile with components that hold a format already (applied at load: their live
        counts are that format's) marked so: the planner gives them that format's placements and cost."""
        if not formats:
            return self
        marked = {n: replace(c, fmt=formats[n]) if n in formats else c for n, c in self.components.items()}
        variants = {**self.variants, **{n: {f: marked[n]} for n, f in formats.items()}}
        return replace(self, components=marked, variants=variants)

    def only(self, names) -> PipelineProfile:
        """This profile with the components `names` alone (a phase of a phased plan: offload/phasing.py)."""
        keep = [n for n in self.components if n in set(names)]
        return replace(
            self,
            components={n: self.components[n] for n in keep},
            variants={n: v for n, v in self.variants.items() if n in keep},
            step_shares={n: s for n, s in self.step_shares.items() if n in keep},
        )

    def variant(self, name: str, fmt: str) -> ComponentProfile:
        if fmt == "none" or self.components[name].fmt == fmt:
            return self.components[name]
        try:
            return self.variants[name][fmt]
        except KeyError:
            raise KeyError(f"{name} was not profiled as {fmt} (profile_modules(formats=...))") from None


def stored_key(dtype: str, vae_upcast: bool) -> str:
    """The stored profile's key: the run dtype, and whether the pipeline upcasts its VAE (SDXL at
    float16), which changes the VAE's counts."""
    return f"{dtype}+vae-upcast" if vae_upcast and dtype == "float16" else dtype


def to_json(profile: PipelineProfile) -> dict:
    return asdict(profile)


def from_json(data: dict) -> PipelineProfile:
    def component(c: dict) -> ComponentProfile:
        return ComponentProfile(
            **{
                **c,
                "blocks": tuple(c["blocks"]),
                "block_modules": tuple(c["block_modules"]),
                "flops_terms": tuple(c.get("flops_terms", ())),
            }
        )

    return PipelineProfile(
        **{
            **data,
            "components": {n: component(c) for n, c in data["components"].items()},
            "variants": {n: {f: component(c) for f, c in v.items()} for n, v in data["variants"].items()},
        }
    )


def stored_profile(root: Path, dtype: str, vae_upcast: bool, formats: tuple[str, ...]) -> PipelineProfile | None:
    """The profile stored beside a shipped architecture's configs, with the variants of `formats`;
    None when there is none for this dtype or it was not counted in one of `formats` (a GGUF file's)."""
    path = root / STORED
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    data = stored["profiles"].get(stored_key(dtype, vae_upcast))
    if data is None or not set(formats) <= set(stored["formats"]):
        return None
    profile = from_json(data)
    variants = {n: {f: c for f, c in v.items() if f in formats} for n, v in profile.variants.items()}
    return replace(profile, variants={n: v for n, v in variants.items() if v})


def write_stored(names: list[str] | None = None) -> list[Path]:
    """Compute every shipped architecture's profiles (each dtype; float16 with and without the VAE
    upcast where the VAE asks for it; every choosable storage format) from its meta build, and store
    them beside its configs. Run after changing a config or the profiler: a test compares them."""
    import torch

    from fleetgen.offload.architectures import HERE, NAMES, build_on_meta, pipeline_settings
    from fleetgen.offload.profile import profile_modules
    from fleetgen.offload.weight_formats import CHOOSABLE

    written = []
    for name in names or NAMES:
        modules = build_on_meta(name)
        settings = pipeline_settings(name)
        profiles = {}
        for dtype in DTYPE_BYTES:
            for upcast in (False, True) if dtype == "float16" else (False,):
                profile = profile_modules(name, modules, getattr(torch, dtype), upcast, CHOOSABLE, settings)
                profiles[stored_key(dtype, upcast)] = to_json(profile)
        path = HERE / name / STORED
        path.write_text(json.dumps({"formats": list(CHOOSABLE), "profiles": profiles}, separators=(",", ":")) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    import sys

    for path in write_stored(sys.argv[1:] or None):
        print(f"wrote {path}")
