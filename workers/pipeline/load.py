"""Loading a diffusers pipeline and resolving the device it runs on."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from fleetgen.errors import ConfigError, FleetgenError, one_line
from fleetgen.latents import denoiser_patch
from fleetgen.workers.families.model_dir import is_hub_id
from fleetgen.workers.spec import DTYPE_NAMES

BACKEND_HINT = ' (docs/models.md: "Models that need more packages")'
DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float16, torch.bfloat16), strict=True))  # --dtype names


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"`--device` is `{device}` but this machine has no CUDA device. Use `--device cpu`.")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, family_dtype: str = "float16") -> torch.dtype:
    """`auto`: the model family's dtype on CUDA (bfloat16 for Flux, SD3, Sana), float32 on CPU."""
    if dtype == "auto":
        return DTYPES[family_dtype] if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"`--dtype` must be one of auto, {', '.join(DTYPES)}; got `{dtype}`.")
    return DTYPES[dtype]


def describe_device(device: torch.device) -> dict:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "total_bytes": total, "free_bytes": free}
    return {"type": "cpu", "name": f"cpu ({os.cpu_count()} cores)", "total_bytes": None, "free_bytes": None}


class _Once(logging.Filter):
    """The pipeline libraries' own warnings (diffusers', transformers'): each distinct one once per
    worker and job, tagged with the worker, instead of once per call (a process kept warm between
    runs, cluster/warm.py, says them again in the next job's log)."""

    def __init__(self) -> None:
        super().__init__()
        self.tag, self.seen = "worker", set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        decided = getattr(record, "fleetgen_once", None)  # a record passes every handler's filters
        if decided is not None:
            return decided
        text = record.getMessage()
        record.fleetgen_once = text not in self.seen
        if record.fleetgen_once:
            self.seen.add(text)
            record.msg, record.args = f"[fleetgen] {self.tag}: {record.name.split('.')[0]} says: {text}", ()
        return record.fleetgen_once


_ONCE = _Once()


