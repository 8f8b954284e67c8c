"""The output as a dataset: its card (`OUT/README.md`), and what its output format writes after a
run (workers/output/formats/: for webdataset, a `wids` index).

Both are rewritten at the end of every run from the committed manifests, so they describe what is
committed, whatever earlier runs did. The card's YAML header lets `datasets.load_dataset(OUT)` find
the data files; its body says what made the images and how to read them.
"""

from __future__ import annotations

import pyarrow as pa

from fleetgen.jobs.config import JobConfig
from fleetgen.jobs.state import shard_counts
from fleetgen.workers.families.detect import Family
from fleetgen.workers.output.formats import get_format
from fleetgen.workers.output.layout import CARD, MANIFEST_SCHEMA
from fleetgen.workers.output.storage import Output
from fleetgen.workers.rows.shard import SETTING_ROLES, Columns


def describe_columns(config: JobConfig, columns: Columns, adapters) -> str:
    """One log line: where prompts come from, which columns set what per row, what is carried."""
    prompt = (
        f"template `{config.generation.prompt_template}`"
        if config.generation.prompt_template
        else f"column `{columns['prompt']}`"
    )
    per_row = [f"{role} ← `{columns[role]}`" for role in SETTING_ROLES if columns[role]]
    parts = [f"prompts from {prompt}", f"{config.generation.images_per_prompt} image(s) per row"]
    parts.append(f"per-row settings: {', '.join(per_row)}" if per_row else "no per-row setting columns")
    parts.append(f"{len(adapters)} LoRA adapter(s)")
    parts.append(f"carried columns: {', '.join(columns.carry)}" if columns.carry else "no columns carried")
    return "; ".join(parts)


def _type(t: pa.DataType) -> str:
    return str(t).replace("large_", "")


def write_card(
    output: Output,
    config: JobConfig,
    family: Family,
    columns: Columns,
    schema: pa.Schema,
    summary,
    counts: dict[str, dict] | None = None,
) -> None:
    """`OUT/README.md`: a dataset card, and the wids index for webdataset output. `counts`: every
    committed shard's counts (jobs.state.shard_counts), when the caller has them."""
    counts = shard_counts(output) if counts is None else counts
    fmt = get_format(config.generation.output_format)
    fmt.finish(output, counts)
    ok = sum(c["ok"] for c in counts.values())
    errors = sum(c["error"] for c in counts.values())
    filtered = sum(c["filtered"] for c in counts.values())
    header = ""
    if fmt.data_files:
        header = (
            f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: {fmt.data_files}\n"
            "---\n\n"
        )
    model = config.source.model + (f" (revision `{config.source.revision}`)" if config.source.revision else "")
    what = "clips" if config.generation.num_frames else "images"  # num_frames: resolved for every video task
    per_row = [f"`{columns[role]}` ({role})" for role in SETTING_ROLES if columns[role]]
    lines = [
        header + f"# {output.url.rstrip('/').rsplit('/', 1)[-1]}",
        "",
        f"{what.capitalize()} generated with fleetgen from `{config.input}` by `{model}`.",
        "",
        f"**{ok} {what}**, {errors} error rows, {filtered} filtered "
        + ("(by the safety checker or `--keep`); " if config.generation.keep else "by the safety checker; ")
        + f"{summary.shards_committed} of {summary.shards_total} shards committed"
        + (" (complete)." if summary.complete else " (incomplete: rerun the job to finish it)."),
        "",
        "## Settings",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| {k} | `{v}` |" for k, v in _settings(config, family, fmt.name).items() if v is not None],
        "",
        f"Per-row settings from columns: {', '.join(per_row) or 'none'}. Each image's own settings are in its record.",
        "",
        *_columns_section(fmt, columns, schema),
        "",
        "## Loading it",
        "",
        *fmt.how_to_load(output.url, sorted(s for s, c in counts.items() if c["ok"])),
        "",
        "```python",
        "import pyarrow.dataset as ds",
        f'manifest = ds.dataset("{output.url}/shards", format="parquet").to_table().to_pandas()  # every image, '
        "ok or error, with its settings and columns",
        "```",
    ]
    output.put(CARD, "\n".join(lines).encode() + b"\n")


def _settings(config: JobConfig, family: Family, output_format: str) -> dict:
    """The card's settings table (None: not shown)."""
    clips = None
    if config.generation.num_frames:
        clips = (
            f"{config.generation.num_frames} frames at {config.generation.fps:g} fps, {config.generation.video_format} (crf {config.generation.crf}), "
            + ("with the model's sound (`audio_codec`, `sample_rate`), " if family.audio else "")
            + "a poster frame (JPEG) beside each"
            + (
                ", and every frame as a PNG (`frame-0000.png` ...; parquet: `frames`)"
                if config.generation.store_frames
                else ""
            )
        )
    return {
        "model family": family.name,
        "steps": config.generation.steps,
        "guidance": config.generation.guidance,
        "size": f"{config.generation.width}x{config.generation.height}",
        "seed": config.generation.seed,
        "images per prompt": config.generation.images_per_prompt,
        "prompt template": config.generation.prompt_template,
        "LoRA": ", ".join(config.generation.lora) or None,
        "true CFG scale": config.generation.true_cfg_scale,
        "variant": config.source.variant,
        "image format": None if config.generation.num_frames else config.generation.image_format,
        "clips": clips,
        "output format": output_format,
        # each scorer's `score_<name>` column, and the rule the stored images passed
        "scores": ", ".join(f"{n} ({m})" for n, m in config.generation.score.scorers) or None,
        "keep": config.generation.keep.text or None,
    }


def _columns_section(fmt, columns: Columns, schema: pa.Schema) -> list[str]:
    """Every column of an image's record: fleetgen's own (the field table), then those carried from the input."""
    carried = [f"| `{f.name}` | {_type(f.type)} | from the input |" for f in schema if f.name in columns.carry]
    own = [f"| `{f.name}` | {_type(f.type)} | fleetgen |" for f in MANIFEST_SCHEMA]
    return [
        "## Columns",
        "",
        "Every image has a record in its shard's manifest (`shards/*.parquet`, one row per image, ok or error)"
        + (f" and beside the image in `data/` ({fmt.name})" if fmt.carries_records else "")
        + ".",
        "",
        "| column | type | |",
        "|---|---|---|",
        *own,
        *carried,
    ]
