"""Bytes per component and per offload group, as diffusers' group offloading would cut them.

Works on real weights and on the `meta` device (architectures planned without their weights).
The grouping rules mirror `diffusers/hooks/group_offloading.py` (0.42): block level groups the
direct `ModuleList`/`Sequential` children of a module, recursing into `block_modules` by name;
everything else of that module is one "unmatched" group that stays on the device for the whole
forward. Leaf level makes one group per Conv/Linear/Embedding.
"""

from __future__ import annotations

import torch

from fleetgen.latents import denoiser_patch, expert_shares, vae_scale, vae_temporal
from fleetgen.offload.flops import counted
from fleetgen.offload.profiles import PER_STEP, ComponentProfile, PipelineProfile
from fleetgen.offload.quantize import FLOAT8, LEAF_TYPES, stored_sizes
from fleetgen.offload.weight_formats import NONE, spec

_LEAF_TYPES = LEAF_TYPES
_BLOCK_TYPES = (torch.nn.ModuleList, torch.nn.Sequential)


class _Sizer:
    """Bytes of a tensor: at the run dtype for floating tensors, except those stored in float8,
    which hold one byte each; a tensor subclass (torchao's int8) holds its inner tensors; `stored`
    overrides by id (a storage format predicted, offload/quantize.py's `stored_sizes`)."""

    def __init__(self, dtype_bytes: int, stored: dict[int, int] | None = None):
        self.dtype_bytes, self.stored = dtype_bytes, stored or {}

    def __call__(self, t: torch.Tensor) -> int:
        if id(t) in self.stored:
            return self.stored[id(t)]
        inner = getattr(type(t), "__tensor_flatten__", None) and type(t) not in (torch.Tensor, torch.nn.Parameter)
        if inner:
            names, _ = t.__tensor_flatten__()
            return sum(self(getattr(t, n)) for n in names)
        size = self.dtype_bytes if t.is_floating_point() and t.dtype not in FLOAT8 else t.element_size()
        return t.numel() * size


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=True), *module.buffers(recurse=True)]


def _pinned_bytes(module: torch.nn.Module, size) -> int:
    """What pinning every tensor of `module` takes: each is one host allocation, rounded up to a
    power of two by torch's CachingHostAllocator (and cached, not freed, when released)."""
    total, seen = 0, set()
    for t in _tensors(module):
        if id(t) not in seen:
            seen.add(id(t))
            n = size(t)
            total += 1 << max(n - 1, 0).bit_length() if n else 0
    return total


def _bytes(module: torch.nn.Module, size, seen: set[int] | None = None) -> int:
    total = 0
    for t in _tensors(module):
        if seen is not None:
            if id(t) in seen:
                continue
            seen.add(id(t))
        total += size(t)
    return total


def live_bytes(module: torch.nn.Module, dtype_bytes: int) -> int:
    """Bytes `module`'s tensors hold now (float8 and tensor subclasses as they store)."""
    return _bytes(module, _Sizer(dtype_bytes))


def text_encoder_block_modules(module: torch.nn.Module) -> tuple[str, ...]:
    """Names leading to the largest block list when it is not a direct child (CLIP:
    text_model.encoder.layers -> ("text_model", "encoder"); T5: encoder.block -> ("encoder",))."""
    best, best_size = None, 0
    for name, sub in module.named_modules():
        if isinstance(sub, _BLOCK_TYPES) and name:
            size = sum(p.numel() for p in sub.parameters())
            if size > best_size:
                best, best_size = name, size
    if best is None or "." not in best:
        return ()
    return tuple(best.split(".")[:-1])


def _blocks(module: torch.nn.Module, block_modules: set[str], size, seen: set[int]) -> list[int]:
    """Block sizes as diffusers' block level cuts them; marks their tensors as seen."""
    out = []
    for name, child in module.named_children():
        if name in block_modules:
            out += _blocks(child, block_modules, size, seen)
        elif isinstance(child, _BLOCK_TYPES):
            out += [_bytes(block, size, seen) for block in child]
    return out


