"""Config-only pipeline directories for real architectures, planned on the `meta` device.

Each folder holds `model_index.json` and one `config.json` per torch component (no weights), as in
the published checkpoints. `fleetgen plan --model sdxl` reads them; any local pipeline directory
(with or without weights) is read the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from fleetgen.errors import OffloadError

if TYPE_CHECKING:  # torch loads when a pipeline is built, not when the names are listed
    import torch

HERE = Path(__file__).parent
NAMES = sorted(p.name for p in HERE.iterdir() if (p / "model_index.json").exists())


def resolve(model: str) -> Path:
    """A shipped architecture name, or a local directory with `model_index.json`."""
    if model in NAMES:
        return HERE / model
    path = Path(model).expanduser()
    if (path / "model_index.json").exists():
        return path
    raise OffloadError(
        f"`--model` `{model}` is neither a shipped architecture ({', '.join(NAMES)}) nor a directory with "
        "model_index.json. For a hub model, download its configs first (e.g. `huggingface-cli download "
        "REPO --include '*.json'`)."
    )


def _component_class(library: str, name: str):
    """The class model_index.json names. A library other than diffusers and transformers is a
    diffusers pipeline module (LTX-2's connectors and vocoder: `["ltx2", "LTX2Vocoder"]`), as
    diffusers' own loader reads it."""
    import importlib

    try:
        module = importlib.import_module(library if library in LIBRARIES else f"diffusers.pipelines.{library}")
    except ImportError:
        return None
    cls = getattr(module, name, None)
    import torch

    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


LIBRARIES = ("diffusers", "transformers")


def is_diffusers(library: str) -> bool:
    """Built from its config with `from_config` (diffusers models, pipeline modules included)."""
    return library != "transformers"


def torch_components(root: Path) -> dict[str, tuple[str, type]]:
    """{component: (library, class)} of a pipeline directory's torch modules (diffusers or transformers models
    with a config.json), read from model_index.json without building any."""
    index = json.loads((root / "model_index.json").read_text())
    out = {}
    for comp, spec in index.items():
        if comp.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        cls = _component_class(*spec)
        if cls is not None and (root / comp / "config.json").exists():
            out[comp] = (spec[0], cls)
    return out


def pipeline_settings(model: str) -> dict:
    """The pipeline's own plain settings (model_index.json: Wan 2.2's `boundary_ratio`) and its
    scheduler's `flow_shift`, where the directory has them: what profile_modules plans two experts by."""
    root = resolve(model)
    settings = {k: v for k, v in json.loads((root / "model_index.json").read_text()).items() if not k.startswith("_")}
    scheduler = root / "scheduler" / "scheduler_config.json"
    if scheduler.exists():
        settings["flow_shift"] = json.loads(scheduler.read_text()).get("flow_shift")
    return {k: v for k, v in settings.items() if not isinstance(v, list)}


def build_on_meta(model: str) -> dict[str, torch.nn.Module]:
    """The pipeline's torch components built from their configs on the `meta` device: the real
    module structure and parameter shapes, no memory, no weights read."""
    import torch

    root = resolve(model)
    modules = {}
    for comp, (library, cls) in torch_components(root).items():
        config = json.loads((root / comp / "config.json").read_text())
        with torch.device("meta"):
            if is_diffusers(library):
                modules[comp] = cls.from_config(config)
            else:  # the model class knows its config class; a saved config.json also names its model_type
                modules[comp] = cls(cls.config_class.from_dict(config))
    if not modules:
        raise OffloadError(f"{root} lists no diffusers or transformers model components with a config.json.")
    return modules
