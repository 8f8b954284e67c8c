"""Storage formats for a pipeline's components (`--quantize`): the one table the planner, `apply`'s
checks and the job's validation read, and the setting's grammar.

`--quantize none` keeps every component at the run dtype; `--quantize transformer=fp8,...` fixes a
format per component (the same on every worker); `--quantize auto` lets each worker's planner choose
per component where that is predicted faster or is the only fit. A format changes pixels: the
setting is job-level, in the job's fingerprint, and every image records the formats it was made with.

Per format (FORMATS): what it stores and how many bytes that takes, which components it may serve,
when it is applied (after `from_pretrained`, in place; or at load, so a worker never holds the run
dtype it cannot), what it needs (CUDA, a package), what it costs in compute (dequantization, a
constant with its source, to be calibrated on a GPU) and which offload placements it refuses, with
the upstream reason. Counting and applying them: offload/quantize.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetgen.errors import ConfigError

DENOISERS = ("unet", "transformer", "transformer_2", "prior", "decoder")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
# Layer types by their names in `torch.nn` (this table imports no torch: the driver's commands that only
# read settings stay light); offload/quantize.py resolves them.
_LINEAR = ("Linear",)
LAYERS = (  # diffusers' _GO_LC_SUPPORTED_PYTORCH_LAYERS: group offloading's leaves, what fp8 stores
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Linear",
    "Embedding",
)
# Published end-to-end times, FLUX.1-dev, 1024², 50 steps, one H100, as the quantization issue
# quotes them (diffusers' blog "Exploring Quantization Backends in Diffusers", May 2025): bf16 12 s,
# fp8 layerwise 13 s, torchao int8 weight-only 15 s, bitsandbytes NF4 12 s, GGUF Q8_0 15 s. Not in
# the issue: bitsandbytes 8-bit, 27 s as recalled from the blog's table, unverified here. Their
# ratios to bf16 are each format's compute cost; constants until a GPU check calibrates them.
BF16_SECONDS = 12.0


@dataclass(frozen=True)
class Format:
    name: str
    about: str
    layers: tuple[str, ...]  # the layer types (names in torch.nn) whose tensors it stores
    weight_only: bool  # only the layer's weight (biases stay at the run dtype), else every tensor
    weight_bytes: float  # bytes per stored element
    row_bytes: int  # bytes per output row (scales, zero points)
    components: tuple[str, ...]  # the components it may serve
    at_load: bool  # applied by from_pretrained's quantization_config (planned before loading)
    cuda: bool  # needs a CUDA device
    package: str  # import name it needs ("" for torch alone)
    seconds: float  # published FLUX.1-dev time (see BF16_SECONDS): compute costs seconds / 12
    refuses: tuple[tuple[str, str], ...] = ()  # (placement kind, reason): stream | disk | offload

    @property
    def slowdown(self) -> float:
        return self.seconds / BF16_SECONDS


_BNB_OFFLOAD = (
    "offload",
    "bitsandbytes weights under diffusers' group offloading are not verified here (group offloading "
    "swaps `param.data`; Params4bit/Int8Params keep their quantization state beside it), so they stay resident",
)
FORMATS = {
    "fp8": Format(
        "fp8",
        "float8 (e4m3) storage, cast to the run dtype layer by layer as it runs (diffusers' layerwise casting)",
        LAYERS,
        False,
        1.0,
        0,
        # pipelines read the other components' dtype for what they feed them (SD makes its latents in
        # the text encoder's dtype): float8 there fails (`normal_kernel_cpu` not implemented for Float8)
        DENOISERS,
        False,
        False,
        "",
        13.0,
    ),
    "int8": Format(
        "int8",
        "int8 weights with a scale per row, dequantized per matmul (torchao Int8WeightOnlyConfig)",
        _LINEAR,
        True,
        1.0,
        5,  # float32 scale + int8 zero point per row (torchao Int8Tensor, measured)
        DENOISERS + TEXT_ENCODERS,  # a torchao tensor reports the run dtype: pipelines feed it as before
        False,
        False,
        "torchao",
        15.0,
        (
            (
                "stream",
                "torchao tensors with CUDA streams stay on the CPU or cannot be pinned (diffusers #13281, #14433)",
            ),
            (
                "disk",
                "diffusers refuses disk offload of torchao tensors: safetensors cannot serialize them "
                "(hooks/group_offloading.py, _check_disk_offload_torchao)",
            ),
        ),
    ),
    "nf4": Format(
        "nf4",
        "4-bit NormalFloat weights with a float32 absmax per 64 (bitsandbytes, applied at load)",
        _LINEAR,
        True,
        0.5 + 4 / 64,
        0,
        DENOISERS + TEXT_ENCODERS,
        True,
        True,
        "bitsandbytes",
        12.0,
        (_BNB_OFFLOAD,),
    ),
    "bnb-int8": Format(
        "bnb-int8",
        "LLM.int8 weights with a float32 scale per row (bitsandbytes, applied at load)",
        _LINEAR,
        True,
        1.0,
        4,
        DENOISERS + TEXT_ENCODERS,
        True,
        True,
        "bitsandbytes",
        27.0,
        (_BNB_OFFLOAD,),
    ),
    "gguf": Format(
        "gguf",
        "the tensors of a GGUF file you supply (`gguf:PATH`: e.g. Q8_0, Q4_K), dequantized per matmul "
        "(diffusers' GGUF loader, `from_single_file`); its keys the model's own (a diffusers-format state dict)",
        _LINEAR,
        True,
        0.0,  # the file says: bytes per tensor from its header
        0,
        DENOISERS,
        True,
        False,
        "gguf",
        15.0,  # GGUF Q8_0
        (
            (
                "offload",
                "GGUF parameters under diffusers' group offloading are not verified on a GPU here, so they stay resident",
            ),
        ),
    ),
}
CHOOSABLE = tuple(n for n in FORMATS if n != "gguf")  # what `auto` may choose: a GGUF file must be named


def spec(value: str) -> Format:
    """The table's entry for a format as a mapping names it (`fp8`, `gguf:PATH#sha256=...`)."""
    return FORMATS[value.split(":", 1)[0]]


