"""Rows → images → batches: a pure function of a shard's table and the job's settings.

Each input row gives one image, or N (`--images-per-prompt`, or the row's `num_images`), each with
its own settings: the job's, overridden per row by setting columns (`steps`, `guidance`, `width`,
`height`, `lora`, `lora_scale`). Images whose settings match (`Look`) can share a pipeline call, so
a shard's images are grouped by look, in order of first appearance, and each group is cut into
batches. A row that cannot be generated gives error images with the reason, never an exception.

Image ids are the row id, or `<row id>-<k>` when a job makes several images per row (the suffix
after the last `-` is k, so two rows' images never share an id). Seeds: the row's `seed` (+ k),
else a stable hash of (job seed, image id).
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from fleetgen.errors import ConfigError, InputError
from fleetgen.workers.families.entry import frame_count_error
from fleetgen.workers.families.model_dir import HUB_ID
from fleetgen.workers.output.fields import INPUT_ROLES, extra_settings
from fleetgen.workers.output.fields import roles as table_roles
from fleetgen.workers.output.layout import unsafe_id_reason
from fleetgen.workers.rows.inputs import InputRef, refs_of
from fleetgen.workers.rows.seeds import MAX_SEED, derive_seed
from fleetgen.workers.rows.shard import Columns, Shard


@dataclass(frozen=True)
class Adapter:
    source: str  # LoRA path or hub id, as the job or the row named it
    scale: float = 1.0

    @property
    def label(self) -> str:
        """As typed: `PATH_OR_ID[:SCALE]` (job.json's `config` holds it so)."""
        return self.source if self.scale == 1.0 else f"{self.source}:{self.scale:g}"


def parse_lora(value: str | Adapter) -> Adapter:
    """`PATH_OR_ID[:SCALE]`; a local path is made absolute (workers do not share the driver's
    working directory). An `Adapter` is returned as it is."""
    if isinstance(value, Adapter):
        return value
    source, scale = value, 1.0
    head, sep, tail = value.rpartition(":")
    if sep:
        try:
            source, scale = head, float(tail)
        except ValueError:
            pass  # not a scale: part of the path
    if not source:
        raise ConfigError(f"`--lora` must be PATH_OR_ID[:SCALE], got `{value}`.")
    if not math.isfinite(scale):
        raise ConfigError(f"`--lora` `{value}`: the scale must be a finite number.")
    local = Path(source).expanduser()
    if local.exists():
        source = str(local.resolve())
    elif (
        source.startswith(("/", "./", "../", "~"))
        or source.endswith((".safetensors", ".bin"))
        or not HUB_ID.fullmatch(source)
    ):
        raise ConfigError(f"`--lora` `{source}` is neither an existing file or directory nor a hub id like `org/name`.")
    return Adapter(source, scale)


@dataclass(frozen=True)
class Look:
    """What the images of one pipeline call share: the settings that change pixels."""

    width: int
    height: int
    steps: int
    guidance: float
    adapters: tuple[Adapter, ...] = ()
    extra: tuple[tuple[str, object], ...] = ()  # other pixel-changing settings of the field table, as (name, value)

    def record(self) -> dict:
        """The look as an image's record holds it (workers/output/fields.py)."""
        return {
            "width": self.width,
            "height": self.height,
            "steps": self.steps,
            "guidance": self.guidance,
            "lora": [a.source for a in self.adapters],
            "lora_scale": [a.scale for a in self.adapters],
            **dict(self.extra),
        }


@dataclass(frozen=True)
class WorkItem:
    """One image to make (or an error in its place): the work item a shard is cut into. Not a picture:
    what the pipeline makes of it is a `Made` (workers/output/made.py)."""

    id: str  # object key part: the row id, or `<row id>-<k>`
    row_id: str
    index: int  # k: which of its row's images
    row: int  # position of its row in the shard's table (to carry the row's columns)
    prompt: str | None
    negative_prompt: str | None
    seed: int | None
    look: Look
    error: str | None  # why it cannot be generated; None when it can
    inputs: tuple[InputRef, ...] = ()  # its input images (image-to-image, inpaint, edit), the mask last
    candidate: int | None = None  # best-of-N: which of its image's candidates (its id `<image id>~<j>`)

    @property
    def image_id(self) -> str:
        """The image it is made for: its own id, or a candidate's image's."""
        return self.id.split(CANDIDATE, 1)[0]


CANDIDATE = "~"  # best-of-N: a candidate's id is `<image id>~<j>` (`~` is in no image id: never an object key)


@dataclass(frozen=True)
class Recipe:
    """The job-wide settings images start from (part of the job fingerprint)."""

    look: Look
    seed: int = 0  # job seed
    images_per_prompt: int = 1
    template: str | None = None  # e.g. "a {style} photo of a {label}"; None: the prompt column
    size_multiple: int = 8  # what width and height must be a multiple of (the model's VAE scale x patch)
    dotless_ids: bool = False  # webdataset output: readers split `<id>.<ext>` at the first dot
    input_images: int = 0  # the task's input images per image: 0 none (text-to-image), N at most N
    mask: bool = False  # the task takes a mask (inpaint)
    frame_step: int = 0  # video tasks: clips are frame_step x k + 1 frames (Wan: 4); 0: makes images
    candidates: int = 1  # best-of-N: candidates made per image (`<image id>~<j>`), the best stored as the image

    def suffixed(self, columns: Columns) -> bool:
        """Whether image ids carry `-<k>`: in any job that can make several images per row."""
        return self.images_per_prompt > 1 or columns["num_images"] is not None


def template_fields(template: str) -> list[str]:
    """The column names `template` reads; raises ValueError for what str.format would not fill
    from columns (positional `{}` or `{0}`, attribute or index access, bad braces)."""
    names = []
    for _text, name, _spec, _conv in string.Formatter().parse(template):
        if name is None:
            continue
        if not name or name.isdigit() or any(c in name for c in ".["):
            raise ValueError(f"`{{{name}}}` is not a column name")
        names.append(name)
    return list(dict.fromkeys(names))


def _number(value, kind: str, name: str, low: float, high: float) -> tuple[object, str | None]:
    """A per-row setting: (value, None), (None, None) for null, or (None, why it is invalid)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, None
    if isinstance(value, bool) or (kind == "int" and not float(value).is_integer()) or not math.isfinite(value):
        return None, f"{name} `{value}` is not {'an integer' if kind == 'int' else 'a finite number'}"
    value = int(value) if kind == "int" else float(value)
    if not low <= value <= high:
        return None, f"{name} `{value}` is out of range [{low:g}, {high:g}]"
    return value, None


def _look(values: dict, recipe: Recipe, settings: list, extras: list) -> tuple[Look, int, str | None]:
    """The row's look and image count from its setting columns, each checked as the field table
    says (workers/output/fields.py: `settings`, its per-row settings; `extras`, those the look carries as
    they are); the first invalid one is the error."""
    base, errors, got = recipe.look, [], {}
    for f in settings:
        if values.get(f.role) is None or f.kind == "image":  # inputs: `_inputs`
            continue
        if f.kind in ("int", "number"):
            v, err = _number(values[f.role], "int" if f.kind == "int" else "float", f.role, f.low, f.high)
            errors.append(err)
            got[f.role] = v
        else:
            got[f.role] = values[f.role]

    def value(role: str, default):
        return default if got.get(role) is None else got[role]

    steps, guidance = value("steps", base.steps), value("guidance", base.guidance)
    width, height = value("width", base.width), value("height", base.height)
    count, scale = value("num_images", recipe.images_per_prompt), got.get("lora_scale")
    for name, side in (("width", width), ("height", height)):
        if side % recipe.size_multiple:
            errors.append(f"{name} `{side}` is not a multiple of {recipe.size_multiple}, which the model needs")
    adapters = base.adapters
    lora = got.get("lora")
    if lora is not None:  # the row's adapter replaces the job's; "" means none
        adapters = (Adapter(lora, 1.0 if scale is None else scale),) if lora.strip() else ()
    elif scale is not None:
        adapters = tuple(Adapter(a.source, scale) for a in adapters)
    extra = dict(base.extra)  # the job's (e.g. `--strength`), each replaced by the row's where it has one
    extra.update((f.name, got[f.role]) for f in extras if got.get(f.role) is not None)
    strength = extra.get("strength")
    if strength is not None and int(steps * strength) < 1:
        errors.append(no_steps(steps, strength))
    if recipe.frame_step and extra.get("num_frames") is not None:
        errors.append(frame_count_error(extra["num_frames"], recipe.frame_step))
    extra = tuple(extra.items())
    error = next((e for e in errors if e), None)
    return Look(width, height, steps, guidance, adapters, extra), count, error


def _inputs(values: dict, columns: Columns, recipe: Recipe, base: str) -> tuple[tuple[InputRef, ...], str | None]:
    """A row's input images, then its mask, as its columns name them; or why the row cannot be made."""
    if not recipe.input_images:
        return (), None
    found = []
    for role in INPUT_ROLES:
        column = columns[role]
        if role == "mask" and not recipe.mask:
            continue
        refs, why = refs_of(values.get(role), role, base)
        if why:
            return (), f"column `{column}`: {why}"
        what = "input image" if role == "image" else "mask"
        if not refs:
            return (), f"no {what} (column `{column}` is null or empty)"
        most = recipe.input_images if role == "image" else 1
        if len(refs) > most:
            return (), f"{len(refs)} {what}s in column `{column}`; this task takes at most {most}"
        found += refs
    return tuple(found), None


def no_steps(steps: int, strength: float) -> str:
    """Why an image-to-image call would denoise nothing: diffusers runs int(steps × strength) steps."""
    return (
        f"strength {strength:g} at {steps} steps leaves no denoising step (the pipeline runs "
        f"int(steps x strength) of them): raise the steps or the strength"
    )


def _as_seed(value: object) -> tuple[int | None, str | None]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, None  # null seed: derived from the job seed
    if isinstance(value, bool) or not float(value).is_integer():
        return None, f"seed `{value}` is not an integer"
    seed = int(value)
    if not 0 <= seed <= MAX_SEED:
        return None, f"seed `{seed}` is out of range [0, 2**63-1]"
    return seed, None


def _prompt(data: dict, i: int, columns: Columns, recipe: Recipe) -> tuple[str | None, str | None]:
    if recipe.template is None:
        prompt = data[columns["prompt"]][i]
    else:
        values = {f: data[f][i] for f in columns.template_fields}
        missing = [f for f, v in values.items() if v is None]
        if missing:
            return None, f"template column `{missing[0]}` is null"
        prompt = recipe.template.format_map(values)
    if prompt is None or not str(prompt).strip():
        return prompt, "prompt is null or empty"
    return prompt, None


def _row_id(shard: Shard, data: dict, i: int, columns: Columns) -> str:
    if columns["id"]:
        raw = data[columns["id"]][i]
        return "" if raw is None else str(raw)
    return f"{shard.file_index:05d}-{shard.row_group_start + shard.offset + i:09d}"  # position in the input


def _repeated_ids(shard: Shard, data: dict, columns: Columns, examples: int = 3) -> InputError:
    """Ids name a shard's objects (`images/<shard>/<id>.png`, tar members, manifest rows): two rows
    of one shard with one id would overwrite each other, so the shard is refused. Across shards an
    id may repeat: every key is under its shard's name."""
    rows: dict[str, list[int]] = {}
    for i in range(len(data[columns["id"]])):
        rows.setdefault(_row_id(shard, data, i, columns), []).append(shard.row_group_start + shard.offset + i)
    repeats = {k: v for k, v in rows.items() if len(v) > 1}
    shown = "; ".join(f"`{k}` at rows {', '.join(map(str, v[:4]))}" for k, v in list(repeats.items())[:examples])
    return InputError(
        f"Shard {shard.id}: {len(repeats)} id(s) of column `{columns['id']}` repeat within the shard "
        f"({shown}; rows of {shard.path}). Ids name a shard's images, so they must be unique within a "
        "shard (across shards they may repeat). Remove the duplicates, or pass `--id-column` naming a "
        "unique column."
    )


def content_ids(table: pa.Table) -> list[str]:
    """Each row's id made from its values alone (a Ray Data stage's rows with a seed column and no id): the
    first 16 hex digits of the SHA-256 of every column's value, by column name. The same row gets the same
    id on every run, whatever block or batch it lands in; two rows alike get one id (the second an error)."""
    import hashlib
    import json

    def plain(value: object) -> object:
        if isinstance(value, bytes | bytearray):
            return {"sha256": hashlib.sha256(value).hexdigest()}
        return str(value)

    names = sorted(table.column_names)
    columns = [table.column(n).to_pylist() for n in names]
    return [
        hashlib.sha256(
            json.dumps([names, [c[i] for c in columns]], sort_keys=True, default=plain).encode()
        ).hexdigest()[:16]
        for i in range(table.num_rows)
    ]


REPEATED = "^"  # a stage's row whose id repeats an earlier one's: `<id>^<row>` inside (`^` is in no id)


def shard_items(
    shard: Shard, table: pa.Table, columns: Columns, recipe: Recipe, repeats: str = "refuse"
) -> list[WorkItem]:
    """A shard's images, in row order then k; error images where a row cannot be generated. A row whose
    id repeats an earlier one's refuses the shard (`repeats="refuse"`: a job's), or is an error row of
    its own (`"error"`: a Ray Data stage's, whose items then carry `<id>^<row>` as their id)."""
    data = {name: table.column(name).to_pylist() for name in columns.present()}
    roles = columns.roles()
    settings, extras = [f for f in table_roles() if f.setting], extra_settings()  # once per shard, not per row
    suffixed = recipe.suffixed(columns)
    images = []
    first: dict[str, int] = {}  # row id -> its first row
    for i in range(table.num_rows):
        row_id = _row_id(shard, data, i, columns)
        repeated = None
        if first.setdefault(row_id, i) != i:
            if repeats == "refuse":
                raise _repeated_ids(shard, data, columns)
            repeated = (
                f"id `{row_id[:80]}` repeats row {first[row_id]}'s of this batch: each row of a stage needs an id of "
                f"its own (`{columns['id']}`), which names its pictures downstream"
            )
        if repeats != "refuse" and columns["id"] and data[columns["id"]][i] is None:
            repeated = f"id is null: each row of a stage needs an id of its own (`{columns['id']}`)"
        values = {role: data[name][i] for role, name in roles.items()}
        look, count, error = _look(values, recipe, settings, extras)
        seed, seed_error = _as_seed(values.get("seed")) if columns["seed"] else (None, None)
        prompt, prompt_error = _prompt(data, i, columns, recipe)
        negative = values.get("negative_prompt")
        inputs, input_error = _inputs(values, columns, recipe, shard.path)
        if repeated is not None and first[row_id] != i:
            row_id = f"{row_id}{REPEATED}{i}"  # its items' own ids (the row's is restored in its output row)
        row_error = repeated or unsafe_id_reason(row_id) or seed_error or error or prompt_error or input_error
        if row_error is None and recipe.dotless_ids and "." in row_id:
            row_error = f"id `{row_id}` has a `.`: webdataset readers take what follows the first dot as the extension"
        for k in range(count if error is None or count else 1):
            image_id = f"{row_id}-{k}" if suffixed else row_id
            image_error = row_error or (unsafe_id_reason(image_id) if suffixed else None)
            for j in range(recipe.candidates) if recipe.candidates > 1 and image_error is None else (None,):
                # a candidate: its own id (never an object key: the best is stored as its image) and seed
                item_id = image_id if j is None else f"{image_id}{CANDIDATE}{j}"
                n = k if j is None else k * recipe.candidates + j
                image_seed = None
                if image_error is None:
                    image_seed = (seed + n) & MAX_SEED if seed is not None else derive_seed(recipe.seed, item_id)
                images.append(
                    WorkItem(item_id, row_id, k, i, prompt, negative, image_seed, look, image_error, inputs, j)
                )
    return images


def group_items(images: list[WorkItem]) -> list[list[WorkItem]]:
    """Images that can be generated, grouped by look in order of first appearance."""
    groups: dict[Look, list[WorkItem]] = {}
    for image in images:
        if image.error is None:
            groups.setdefault(image.look, []).append(image)
    return list(groups.values())
