"""Which pipeline family a job's model is, and the defaults it resolves to.

Resolved once, on the driver, before anything is written: the family and every default it
resolved are logged and recorded in `job.json`; options given on the command line or in the
config file win.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from fleetgen.errors import ConfigError
from jobs.config import JobConfig
from workers.families import Family, detect, read_family
from workers.shard import Columns


def model_family(model: str) -> Family:
    """The family of a local pipeline directory, or of a hub model from its model_index.json."""
    if Path(model).expanduser().exists():
        return read_family(model)
    try:
        from huggingface_hub import hf_hub_download

        index = json.loads(Path(hf_hub_download(model, "model_index.json")).read_text())
        transformer = None
        if index.get("transformer"):
            transformer = json.loads(Path(hf_hub_download(model, "transformer/config.json")).read_text())
    except Exception as err:  # noqa: BLE001 - any hub failure is the same to the user: say which and why
        raise ConfigError(f"Could not read model_index.json of `--model` `{model}` from the hub: "
                          f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Check the id, "
                          "the network, and HF_TOKEN for gated models, or pass a local pipeline directory.") from err
    return detect(index, transformer)


def resolve_defaults(config: JobConfig, columns: Columns) -> tuple[JobConfig, Family, dict]:
    """(the config with the family's defaults filled in, the family, {setting: where its value came from})."""
    family = model_family(config.model)
    given = {"steps": config.steps, "guidance": config.guidance}
    defaults = {"steps": family.steps, "guidance": family.guidance}
    values = {k: v if v is not None else defaults[k] for k, v in given.items()}
    sources = {k: "given" if v is not None else "family default" for k, v in given.items()}
    sources["dtype"] = "given" if config.dtype != "auto" else "family default"
    if columns.negative_prompt and family.negative == "true_cfg" and not (config.true_cfg_scale or 0) > 1:
        raise ConfigError(
            f"The input has a `{columns.negative_prompt}` column, but {family.name} ({family.pipelines[0]}) ignores "
            "negative prompts unless `--true-cfg-scale` is above 1 (which doubles its compute). Pass e.g. "
            "`--true-cfg-scale 4`, or `--negative-prompt-column none` to generate without them.")
    return replace(config, family=family.name, **values), family, sources


def describe(config: JobConfig, family: Family, sources: dict) -> str:
    dtype = config.dtype if config.dtype != "auto" else f"{family.dtype} on CUDA, float32 on CPU"
    parts = [f"steps {config.steps} ({sources['steps']})", f"guidance {config.guidance:g} ({sources['guidance']})",
             f"dtype {dtype} ({sources['dtype']})"]
    if config.true_cfg_scale:
        parts.append(f"true CFG scale {config.true_cfg_scale:g}")
    return f"model family {family.name} ({', '.join(family.pipelines) or 'any pipeline'}): {', '.join(parts)}"
