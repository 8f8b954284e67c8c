"""Which pipeline family a job's model is, and the defaults it resolves to.

Resolved once, on the driver, before anything is written: the family and every default it
resolved are logged and recorded in `job.json`; options given on the command line or in the
config file win.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from fleetgen.errors import ConfigError, one_line
from jobs.config import JobConfig, parse_lora
from workers.families import FAMILIES, Family, detect, read_family
from workers.model_dir import is_hub_id
from workers.shard import Columns

# Hub settings that travel from the driver to every worker (as their runtime env), so a worker on
# any node reaches the same hub, with the user's token for gated models.
HUB_ENV = ("HF_ENDPOINT", "HF_TOKEN", "HF_HUB_OFFLINE")


def pin_revision(config: JobConfig, pinned: str | None) -> tuple[JobConfig, str | None]:
    """A hub model's `--revision` (default: the commit this output's job pinned, else main)
    resolved once, here, to a commit; every worker and every resume then loads that commit.
    Returns the config and a note for the log. Errors name the model and what to do."""
    if not is_hub_id(config.model):
        return config, None
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    wanted = config.revision or pinned or "main"
    m = config.model
    try:
        sha = HfApi().model_info(m, revision=wanted).sha
    except GatedRepoError as err:
        raise ConfigError(
            f"`--model` `{m}` is gated on the hub and this token cannot read it: accept its terms on "
            "its page, then set HF_TOKEN (a read token) where you run fleetgen; workers get it from "
            "the driver."
        ) from err
    except RepositoryNotFoundError as err:
        raise ConfigError(
            f"`--model` `{m}` was not found on the hub ({constants.ENDPOINT}). Check the id; a private "
            "repo needs HF_TOKEN."
        ) from err
    except RevisionNotFoundError as err:
        raise ConfigError(f"`--revision` `{wanted}` does not exist in `{m}`.") from err
    except Exception as err:  # noqa: BLE001 - no network, a proxy, a timeout: one clear message
        raise ConfigError(
            f"Could not reach the hub ({constants.ENDPOINT}) to resolve `--model` `{m}`: "
            f"{one_line(err)}. Check the network, "
            "or pass a local pipeline directory."
        ) from err
    note = f"{m} pinned to commit {sha}"
    if pinned and not config.revision:
        note = f"{m}: using commit {sha}, pinned in job.json by the first run of this job"
    return replace(config, revision=sha), note


def model_family(model: str, revision: str | None = None) -> Family:
    """The family of a local pipeline directory, or of a hub model from its model_index.json."""
    if not is_hub_id(model):
        return read_family(model)
    try:
        from huggingface_hub import hf_hub_download

        index = json.loads(Path(hf_hub_download(model, "model_index.json", revision=revision)).read_text())
        transformer = None
        if index.get("_class_name") in FAMILIES["flux"].pipelines:  # dev or schnell: its guidance embedding says
            transformer = json.loads(
                Path(hf_hub_download(model, "transformer/config.json", revision=revision)).read_text()
            )
    except Exception as err:  # noqa: BLE001 - any hub failure is the same to the user: say which and why
        raise ConfigError(
            f"Could not read model_index.json of `--model` `{model}` from the hub: "
            f"{one_line(err)}. Check the id, "
            "the network, and HF_TOKEN for gated models, or pass a local pipeline directory."
        ) from err
    return detect(index, transformer)


def resolve_defaults(config: JobConfig, columns: Columns) -> tuple[JobConfig, Family, dict]:
    """(the config with the family's defaults filled in, the family, {setting: where its value came from})."""
    family = model_family(config.model, config.revision)
    given = {"steps": config.steps, "guidance": config.guidance}
    defaults = {"steps": family.steps, "guidance": family.guidance}
    values = {k: v if v is not None else defaults[k] for k, v in given.items()}
    sources = {k: "given" if v is not None else "family default" for k, v in given.items()}
    sources["dtype"] = "given" if config.dtype != "auto" else "family default"
    if columns.negative_prompt and family.negative == "true_cfg" and not (config.true_cfg_scale or 0) > 1:
        raise ConfigError(
            f"The input has a `{columns.negative_prompt}` column, but {family.name} ({family.pipelines[0]}) ignores "
            "negative prompts unless `--true-cfg-scale` is above 1 (which doubles its compute). Pass e.g. "
            "`--true-cfg-scale 4`, or `--negative-prompt-column none` to generate without them."
        )
    return replace(config, family=family.name, **values), family, sources


def describe(config: JobConfig, family: Family, sources: dict) -> str:
    dtype = config.dtype if config.dtype != "auto" else f"{family.dtype} on CUDA, float32 on CPU"
    parts = [
        f"steps {config.steps} ({sources['steps']})",
        f"guidance {config.guidance:g} ({sources['guidance']})",
        f"dtype {dtype} ({sources['dtype']})",
    ]
    if config.true_cfg_scale:
        parts.append(f"true CFG scale {config.true_cfg_scale:g}")
    return f"model family {family.name} ({', '.join(family.pipelines) or 'any pipeline'}): {', '.join(parts)}"


MAX_ADAPTERS = 32  # every worker loads every adapter of the job up front and holds it in memory


def resolve_adapters(config: JobConfig, columns: Columns, column_values: list[str]) -> tuple[tuple[str, str], ...]:
    """Every LoRA the job can apply: `--lora` flags and the distinct values of the `lora` column,
    as (named, where a worker loads it from). Refused here, before any worker starts: a value that
    is neither an existing path nor a hub id, more than MAX_ADAPTERS, a pipeline without LoRA."""
    found = {a.source: a.source for a in (parse_lora(v) for v in config.lora)}
    for value in column_values:
        if not value.strip():
            continue  # "" means no adapter for the row
        try:
            found.setdefault(value, parse_lora(value).source)
        except ConfigError as err:
            raise ConfigError(f"Column `{columns.lora}`: {str(err).removeprefix('`--lora` ')}") from err
    if len(found) > MAX_ADAPTERS:
        raise ConfigError(
            f"The job names more than {MAX_ADAPTERS} LoRA adapters (flags and column `{columns.lora}`); "
            "every worker loads all of them. Split the job by adapter."
        )
    if found and not is_hub_id(config.model):
        import diffusers

        cls = json.loads((Path(config.model).expanduser() / "model_index.json").read_text()).get("_class_name", "")
        if hasattr(diffusers, cls) and not hasattr(getattr(diffusers, cls), "load_lora_weights"):
            raise ConfigError(f"`--lora`: {cls} cannot load LoRA adapters (diffusers has no LoRA loader for it).")
    return tuple(found.items())
