"""Counting and applying storage formats (the table is offload/weight_formats.py).

The profile counts each component in every format it could have, from the live or `meta` modules
(`stored_sizes`); `quantize` applies after-load formats in place; `load_config` and `load_gguf` give
`from_pretrained` what at-load formats need. Layers no format stores, whatever the format:
diffusers' DEFAULT_SKIP_MODULES_PATTERN (norms, positional and patch embeddings, top-level
`proj_in`/`proj_out`) plus the model's own `_skip_layerwise_casting_patterns` and
`_keep_in_fp32_modules` — the precision-sensitive layers, as `ModelMixin.enable_layerwise_casting`
skips them. They stay at the run dtype and are counted so.
"""

from __future__ import annotations

import re

import torch

from fleetgen.errors import ConfigError, OffloadError
from fleetgen.offload.weight_formats import LAYERS, check_components, gguf_path, spec

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def layer_types(names: tuple[str, ...]) -> tuple[type, ...]:
    """The `torch.nn` layer types the formats table names."""
    return tuple(getattr(torch.nn, name) for name in names)


LEAF_TYPES = layer_types(LAYERS)  # diffusers' leaf level makes one group per such layer


def skip_patterns(module: torch.nn.Module) -> tuple[str, ...]:
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    own = tuple(getattr(module, "_skip_layerwise_casting_patterns", None) or ())
    keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    return tuple(DEFAULT_SKIP_MODULES_PATTERN) + own + keep


def stored_layers(module: torch.nn.Module, name: str) -> dict[str, torch.nn.Module]:
    """{qualified name: layer} of the layers format `name` stores, walked as diffusers'
    `_apply_layerwise_casting` walks: a module whose name matches a skip pattern is skipped whole."""
    patterns, layers = skip_patterns(module), layer_types(spec(name).layers)
    out: dict[str, torch.nn.Module] = {}

    def walk(m: torch.nn.Module, prefix: str) -> None:
        if prefix and any(re.search(p, prefix) for p in patterns):
            return
        if isinstance(m, layers):
            out[prefix] = m
            return
        for child, sub in m.named_children():
            walk(sub, f"{prefix}.{child}" if prefix else child)

    walk(module, "")
    return out


def stored_sizes(module: torch.nn.Module, name: str) -> dict[int, int]:
    """{id(tensor): bytes} of the tensors format `name` would store, as it would store them; the
    profile counts every other tensor at the run dtype. Predicted from shapes (works on `meta`);
    the test measures the live modules after `quantize` against it."""
    f = spec(name)
    if f.name == "gguf":
        return _gguf_sizes(module, gguf_path(name))
    sizes: dict[int, int] = {}
    for layer in stored_layers(module, name).values():
        tensors = [layer.weight] if f.weight_only else [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
        for t in tensors:
            if t is None or not t.is_floating_point():
                continue
            rows = t.shape[0] if t.dim() > 1 else 1
            sizes[id(t)] = int(-(-t.numel() * f.weight_bytes // 1)) + rows * f.row_bytes
    return sizes


def _gguf_sizes(module: torch.nn.Module, path: str) -> dict[int, int]:
    """{id(tensor): bytes} as the GGUF file stores the module's tensors (its header; no data read).
    Refused when the file's keys are not the module's (another model, or keys in the original
    checkpoint's layout, which fleetgen does not convert)."""
    import gguf

    stored = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    named = dict(module.named_parameters())
    missing = sorted(set(named) - set(stored))
    if missing:
        raise ConfigError(
            f"{path} lacks {len(missing)} of {type(module).__name__}'s {len(named)} weights (e.g. `{missing[0]}`): "
            "a GGUF file for this model with its diffusers keys is needed."
        )
    return {id(p): stored[n] for n, p in named.items()}


def held(modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """{component: format} of the components whose live tensors already hold one (a pipeline given
    quantized, or loaded with a quantization config): float8 storage is fp8, torchao tensors int8,
    bitsandbytes parameters nf4 or bnb-int8."""
    out = {}
    for name, module in modules.items():
        kinds = {type(p).__name__ for p in module.parameters()}
        if any(p.dtype in FLOAT8 for p in module.parameters()):
            out[name] = "fp8"
        elif "Params4bit" in kinds:
            out[name] = "nf4"
        elif "Int8Params" in kinds:
            out[name] = "bnb-int8"
        elif "GGUFParameter" in kinds:
            out[name] = "gguf"
        elif any("Int8" in k and "Tensor" in k for k in kinds):  # torchao's Int8Tensor
            out[name] = "int8"
    return out


def quantize(modules: dict[str, torch.nn.Module], mapping: dict[str, str], compute_dtype: torch.dtype) -> dict:
    """Apply each component's after-load format in place; returns {component: format} as applied.
    At-load formats (bitsandbytes) come through `load_config`, never here."""
    check_components(mapping, list(modules), "the pipeline")
    for component, name in mapping.items():
        module = modules[component]
        if spec(name).at_load:
            raise OffloadError(
                f"`{component}` {name}: applied when the weights load (bitsandbytes), not to a loaded pipeline."
            )
        if name == "fp8":
            from diffusers.hooks import apply_layerwise_casting

            apply_layerwise_casting(
                module,
                storage_dtype=torch.float8_e4m3fn,
                compute_dtype=compute_dtype,
                skip_modules_pattern=skip_patterns(module),
            )
        elif name == "int8":
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            targets = set(stored_layers(module, name))
            quantize_(module, Int8WeightOnlyConfig(), filter_fn=lambda _m, fqn, t=targets: fqn in t)
    return dict(mapping)


def load_gguf(model: str, component: str, cls_name: str, value: str, dtype: torch.dtype, revision=None):
    """`component` of `model` (a directory or hub id, for its config) with the weights of the GGUF
    file `value` names, as diffusers' GGUF loader makes it: Linear weights stay quantized and are
    dequantized to `dtype` per matmul."""
    import diffusers
    from diffusers import GGUFQuantizationConfig

    cls = getattr(diffusers, cls_name)
    return cls.from_single_file(
        gguf_path(value),
        quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
        config=model,
        subfolder=component,
        torch_dtype=dtype,
        **({"revision": revision} if revision else {}),
    )


def load_config(mapping: dict[str, str], compute_dtype: torch.dtype):
    """diffusers' PipelineQuantizationConfig for the mapping's bitsandbytes formats; None when it has none."""
    at_load = {c: n for c, n in mapping.items() if n in ("nf4", "bnb-int8")}
    if not at_load:
        return None
    from diffusers import PipelineQuantizationConfig

    backends = {n: ("bitsandbytes_4bit" if n == "nf4" else "bitsandbytes_8bit") for n in set(at_load.values())}
    if len(backends) > 1:
        raise ConfigError("`--quantize`: nf4 and bnb-int8 in one job are not supported; choose one.")
    ((name, backend),) = backends.items()
    kwargs = (
        {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": compute_dtype}
        if name == "nf4"
        else {"load_in_8bit": True}
    )
    return PipelineQuantizationConfig(quant_backend=backend, quant_kwargs=kwargs, components_to_quantize=list(at_load))
