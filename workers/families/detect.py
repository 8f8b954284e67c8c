"""Which entry of the family table (workers/families/table.py) a model is, and which task a job
does with it. How an entry calls its pipeline is workers/pipeline/calls.py.

The driver asks for the defaults a job resolves (steps, guidance, dtype); the planner gets plain
numbers (whether guidance doubles the denoiser's batch). Any other text-to-image
`DiffusionPipeline` is the generic entry, called with only the arguments its `__call__` accepts.
"""

from __future__ import annotations

import json
from pathlib import Path

from fleetgen.errors import ConfigError
from fleetgen.workers.families.table import FAMILIES, GENERIC, TASKS, TEXT, Family, Task

__all__ = ["FAMILIES", "GENERIC", "Family", "Task", "choose_task", "detect", "identify", "read_family"]


ZIMAGE_SHIFTS = {3.0: "z-image-turbo", 6.0: "z-image"}  # FlowMatchEulerDiscreteScheduler `shift` as published


def _variant(cls: str, index: dict, transformer: dict | None, name: str, scheduler: dict | None) -> tuple[str, str]:
    """(entry, why) for a pipeline class that several checkpoints share; `name` is the hub id or the
    directory's path, lower-case (names are the only thing that tells some variants apart)."""
    embeds = None if transformer is None else transformer.get("guidance_embeds")
    if cls == "FluxPipeline":
        if embeds is False:
            return "flux-schnell", "its transformer has no guidance embedding (FLUX.1-schnell)"
        if embeds:
            return "flux", "its transformer has a guidance embedding (FLUX.1-dev)"
        return "flux", "guessed FLUX.1-dev (its transformer config was not read); `--family flux-schnell` for schnell"
    if cls == "Flux2KleinPipeline":
        if index.get("is_distilled"):
            return "flux2-klein", "model_index.json says is_distilled"
        return "flux2-klein-base", "model_index.json does not say is_distilled (the base model)"
    if cls == "HunyuanImagePipeline":
        if embeds:
            return "hunyuanimage-distilled", "its transformer has a guidance embedding (the distilled model)"
        return "hunyuanimage", "its transformer has no guidance embedding"
    if cls == "ZImagePipeline":
        if "turbo" in name:
            return "z-image-turbo", "its name says Turbo"
        shift = (scheduler or {}).get("shift")
        if shift in ZIMAGE_SHIFTS:  # the architecture is the same: the published schedulers differ
            return ZIMAGE_SHIFTS[shift], f"its scheduler's shift is {shift:g} ({ZIMAGE_SHIFTS[shift]} ships that)"
        if "z-image" in name or "z_image" in name:
            return "z-image", "its name says Z-Image and not Turbo (the base model)"
        return "z-image-turbo", (
            "guessed Turbo: neither its name nor its scheduler tells Turbo from the base model; "
            "`--family z-image` for the base model"
        )
    if cls == "WanPipeline":
        channels = None if transformer is None else transformer.get("in_channels")
        if channels == 48:
            return "wan-ti2v", "its transformer takes 48 latent channels (Wan 2.2 TI2V-5B's VAE)"
        if isinstance(index.get("transformer_2"), list) and index["transformer_2"][0]:
            return "wan2.2", "model_index.json has a second expert, transformer_2 (Wan 2.2 A14B)"
        return "wan", "one transformer of 16 latent channels (Wan 2.1)"
    if cls == "HiDreamImagePipeline":
        for word, entry in (("fast", "hidream-fast"), ("dev", "hidream-dev"), ("full", "hidream")):
            if word in name.rsplit("hidream", 1)[-1]:
                return entry, f"its name says {word.capitalize()}"
        return "hidream", (
            "guessed HiDream-I1-Full: Full, Dev and Fast share one architecture and its name does not "
            "say; `--family hidream-dev` or `--family hidream-fast` for the distilled ones"
        )
    raise AssertionError(cls)