def _width(module: torch.nn.Module) -> int:
    """Channels of the main activations: the first UNet level, a transformer's inner dimension, a
    text encoder's hidden size; else the widest Linear output."""
    cfg = getattr(module, "config", None)
    get = (
        (lambda k: cfg.get(k) if isinstance(cfg, dict) else getattr(cfg, k, None))
        if cfg is not None
        else (lambda k: None)
    )
    if get("block_out_channels"):
        return int(get("block_out_channels")[0])
    if isinstance(get("num_attention_heads"), int) and isinstance(get("attention_head_dim"), int):
        return get("num_attention_heads") * get("attention_head_dim")
    for key in ("hidden_size", "d_model", "dim"):  # "dim": Z-Image's transformer
        if isinstance(get(key), int):
            return get(key)
    text = get("text_config")  # vision-language encoders (Mistral 3, Qwen2.5-VL): the language model's width
    width = getattr(text, "hidden_size", None) if text is not None else None
    if isinstance(width, int):
        return width
    # the widest Linear *input*: an output head's width is the vocabulary, not the activations
    return max((m.in_features for m in module.modules() if isinstance(m, torch.nn.Linear)), default=0)


def _unet_level(name: str, levels: int) -> int | None:
    """The resolution level a UNet's layer `name` runs at (0: the latent's full resolution; each
    level down a quarter of its tokens): a down block's own level, its downsampler's output one
    level lower; the middle block at the lowest; an up block mirrored, its upsampler's convolution one
    level up. None: layers that run once per sample (time and added-condition embeddings)."""
    if name.startswith(("time_embedding", "add_embedding", "class_embedding", "encoder_hid_proj")):
        return None
    if name.startswith("mid_block"):
        return levels - 1
    parts = name.split(".")
    if parts[0] == "down_blocks":
        return int(parts[1]) + (parts[2] == "downsamplers")
    if parts[0] == "up_blocks":
        return levels - 1 - int(parts[1]) - (parts[2] == "upsamplers")
    return 0  # conv_in, the output norm and conv_out


def _token_params(module: torch.nn.Module) -> int:
    """Parameters weighted by the share of the full-resolution tokens each runs over (ComponentProfile
    `token_params`): for a diffusers UNet (down, middle and up blocks), each Linear and convolution at
    1/4 per level down, cross-attention's key and value projections (over the text, not the image)
    left out; 0 for anything else. SDXL at 1024²: 2 × this × tokens = 6.0 TFLOP per sample, where
    torch's FlopCounterMode counts 6.8 with the attention matmuls (tests/offload/test_offload.py)."""
    if not all(hasattr(module, k) for k in ("down_blocks", "mid_block", "up_blocks")):
        return 0
    levels, total = len(module.down_blocks), 0.0
    for name, layer in module.named_modules():
        if not isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) or name.endswith(("attn2.to_k", "attn2.to_v")):
            continue
        level = _unet_level(name, levels)
        if level is not None:  # a Linear's shape, not its weight's numel: a 4-bit weight is packed
            weights = (
                layer.in_features * layer.out_features if isinstance(layer, torch.nn.Linear) else layer.weight.numel()
            )
            total += weights / 4**level
    return int(total)


def profile_component(
    name: str, module: torch.nn.Module, dtype_bytes: int, upcast: bool = False, fmt: str = "none"
) -> ComponentProfile:
    """`fmt`: count the component as storage format `fmt` would hold it (offload/quantize.py);
    `none`: as its live tensors are."""
    size = _Sizer(dtype_bytes, stored_sizes(module, fmt) if fmt != NONE else None)
    explicit = getattr(module, "_group_offload_block_modules", None)
    block_modules = tuple(explicit) if explicit is not None else text_encoder_block_modules(module)
    seen: set[int] = set()
    blocks = _blocks(module, set(block_modules), size, seen)
    total = _bytes(module, size)
    leaves = [m for m in module.modules() if isinstance(m, _LEAF_TYPES)]
    leaf_seen: set[int] = set()
    leaf_sizes = [_bytes(m, size, leaf_seen) for m in leaves]
    ids = [id(p) for _, p in module.named_parameters(remove_duplicate=False)]
    hidden = _width(module)
    return ComponentProfile(
        name=name,
        cls=type(module).__name__,
        params=sum(p.numel() for p in module.parameters()),
        bytes=total,
        per_step=name in PER_STEP,
        blocks=tuple(blocks),
        unmatched=total - sum(blocks),
        largest_leaf=max(leaf_sizes, default=0),
        leaves=len(leaves),
        non_leaf=max(0, total - sum(leaf_sizes)),
        block_modules=block_modules,
        tied=len(ids) != len(set(ids)),
        hidden=hidden,
        adapters=bool(getattr(module, "peft_config", None)),
        upcast=upcast,
        pinned=_pinned_bytes(module, size),
        fmt=fmt,
        token_params=_token_params(module),
        flops_terms=counted(type(module).__name__, getattr(module, "config", None)) or () if name in PER_STEP else (),
    )