def gguf_path(value: str) -> str:
    """The file of a `gguf:PATH[#sha256=HEX]` format."""
    return value.split(":", 1)[1].split("#", 1)[0]


def _sha256(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


_DIGESTS: dict[tuple, str] = {}


def pinned_gguf(value: str) -> str:
    """`gguf:PATH` as the fingerprint holds it: the absolute path and the file's sha256 (a path is
    not content: the same name with other bytes is another job). Hashed once per file version."""
    from pathlib import Path

    path = Path(gguf_path(value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"`--quantize ...={value}`: no file at {path} (a GGUF file every worker can read).")
    path = path.resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = _sha256(str(path))
    given = value.split("#sha256=", 1)[1] if "#sha256=" in value else None
    if given and given != _DIGESTS[key]:
        raise ConfigError(f"`--quantize ...=gguf:{path}`: the file's sha256 is {_DIGESTS[key]}, not {given}.")
    return f"gguf:{path}#sha256={_DIGESTS[key]}"


NONE = "none"  # the run dtype


@dataclass(frozen=True)
class QuantizeSpec:
    """`--quantize` parsed: none, `auto` (each worker's planner may choose), or a format per component."""

    auto: bool = False
    pairs: tuple[tuple[str, str], ...] = ()  # (component, format), sorted by component

    @property
    def mapping(self) -> dict[str, str]:
        """{component: format} fixed by the job ({} for none and auto)."""
        return dict(self.pairs)

    @property
    def label(self) -> str:
        """The setting as the fingerprint and every record hold it: `none`, `auto`, or the sorted mapping."""
        return "auto" if self.auto else ",".join(f"{c}={f}" for c, f in self.pairs) or NONE

    def pinned(self) -> QuantizeSpec:
        """With every GGUF file named by its absolute path and sha256 (a path is not content), as the
        job's fingerprint holds it; hashed once per file version."""
        return QuantizeSpec(
            self.auto, tuple((c, pinned_gguf(f) if f.startswith("gguf:") else f) for c, f in self.pairs)
        )


def parse_quantize(text: str | QuantizeSpec | None) -> QuantizeSpec:
    """`none` (or empty), `auto`, or `transformer=fp8,text_encoder=int8`; a record is returned as it is."""
    if isinstance(text, QuantizeSpec):
        return text
    text = (text or NONE).strip()
    if text in (NONE, "auto"):
        return QuantizeSpec(auto=text == "auto")
    mapping = {}
    for part in text.split(","):
        component, sep, name = (s.strip() for s in part.partition("="))
        if not sep or not component or not name:
            raise ConfigError(
                f"`--quantize` takes none, auto or COMPONENT=FORMAT[,...]; got `{part.strip()}` in `{text}`."
            )
        kind = name.split(":", 1)[0]
        if kind not in FORMATS:
            raise ConfigError(f"`--quantize {component}={name}`: the formats are {', '.join(FORMATS)}.")
        if (kind == "gguf") != (":" in name) or name == "gguf:":
            raise ConfigError(
                f"`--quantize {component}={name}`: "
                + ("gguf takes its file: `gguf:PATH`." if kind == "gguf" else f"{kind} takes no argument.")
            )
        if component in mapping:
            raise ConfigError(f"`--quantize` names `{component}` twice.")
        mapping[component] = name
    return QuantizeSpec(pairs=tuple(sorted(mapping.items())))


def describe(formats: dict[str, str]) -> str:
    """{component: format} as images record it: `transformer=fp8`, or `none`."""
    return ",".join(f"{c}={f}" for c, f in sorted(formats.items()) if f != NONE) or NONE


def check_components(mapping: dict[str, str], components: list[str], model: str) -> None:
    missing = sorted(set(mapping) - set(components))
    if missing:
        raise ConfigError(
            f"`--quantize`: {model} has no component {', '.join(f'`{m}`' for m in missing)} "
            f"(its model components: {', '.join(components)})."
        )
    for component, value in mapping.items():
        f = spec(value)
        if component not in f.components:
            why = (
                "pipelines read that component's dtype for what they feed it, and float8 there fails"
                if f.name == "fp8"
                else "a GGUF file holds a denoiser's weights"
                if f.name == "gguf"
                else "the VAE and other components stay at the run dtype"
            )
            raise ConfigError(
                f"`--quantize {component}={f.name}`: {f.name} serves {', '.join(f.components)} only; {why}."
            )


def unavailable(name: str, cuda: bool) -> str | None:
    """Why this machine cannot run format `name` (a device or a package it lacks); None when it can."""
    import importlib.util

    f = spec(name)
    name = f.name
    if f.cuda and not cuda:
        return f"{name} needs a CUDA device ({f.package}); this worker has none"
    if f.package and importlib.util.find_spec(f.package) is None:
        return f"{name} needs the `{f.package}` package (pip install 'fleetgen[quantize]')"
    return None


def runnable(cuda: bool, at_load: bool = False) -> tuple[str, ...]:
    """The formats this machine can run; `at_load=False`: those applied after loading only."""
    return tuple(n for n in CHOOSABLE if (at_load or not FORMATS[n].at_load) and unavailable(n, cuda) is None)


def refusal(name: str, mode: str, stream: bool, disk: bool) -> str | None:
    """Why format `name` cannot take this placement (mode resident|block|leaf); None when it can."""
    refuses = dict(spec(name).refuses) if name != NONE else {}
    if mode != "resident" and "offload" in refuses:
        return refuses["offload"]
    if stream and "stream" in refuses:
        return refuses["stream"]
    if disk and "disk" in refuses:
        return refuses["disk"]
    return None


def allowed(quantize: QuantizeSpec, component: str, formats: tuple[str, ...], fixed: dict[str, str] | None = None):
    """The formats the planner may give `component`: the mapping's (or the run dtype) for a mapping
    or `none`; under `auto`, the run dtype and each of `formats` (what the device runs) that serves
    it. `fixed`: formats already applied to live modules, which no plan can take back."""
    if fixed and component in fixed:
        return (fixed[component],)
    if not quantize.auto:
        return (quantize.mapping.get(component, NONE),)
    return (NONE, *(f for f in formats if component in spec(f).components))
