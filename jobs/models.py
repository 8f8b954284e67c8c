"""Which pipeline family a job's model is, and the defaults it resolves to.

Resolved once, on the driver, before anything is written: the family and every default it
resolved are logged and recorded in `job.json`; options given on the command line or in the
config file win.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetgen.errors import ConfigError, one_line
from fleetgen.jobs.config import JobConfig
from fleetgen.jobs.hub import pin_revision, pin_scorers
from fleetgen.offload.architectures import torch_components
from fleetgen.offload.weight_formats import check_components as check_quantized
from fleetgen.workers.families.detect import (
    GENERIC,
    READS_SCHEDULER,
    READS_TRANSFORMER,
    Family,
    Task,
    choose,
    choose_task,
    identify,
    identify_dir,
)
from fleetgen.workers.families.model_dir import is_hub_id
from fleetgen.workers.rows.batches import no_steps, parse_lora
from fleetgen.workers.rows.shard import Columns


def model_family(model: str, revision: str | None = None) -> tuple[Family, str, str]:
    """(the family of a local pipeline directory or a hub model, why, its pipeline class), from its
    model_index.json (and its transformer's config where that tells variants apart)."""
    if not is_hub_id(model):
        family, why = identify_dir(model)
        return (
            family,
            why,
            json.loads((Path(model).expanduser() / "model_index.json").read_text()).get("_class_name", ""),
        )
    try:
        from huggingface_hub import hf_hub_download

        index = json.loads(Path(hf_hub_download(model, "model_index.json", revision=revision)).read_text())
        transformer = scheduler = None
        if index.get("_class_name") in READS_TRANSFORMER:  # e.g. FLUX.1 dev or schnell: its guidance embedding says
            transformer = json.loads(
                Path(hf_hub_download(model, "transformer/config.json", revision=revision)).read_text()
            )
        if index.get("_class_name") in READS_SCHEDULER:  # Z-Image or Turbo: the published shift says
            scheduler = json.loads(
                Path(hf_hub_download(model, "scheduler/scheduler_config.json", revision=revision)).read_text()
            )
    except Exception as err:  # noqa: BLE001 - any hub failure is the same to the user: say which and why
        raise ConfigError(
            f"Could not read model_index.json of `--model` `{model}` from the hub: "
            f"{one_line(err)}. Check the id, "
            "the network, and HF_TOKEN for gated models, or pass a local pipeline directory."
        ) from err
    family, why = identify(index, transformer, model, scheduler)
    return family, why, index.get("_class_name", "")


def check_components(model: str) -> None:
    """A local pipeline whose processor needs a package this machine lacks (FLUX.2's Pixtral and
    Qwen-Image 2's Qwen3-VL processors need torchvision) is refused here, in one line naming the
    package, before any worker loads it. Only processors are checked: importing them is cheap, and
    tokenizers and models need nothing more than fleetgen's own dependencies."""
    if is_hub_id(model):
        return  # its files are on the hub: the worker's load says the same in one line
    index = json.loads((Path(model).expanduser() / "model_index.json").read_text())
    wanted = {
        name: spec[1]
        for name, spec in index.items()
        if isinstance(spec, list) and spec[0] == "transformers" and str(spec[1]).endswith("Processor")
    }
    if not wanted:
        return
    import transformers

    for name, cls in wanted.items():
        missing = getattr(getattr(transformers, cls, None), "_backends", None)  # transformers' placeholder
        if missing:
            raise ConfigError(
                f"`--model` {model}: its {name} is a {cls}, which transformers builds only with "
                f"{' and '.join(missing)}; install it (the build that matches your torch) where the job runs. "
                'docs/models.md: "Models that need more packages".'
            )


def check_generic(cls: str) -> None:
    """A pipeline outside the family table is called with what its `__call__` takes; one that
    cannot make an image from a prompt alone (video, an input image, a mask) is refused here, in one
    line, rather than failing every shard on the workers."""
    import diffusers

    pipeline = getattr(diffusers, cls, None) if cls else None
    if not isinstance(pipeline, type) or not issubclass(pipeline, diffusers.DiffusionPipeline):
        raise ConfigError(
            f"`{cls or 'no _class_name'}` is not a pipeline of the installed diffusers {diffusers.__version__}: "
            "upgrade diffusers (`pip install -U diffusers`) or check the model's model_index.json."
        )
    params = inspect.signature(pipeline.__call__).parameters
    if "prompt" not in params:
        raise ConfigError(f"{cls} takes no text prompt: fleetgen makes images from prompts.")
    if "num_frames" in params:
        raise ConfigError(f"{cls} makes video (it takes `num_frames`): fleetgen's jobs make images.")
    inputs = [n for n in ("mask_image", "control_image", "strength") if n in params]
    required = [
        n
        for n, p in params.items()
        if n not in ("self", "prompt")
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if inputs or required:
        raise ConfigError(
            f"{cls} needs inputs besides a prompt ({', '.join(f'`{n}`' for n in inputs + required)}): "
            "fleetgen's jobs are text-to-image."
        )


def _check_negatives(config: JobConfig, columns: Columns, family: Family, guidance: float) -> None:
    """A negative-prompt column the pipeline would ignore at these settings is refused, naming what
    would apply it (a job never stores images that silently left out part of their input)."""
    if not columns["negative_prompt"]:
        return
    none = "`--negative-prompt-column none` to generate without them"
    what = f"The input has a `{columns['negative_prompt']}` column, but {family.name} ({family.pipelines[0]})"
    if family.negative == "none":
        raise ConfigError(f"{what} takes no negative prompts. Pass {none}.")
    if family.negative == "true_cfg" and not (config.generation.true_cfg_scale or 0) > 1:
        raise ConfigError(
            f"{what} ignores negative prompts unless `--true-cfg-scale` is above 1 (which doubles its compute). "
            f"Pass e.g. `--true-cfg-scale 4`, or {none}."
        )
    if family.negative == "negative_prompt" and not family.guided(guidance):
        raise ConfigError(
            f"{what} applies negative prompts only with guidance above 1 (a second pass); this job's guidance "
            f"is {guidance:g}. Pass e.g. `--guidance 4`, or {none}."
        )


def _check_inputs(config: JobConfig, columns: Columns, family: Family, task: Task) -> None:
    """The input's image, mask and strength columns against what the task takes: a column the
    pipeline would not use is refused (never silently left out), and so is a task without its inputs."""
    what = f"{family.name} {task.name} ({task.pipeline or 'its pipeline'})"
    others = ", ".join(t.name for t in family.tasks if t.takes_images) or "none"
    if task.takes_images and not columns["image"]:
        raise ConfigError(
            f"{what} makes each image from an input image, and the input has no `{config.columns['image']}` "
            "column: name the column holding images, paths or URLs with `--image-column NAME`."
        )
    if columns["image"] and not task.takes_images:
        raise ConfigError(
            f"The input has an image column `{columns['image']}`, but {what} takes no input image. Pass "
            f"`--task` with one of this family's image tasks ({others}), or `--image-column none` to make "
            "images from the prompts alone."
        )
    if task.mask and not columns["mask"]:
        raise ConfigError(
            f"{what} repaints where a mask is white, and the input has no `{config.columns['mask']}` column: "
            "name the column holding masks with `--mask-column NAME`."
        )
    if columns["mask"] and not task.mask:
        raise ConfigError(
            f"The input has a mask column `{columns['mask']}`, but {what} takes no mask. Pass `--task inpaint` "
            "where the family has it, or `--mask-column none`."
        )
    if task.strength is None and (config.generation.strength is not None or columns["strength"]):
        given = "`--strength`" if config.generation.strength is not None else f"the `{columns['strength']}` column"
        raise ConfigError(
            f"{given}: {what} takes no strength (image-to-image and inpaint tasks do); leave it out"
            + (" or pass `--strength-column none`." if columns["strength"] else ".")
        )


def _check_video(config: JobConfig, columns: Columns, family: Family, task: Task) -> None:
    """Frame settings for a task that makes images are refused (never recorded as if used); a video
    task needs an encoder for its format on this machine (the workers have the same packages)."""
    if not task.video:
        given = [
            f"`--{n.replace('_', '-')}`" for n in ("num_frames", "fps") if getattr(config.generation, n) is not None
        ]
        given += ["`--store-frames`"] if config.generation.store_frames else []
        given += [f"the `{columns[n]}` column" for n in ("num_frames", "fps") if columns[n]]
        if given:
            raise ConfigError(
                f"{' and '.join(given)}: {family.name} {task.name} makes images, not clips; leave "
                f"{'them' if len(given) > 1 else 'it'} out (or pass `--num-frames-column none` / `--fps-column none`)."
            )
        return
    from fleetgen.workers.output.video import VideoUnavailable, encoder

    try:
        encoder(config.generation.video_format)
    except VideoUnavailable as err:
        raise ConfigError(f"{family.name} makes video: {err}.") from None


def _check_cache(config: JobConfig, family: Family, task: Task, values: dict, columns: Columns) -> None:
    """A step cache needs a denoiser with repeated blocks and a pipeline that gives its calls cache
    contexts (workers/pipeline/caching.py), read from the installed diffusers; and steps to skip (MagCache:
    one number of them, the job's)."""
    cache = config.generation.cache
    if cache.method == "none":
        return
    from fleetgen.workers.pipeline.caching import cacheable_families, pipeline_refusal

    why = pipeline_refusal(
        task.pipeline, family.extra_calls(values["guidance"], config.generation.true_cfg_scale), cache.method
    )
    if why:
        raise ConfigError(
            f"`--cache {cache.label}`: {why}. Families whose pipelines take {cache.method}: "
            f"{', '.join(cacheable_families(cache.method))}."
        )
    if cache.computed_share(values["steps"]) == 1.0:
        raise ConfigError(
            f"`--cache {cache.label}` computes every one of the {values['steps']} steps (warm-up {cache.warmup}): "
            "it would change nothing. Lower `warmup=` or leave `--cache` out."
        )
    if cache.method == "magcache" and columns["steps"]:
        raise ConfigError(
            f"`--cache {cache.label}` interpolates the model's magnitude ratios to the job's steps; the input's "
            f"`{columns['steps']}` column gives rows steps of their own. Drop the column or use another cache."
        )


def resolve_defaults(config: JobConfig, columns: Columns) -> tuple[JobConfig, Family, dict]:
    """(the config with the family's defaults filled in, the family, {setting: where its value came from})."""
    g = config.generation
    detected, why, cls = model_family(config.source.model, config.source.revision)
    check_components(config.source.model)
    family, chosen = choose(detected, g.family, cls)
    task, task_why = choose_task(family, g.task, cls)
    if family is GENERIC and task.name == "text-to-image":
        check_generic(cls)
    _check_inputs(config, columns, family, task)
    _check_video(config, columns, family, task)
    given = {"steps": g.steps, "guidance": g.guidance}
    defaults = {"steps": family.steps, "guidance": family.guidance}
    values = {k: v if v is not None else defaults[k] for k, v in given.items()}
    sources = {k: "given" if v is not None else "family default" for k, v in given.items()}
    sources["dtype"] = "given" if config.source.dtype != "auto" else "family default"
    sources["family"] = chosen or why
    sources["task"] = task_why
    if task.strength is not None:
        values["strength"] = g.strength if g.strength is not None else task.strength
        sources["strength"] = "given" if g.strength is not None else "task default"
        if int(values["steps"] * values["strength"]) < 1:
            raise ConfigError(f"`--strength`: {no_steps(values['steps'], values['strength'])}.")
    size = family.sizes[0] if task.video and family.sizes else "512x512"  # a video card's size, else 512
    for name, side in zip(("width", "height"), map(int, size.split("x")), strict=True):
        values[name] = getattr(g, name) or side
        if task.video:
            sources[name] = "given" if getattr(g, name) else "family default"
    if task.video:
        values["num_frames"] = g.num_frames or family.frames
        values["fps"] = g.fps or family.fps
        sources["num_frames"] = "given" if g.num_frames else "family default"
        sources["fps"] = "given" if g.fps else "family default"
        why = family.frames_rule(values["num_frames"])
        if why:
            raise ConfigError(f"`--num-frames`: {why}.")
    if g.true_cfg_scale and family.negative != "true_cfg":
        where = "its guidance (`--guidance`)" if family.guidance_arg == "true_cfg_scale" else "none"
        raise ConfigError(
            f"`--true-cfg-scale` is for FLUX.1 (flux, flux-schnell); {family.name} takes "
            f"{'it as ' + where if where != 'none' else 'none'}."
        )
    if not family.uses_guidance and g.guidance not in (None, family.guidance):
        raise ConfigError(
            f"{family.name} ({family.pipelines[0]}) ignores the guidance ({family.note}); leave `--guidance` out."
        )
    _check_negatives(config, columns, family, values["guidance"])
    _check_cache(config, family, task, values, columns)
    mapping = g.quantize.mapping
    if mapping and not is_hub_id(config.source.model):
        models = list(torch_components(Path(config.source.model).expanduser()))
        check_quantized(mapping, models, config.source.model)
    return config.with_options(family=family.name, task=task.name, **values), family, sources


def describe(config: JobConfig, family: Family, sources: dict) -> str:
    g = config.generation
    dtype = config.source.dtype if config.source.dtype != "auto" else f"{family.dtype} on CUDA, float32 on CPU"
    parts = [
        f"steps {g.steps} ({sources['steps']})",
        f"guidance {g.guidance:g} ({sources['guidance']})",
        f"dtype {dtype} ({sources['dtype']})",
    ]
    if g.true_cfg_scale:
        parts.append(f"true CFG scale {g.true_cfg_scale:g}")
    if g.num_frames:
        parts.insert(0, f"{g.num_frames} frames at {g.fps:g} fps ({sources.get('num_frames')})")
    if g.task and g.task != "text-to-image":
        parts.insert(0, f"task {g.task} ({sources.get('task')})")
        if g.strength is not None:
            parts.insert(1, f"strength {g.strength:g} ({sources.get('strength')})")
    if family.negative_default is not None:
        parts.append(f"negative prompt {family.negative_default!r} where a row has none")
    line = f"model family {family.name} ({', '.join(family.pipelines) or 'any pipeline'}): {', '.join(parts)}"
    why = sources.get("family")
    return f"{line}; why {family.name}: {why}" if why else line


MAX_ADAPTERS = 32  # every worker loads every adapter of the job up front and holds it in memory


def resolve_adapters(config: JobConfig, columns: Columns, column_values: list[str]) -> tuple[tuple[str, str], ...]:
    """Every LoRA the job can apply: `--lora` flags and the distinct values of the `lora` column,
    as (named, where a worker loads it from). Refused here, before any worker starts: a value that
    is neither an existing path nor a hub id, more than MAX_ADAPTERS, a pipeline without LoRA."""
    found = {a.source: a.source for a in config.generation.lora}
    for value in column_values:
        if not value.strip():
            continue  # "" means no adapter for the row
        try:
            found.setdefault(value, parse_lora(value).source)
        except ConfigError as err:
            raise ConfigError(f"Column `{columns['lora']}`: {str(err).removeprefix('`--lora` ')}") from err
    if len(found) > MAX_ADAPTERS:
        raise ConfigError(
            f"The job names more than {MAX_ADAPTERS} LoRA adapters (flags and column `{columns['lora']}`); "
            "every worker loads all of them. Split the job by adapter."
        )
    if found and config.generation.quantize.label != "none":
        raise ConfigError(
            "`--quantize` with LoRA adapters is not supported yet (the adapters would load into quantized "
            "layers); run the LoRA job unquantized."
        )
    if found and not is_hub_id(config.source.model):
        import diffusers

        cls = json.loads((Path(config.source.model).expanduser() / "model_index.json").read_text()).get(
            "_class_name", ""
        )
        if hasattr(diffusers, cls) and not hasattr(getattr(diffusers, cls), "load_lora_weights"):
            raise ConfigError(f"`--lora`: {cls} cannot load LoRA adapters (diffusers has no LoRA loader for it).")
    return tuple(found.items())


@dataclass(frozen=True)
class Resolved:
    """A job's model as the job and the Ray Data stage both resolve it (`resolve_model`)."""

    config: JobConfig  # the revision and scorers pinned, the family's defaults in
    family: Family
    sources: dict  # {setting: where its value came from}
    adapters: tuple[tuple[str, str], ...]
    plan_size: tuple[int, int]  # the largest (width, height) any row asks for: what workers plan for
    pin_note: str | None


def resolve_model(
    config: JobConfig,
    columns: Columns,
    lora_values: Callable[[str], list[str]],
    largest: Callable[[str], int | None],
    revision: str | None = None,
    scorer_commits: dict | None = None,
) -> Resolved:
    """The one resolution of a job's model (the job's driver, jobs/driver.py, and the stage, jobs/stage.py):
    the revision and the scorers pinned (`revision`, `scorer_commits`: an earlier run's, kept), GGUF files
    by their hash, the family's defaults, the adapters (`lora_values(column)`: the LoRA column's distinct
    values, at most MAX_ADAPTERS + 1) and the largest size (`largest(column)`: a size column's largest)."""
    config, pin_note = pin_revision(config, revision)
    score, score_notes = pin_scorers(config.generation.score, scorer_commits or {})
    config = config.with_options(score=score, quantize=config.generation.quantize.pinned())  # GGUF files by their hash
    pin_note = "; ".join(n for n in (pin_note, *score_notes) if n) or None
    config, family, sources = resolve_defaults(config, columns)
    values = lora_values(columns["lora"]) if columns["lora"] else []
    adapters = resolve_adapters(config, columns, values)
    g = config.generation
    plan_size = tuple(
        max(own, (largest(columns[role]) or 0) if columns[role] else 0)
        for own, role in ((g.width, "width"), (g.height, "height"))
    )
    return Resolved(config, family, sources, adapters, plan_size, pin_note)