_SHARED = (
    "FluxPipeline",
    "Flux2KleinPipeline",
    "HunyuanImagePipeline",
    "ZImagePipeline",
    "HiDreamImagePipeline",
    "WanPipeline",
)
READS_TRANSFORMER = (
    "FluxPipeline",
    "HunyuanImagePipeline",
    "WanPipeline",
)  # variants told apart by the transformer's config
READS_SCHEDULER = ("ZImagePipeline",)  # ... by the scheduler's


def identify(
    model_index: dict, transformer_config: dict | None = None, name: str = "", scheduler_config: dict | None = None
) -> tuple[Family, str]:
    """(the family of a pipeline, why) from its `model_index.json`, its transformer's config where
    that tells variants apart, and its hub id or path."""
    cls = model_index.get("_class_name", "")
    found = [f for f in FAMILIES.values() if cls in f.classes()]  # a task's class too (an inpainting checkpoint)
    if not found:
        return GENERIC, f"{cls or 'a pipeline without _class_name'} is not in the family table"
    base = found[0].pipelines[0]
    if base in _SHARED:
        entry, why = _variant(base, model_index, transformer_config, name.lower(), scheduler_config)
        return FAMILIES[entry], f"{cls}: {why}"
    return found[0], cls


def detect(model_index: dict, transformer_config: dict | None = None, name: str = "") -> Family:
    return identify(model_index, transformer_config, name)[0]


def identify_dir(model_dir: str | Path) -> tuple[Family, str]:
    """(the family of a local pipeline directory, with or without weights, why)."""
    root = Path(model_dir).expanduser()
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"`--model` {model_dir} has no readable model_index.json: {err}") from err
    configs = [root / "transformer" / "config.json", root / "scheduler" / "scheduler_config.json"]
    transformer, scheduler = (json.loads(p.read_text()) if p.exists() else None for p in configs)
    return identify(index, transformer, str(root.resolve()), scheduler)


def read_family(model_dir: str | Path) -> Family:
    return identify_dir(model_dir)[0]


def choose(family: Family, given: str | None, detected_class: str) -> tuple[Family, str | None]:
    """`--family NAME` over the detected family: (the family, why) or refused when NAME is unknown or
    is for another pipeline class."""
    if not given or given == family.name:
        return family, None
    if given not in FAMILIES:
        raise ConfigError(f"`--family` must be one of {', '.join(FAMILIES)}; got `{given}`.")
    chosen = FAMILIES[given]
    if chosen.pipelines and detected_class not in chosen.classes():
        raise ConfigError(
            f"`--family {given}` is for {', '.join(chosen.pipelines)}; this model is a "
            f"{detected_class or 'pipeline without _class_name'} ({family.name})."
        )
    return chosen, f"`--family {given}` (detected: {family.name})"


def choose_task(family: Family, given: str | None, detected_class: str) -> tuple[Task, str]:
    """(the task a job does, why): the one the directory's pipeline class does, or `--task NAME`
    where the family's weights serve it too (a worker turns the pipeline into that task's class
    with diffusers' `from_pipe`)."""
    detected = family.task_of(detected_class) or (family.tasks[0] if family.tasks else None)
    if not given or (detected is not None and given == detected.name):
        if detected is None:
            return Task(TEXT, detected_class), f"{detected_class or 'the pipeline'} is called as it is"
        return detected, f"{detected_class} does {detected.name}"
    if given not in TASKS:
        raise ConfigError(f"`--task` must be one of {', '.join(TASKS)}; got `{given}`.")
    task = family.task(given)
    if task is None:
        served = ", ".join(t.name for t in family.tasks) or "text-to-image only, as its pipeline is called"
        raise ConfigError(f"`--task {given}`: {family.name} ({detected_class}) does {served}; not {given}.")
    return task, f"`--task {given}` ({task.pipeline}, from {detected_class} with from_pipe)"