def warnings_once(tag: str) -> None:
    """Route the libraries' warnings through `_ONCE` for worker `tag` (installed once per process;
    what it has seen forgotten at each load: a new job's)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    _ONCE.tag, _ONCE.seen = tag, set()
    for library in (diffusers_logging, transformers_logging):
        for handler in library._get_library_root_logger().handlers:
            if _ONCE not in handler.filters:
                handler.addFilter(_ONCE)


def load_pipeline(
    model: str,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    revision: str | None = None,
    variant: str | None = None,
    worker: str = "worker",
    quantization_config=None,
    gguf: dict[str, str] | None = None,
    components: dict | None = None,
):
    """`DiffusionPipeline.from_pretrained` for a local directory or a hub id (at `revision`, through
    the node's cache, downloaded once per node); progress bars off. `quantization_config`: formats
    applied as the weights load (offload/quantize.py `load_config`); `gguf`: {component: `gguf:PATH`},
    components whose weights come from a GGUF file instead of the model's own; `components`: modules
    made already (from the node's shared copy, workers/pipeline/host_copy.py), not loaded again."""
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    warnings_once(worker)
    source = fetch_snapshot(model, revision, variant, worker) if is_hub_id(model) else model
    try:
        extra = {"quantization_config": quantization_config} if quantization_config is not None else {}
        extra.update(components or {})
        if gguf:
            from fleetgen.offload.quantize import load_gguf

            index = json.loads((Path(source) / "model_index.json").read_text())
            for component, value in gguf.items():
                extra[component] = load_gguf(source, component, index[component][1], value, dtype)
        pipe = DiffusionPipeline.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code, variant=variant, **extra
        )
    except ImportError as err:  # a component whose class needs a package this worker lacks
        raise FleetgenError(f"Could not load the pipeline `{model}`: {one_line(err)}{BACKEND_HINT}") from err
    except (OSError, ValueError, AttributeError) as err:  # AttributeError: a class this diffusers lacks
        raise FleetgenError(f"Could not load the pipeline `{model}`: {one_line(err)}") from err
    pipe.set_progress_bar_config(disable=True)
    return pipe


def fetch_snapshot(model: str, revision: str | None, variant: str | None, worker: str) -> str:
    """The local snapshot of a hub model at `revision`. One download per node: the first worker on a
    node downloads into the node's hub cache holding a file lock; the others wait for it and then
    find every file cached. Progress goes to the worker's log (and so the driver's)."""
    from diffusers import DiffusionPipeline
    from filelock import FileLock, Timeout
    from huggingface_hub import constants

    locks = Path(constants.HF_HUB_CACHE) / ".fleetgen-locks"
    locks.mkdir(parents=True, exist_ok=True)
    what = f"{model}@{(revision or 'main')[:12]}" + (f" ({variant})" if variant else "")
    lock = FileLock(str(locks / f"{model.replace('/', '--')}--{revision or 'main'}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"[fleetgen] {worker}: waiting for another worker on this node to download {what}", flush=True)
        lock.acquire()
    try:
        started = time.perf_counter()
        print(f"[fleetgen] {worker}: fetching {what} into {constants.HF_HUB_CACHE}", flush=True)
        path = DiffusionPipeline.download(model, revision=revision, variant=variant)
        print(f"[fleetgen] {worker}: {what} ready ({time.perf_counter() - started:.1f} s)", flush=True)
        return str(path)
    except Exception as err:  # noqa: BLE001 - whatever the hub said, name the model
        raise FleetgenError(f"Could not download `{model}` at {revision or 'main'}: {one_line(err)}") from err
    finally:
        lock.release()


def pipe_size_multiple(pipe, floor: int = 8) -> int:
    """What image sizes must be a multiple of for a loaded pipeline (as `size_multiple` for a
    directory): the pipeline's own rule (`floor`, its family's) and the VAE's scale factor times the
    denoiser's patch."""
    scale = int(getattr(pipe, "vae_scale_factor", None) or 8)
    denoiser = getattr(pipe, "transformer", None)
    patch = 1 if denoiser is None else denoiser_patch(type(denoiser).__name__, dict(denoiser.config))
    return math.lcm(scale * patch, floor)


def load_adapters(pipe, sources: tuple[tuple[str, str], ...], worker: str = "worker") -> dict[str, str]:
    """Load every LoRA the job can use, once, before the pipeline is planned and offloaded (so their
    bytes are planned for, and group offloading covers them). `sources`: (as the job or a row names
    it, where to load it from). Returns {as named: adapter name}."""
    if not sources:
        return {}
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError("`--lora` needs peft, which diffusers loads adapters with: pip install 'fleetgen[lora]'.")
    if not hasattr(pipe, "load_lora_weights"):
        raise ConfigError(
            f"`--lora`: {type(pipe).__name__} cannot load LoRA adapters (diffusers has no LoRA loader for it)."
        )
    names = {}
    for i, (source, location) in enumerate(sources):
        name = f"lora{i}"
        try:
            pipe.load_lora_weights(location, adapter_name=name)
        except Exception as err:  # noqa: BLE001 - a missing file, a hub error, a LoRA for another model
            raise FleetgenError(f"Could not load LoRA `{source}`: {one_line(err)}") from err
        names[source] = name
    print(f"[fleetgen] {worker}: loaded {len(names)} LoRA adapter(s)", flush=True)
    activate_adapters(pipe, names, ())
    return names


def activate_adapters(pipe, names: dict[str, str], adapters) -> None:
    """Make `adapters` (sources with scales) the active LoRA set; none: LoRA layers off. Switching
    only sets scales in the adapter layers: no weights move, offloading hooks stay as they are."""
    if not names:
        return
    if not adapters:
        pipe.disable_lora()
        return
    pipe.enable_lora()
    pipe.set_adapters([names[a.source] for a in adapters], adapter_weights=[a.scale for a in adapters])
