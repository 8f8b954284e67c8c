"""The output as a dataset: its card (`OUT/README.md`) and, for webdataset output, a `wids` index.

Both are rewritten at the end of every run from the committed manifests, so they describe what is
committed, whatever earlier runs did. The card's YAML header lets `datasets.load_dataset(OUT)` find
the data files; its body says what made the images and how to read them.
"""

from __future__ import annotations

import json

import pyarrow as pa

from jobs.config import JobConfig
from jobs.state import shard_counts
from workers.families import Family
from workers.layout import CARD, MANIFEST_SCHEMA, WIDS_INDEX, data_key
from workers.shard import SETTING_ROLES, Columns
from workers.storage import Output


def describe_columns(config: JobConfig, columns: Columns, adapters) -> str:
    """One log line: where prompts come from, which columns set what per row, what is carried."""
    prompt = f"template `{config.prompt_template}`" if config.prompt_template else f"column `{columns.prompt}`"
    per_row = [f"{role} ← `{getattr(columns, role)}`" for role in SETTING_ROLES if getattr(columns, role)]
    parts = [f"prompts from {prompt}", f"{config.images_per_prompt} image(s) per row"]
    parts.append(f"per-row settings: {', '.join(per_row)}" if per_row else "no per-row setting columns")
    parts.append(f"{len(adapters)} LoRA adapter(s)")
    parts.append(f"carried columns: {', '.join(columns.carry)}" if columns.carry else "no columns carried")
    return "; ".join(parts)


def write_wids_index(output: Output, counts: dict[str, dict[str, int]]) -> None:
    """`OUT/wids-index.json`: every committed webdataset shard with its sample count, in the
    format `wids.ShardListDataset` reads (URLs relative to the index)."""
    shardlist = []
    for shard in sorted(counts):
        key = data_key(shard, "webdataset")
        if counts[shard]["ok"]:
            shardlist.append({"url": key, "nsamples": counts[shard]["ok"], "filesize": output.size(key)})
    index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": output.url.rstrip("/").rsplit("/", 1)[-1],
             "shardlist": shardlist}
    output.put(WIDS_INDEX, json.dumps(index, indent=2).encode())


def _type(t: pa.DataType) -> str:
    return str(t).replace("large_", "")


def write_card(output: Output, config: JobConfig, family: Family, columns: Columns, schema: pa.Schema,
               summary, counts: dict[str, dict] | None = None) -> None:
    """`OUT/README.md`: a dataset card, and the wids index for webdataset output. `counts`: every
    committed shard's counts (jobs.state.shard_counts), when the caller has them."""
    counts = shard_counts(output) if counts is None else counts
    fmt = config.output_format
    if fmt == "webdataset":
        write_wids_index(output, counts)
    ok = sum(c["ok"] for c in counts.values())
    errors = sum(c["error"] for c in counts.values())
    filtered = sum(c["filtered"] for c in counts.values())
    header = ""
    if fmt != "files":
        pattern = "data/*.parquet" if fmt == "parquet" else "data/*.tar"
        header = f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: {pattern}\n---\n\n"
    model = config.model + (f" (revision `{config.revision}`)" if config.revision else "")
    settings = {
        "model family": family.name, "steps": config.steps, "guidance": config.guidance,
        "size": f"{config.width}x{config.height}", "seed": config.seed, "images per prompt": config.images_per_prompt,
        "prompt template": config.prompt_template, "LoRA": ", ".join(config.lora) or None,
        "true CFG scale": config.true_cfg_scale, "variant": config.variant,
        "image format": config.image_format, "output format": fmt,
    }
    per_row = [f"`{getattr(columns, role)}` ({role})" for role in SETTING_ROLES if getattr(columns, role)]
    carried = [f"| `{f.name}` | {_type(f.type)} | from the input |" for f in schema if f.name in columns.carry]
    own = [f"| `{f.name}` | {_type(f.type)} | fleetgen |" for f in MANIFEST_SCHEMA]
    lines = [
        header + f"# {output.url.rstrip('/').rsplit('/', 1)[-1]}",
        "",
        f"Images generated with fleetgen from `{config.input}` by `{model}`.",
        "",
        f"**{ok} images**, {errors} error rows, {filtered} filtered by the safety checker; "
        f"{summary.shards_committed} of {summary.shards_total} shards committed"
        + (" (complete)." if summary.complete else " (incomplete: rerun the job to finish it)."),
        "",
        "## Settings",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| {k} | `{v}` |" for k, v in settings.items() if v is not None],
        "",
        f"Per-row settings from columns: {', '.join(per_row) or 'none'}. Each image's own settings are in its record.",
        "",
        "## Columns",
        "",
        "Every image has a record in its shard's manifest (`shards/*.parquet`, one row per image, ok or error)"
        + ("" if fmt == "files" else f" and beside the image in `data/` ({fmt})") + ".",
        "",
        "| column | type | |",
        "|---|---|---|",
        *own,
        *carried,
        "",
        "## Loading it",
        "",
        *_how_to_load(output.url, fmt, sorted(s for s, c in counts.items() if c["ok"])),
    ]
    output.put(CARD, "\n".join(lines).encode() + b"\n")


def _how_to_load(url: str, fmt: str, shards: list[str]) -> list[str]:
    manifests = ["```python", "import pyarrow.dataset as ds", f'manifest = ds.dataset("{url}/shards", format="parquet")'
                 '.to_table().to_pandas()  # every image, ok or error, with its settings and columns', "```"]
    if fmt == "parquet":
        return ["```python", "import datasets", f'ds = datasets.load_dataset("{url}", split="train")  '
                "# `image` is an Image feature", "```", "", *manifests]
    if fmt == "webdataset":
        first, last = (shards[0], shards[-1]) if shards else ("shard-00000", "shard-00000")
        span = first.removeprefix("shard-") + ".." + last.removeprefix("shard-")
        return ["```python", "import webdataset as wds", f'ds = wds.WebDataset("{url}/data/shard-{{{span}}}.tar")'
                '.decode("pil")  # samples: png/jpg/webp + json (committed shards)', "", "import wids",
                f'ds = wids.ShardListDataset("{url}/wids-index.json")  # random access, sizes from the index', "```",
                "", *(["From an object store, webdataset reads `pipe:` URLs (e.g. `pipe:aws s3 cp URL -`)."]
                      if "://" in url and not url.startswith("file://") else []), "", *manifests]
    return [f"Images are objects under `{url}/images/<shard>/<id>.<ext>`; the manifests name each image's object "
            "(column `image`).", "", *manifests]