def _config_value(module: torch.nn.Module | None, key: str, default: int) -> int:
    cfg = getattr(module, "config", None)
    value = getattr(cfg, key, None) if cfg is not None else None
    return value if isinstance(value, int) else default


def profile_modules(
    model: str,
    modules: dict[str, torch.nn.Module],
    dtype: torch.dtype,
    vae_upcast: bool = False,
    formats: tuple[str, ...] = (),
    pipeline_config: dict | None = None,
) -> PipelineProfile:
    """`vae_upcast`: the pipeline runs its VAE in float32 when the run dtype is float16 and the VAE's
    config says `force_upcast` (the family says whether its pipeline does: SDXL's does). `formats`:
    storage formats to count each component in too, where the format serves it (the planner's
    `variants`). `pipeline_config`: the pipeline's own settings (model_index.json's plain values) and
    its scheduler's `flow_shift`, where two experts share the steps (Wan 2.2's `boundary_ratio`)."""
    pipeline_config = pipeline_config or {}
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    vae = modules.get("vae")
    denoiser = next((modules[n] for n in PER_STEP if n in modules), None)
    vae_config = dict(getattr(vae, "config", None) or {})
    vae_blocks = vae_config.get("block_out_channels") or [0, 0, 0, 0]
    upcast = (
        vae_upcast and dtype == torch.float16 and bool(getattr(getattr(vae, "config", None), "force_upcast", False))
    )
    return PipelineProfile(
        model=model,
        dtype_bytes=dtype_bytes,
        vae_dtype_bytes=4 if upcast else dtype_bytes,
        components={
            n: profile_component(n, m, 4 if upcast and n == "vae" else dtype_bytes, upcast and n == "vae")
            for n, m in modules.items()
        },
        latent_channels=_config_value(vae, "latent_channels", _config_value(vae, "z_dim", 4)),  # z_dim: Wan-style VAEs
        vae_scale=vae_scale(vae_config) if vae_config else 8,
        vae_channels=vae_blocks[0] or vae_config.get("base_dim") or 128,
        patch=denoiser_patch(type(denoiser).__name__, dict(getattr(denoiser, "config", None) or {})),
        vae_temporal=vae_temporal(vae_config) if vae_config else 1,
        step_shares={
            n: share
            for n, share in expert_shares(
                pipeline_config.get("boundary_ratio"), pipeline_config.get("flow_shift")
            ).items()
            if n in modules
        },
        variants={
            n: {f: profile_component(n, m, dtype_bytes, fmt=f) for f in formats if n in spec(f).components}
            for n, m in modules.items()
            if any(n in spec(f).components for f in formats)
        },
    )


def profile_pipeline(pipe, model: str = "", vae_upcast: bool = False, formats: tuple[str, ...] = ()) -> PipelineProfile:
    """The run dtype is the denoiser's (the first component's could be a VAE a failed call left
    upcast, or a text encoder kept in float32)."""
    modules = {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    ordered = [modules[n] for n in PER_STEP if n in modules] + list(modules.values())
    dtype = next(
        (p.dtype for m in ordered for p in m.parameters() if p.is_floating_point() and p.dtype not in FLOAT8),
        torch.float32,
    )  # float8 is a storage format (`--quantize`), never the run dtype
    settings = {"boundary_ratio": getattr(getattr(pipe, "config", None), "boundary_ratio", None)}
    settings["flow_shift"] = getattr(getattr(getattr(pipe, "scheduler", None), "config", None), "flow_shift", None)
    return profile_modules(model or getattr(pipe, "name_or_path", ""), modules, dtype, vae_upcast, formats, settings)
