"""Storage formats for a pipeline's components (`--quantize COMPONENT=FORMAT,...`), applied before
the pipeline is profiled and planned, so the plan counts the bytes each component really holds.

A format changes pixels: the mapping is job-level, in the job's fingerprint, the same on every
worker. This first format is diffusers' layerwise casting: weights stored in float8 and cast to the
run dtype one layer at a time as it runs (`diffusers.hooks.apply_layerwise_casting`, which works on
any torch module, text encoders included). Layers it keeps at the run dtype — norms, positional and
patch embeddings, `proj_in`/`proj_out` (its DEFAULT_SKIP_MODULES_PATTERN) — are counted at the run
dtype by the profile, which reads the live modules' dtypes. It combines with every offload mode
(the offloaded groups move in float8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetgen.errors import ConfigError


@dataclass(frozen=True)
class Format:
    name: str
    storage: torch.dtype
    about: str


FORMATS = {
    "fp8": Format(
        "fp8",
        torch.float8_e4m3fn,
        "float8 (e4m3) storage, computed in the run dtype layer by layer (diffusers' layerwise casting)",
    )
}
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def parse_quantize(text: str | None) -> dict[str, str]:
    """`none` (or empty) -> {}; `transformer=fp8,text_encoder=fp8` -> {component: format}."""
    text = (text or "none").strip()
    if text == "none":
        return {}
    if text == "auto":
        raise ConfigError(
            "`--quantize auto` (the planner choosing formats per worker) is not built yet: name the "
            f"components, e.g. `--quantize transformer=fp8` (formats: {', '.join(FORMATS)})."
        )
    mapping = {}
    for part in text.split(","):
        component, sep, name = (s.strip() for s in part.partition("="))
        if not sep or not component or not name:
            raise ConfigError(f"`--quantize` takes COMPONENT=FORMAT[,...] or none; got `{part.strip()}` in `{text}`.")
        if name not in FORMATS:
            raise ConfigError(f"`--quantize {component}={name}`: the formats are {', '.join(FORMATS)}.")
        if component in mapping:
            raise ConfigError(f"`--quantize` names `{component}` twice.")
        mapping[component] = name
    return mapping


def normalized(text: str | None) -> str:
    """The mapping as the fingerprint and every record hold it: sorted, or `none`."""
    mapping = parse_quantize(text)
    return ",".join(f"{c}={f}" for c, f in sorted(mapping.items())) or "none"


# What each format may be applied to. Layerwise float8 only suits the denoiser: pipelines read the
# other components' dtype for what they feed them (SD makes its latents in the text encoder's dtype,
# decodes in the VAE's), and float8 there fails (`normal_kernel_cpu` not implemented for Float8).
DENOISERS = ("unet", "transformer", "transformer_2", "prior", "decoder")
ALLOWED = {"fp8": DENOISERS}


def check_components(mapping: dict[str, str], components: list[str], model: str) -> None:
    missing = sorted(set(mapping) - set(components))
    if missing:
        raise ConfigError(
            f"`--quantize`: {model} has no component {', '.join(f'`{m}`' for m in missing)} "
            f"(its model components: {', '.join(components)})."
        )
    for component, name in mapping.items():
        if component not in ALLOWED[name]:
            raise ConfigError(
                f"`--quantize {component}={name}`: {name} applies to the denoiser only ({', '.join(ALLOWED[name])}); "
                f"pipelines read the {component}'s dtype for what they feed it, and float8 there fails."
            )


def quantize(modules: dict[str, torch.nn.Module], mapping: dict[str, str], compute_dtype: torch.dtype) -> dict:
    """Apply each component's format in place; returns {component: format} as applied."""
    from diffusers.hooks import apply_layerwise_casting

    check_components(mapping, list(modules), "the pipeline")
    for component, name in mapping.items():
        apply_layerwise_casting(modules[component], storage_dtype=FORMATS[name].storage, compute_dtype=compute_dtype)
    return dict(mapping)
