"""One table of what an image's record holds and which input columns set it.

Each `Field` is a column of the manifest (one row per image; `record=False` for a per-row role
with no column of its own), and, where an input column can set it per row, that role: the
column's default name (`role`, renamed with `--<role>-column`), what its values must be (`kind`,
`low`..`high`), whether it changes pixels (then images are batched by it and the pipeline is
called with it as `call_arg`; the column mapping is in the job's fingerprint, and the value in
every image's record), and whether the value is in the sidecar record stored beside the image too (`sidecar`: parquet
rows, webdataset JSON). From the table come the manifest schema (workers/output/layout.py), the stored
records (workers/worker.py, workers/output/formats/), the input type checks (jobs/sharding.py), the
per-row validation and the batching key (workers/rows/batches.py), the column options of `JobConfig`
and the CLI.

A new per-row setting (`strength`, `num_frames`, an input image) is one entry here plus its use:
an entry with `call_arg` reaches the pipeline call with no other change.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from fleetgen.scores import ERROR_COLUMN, SCORERS
from fleetgen.workers.output.plugins import PLUGINS_ENV, load_plugins

# What a role's input column holds: text (a string column), string (also an all-null column), int,
# number (int or float), id (a string or an integer column), image (bytes, a `datasets` Image
# struct, a path or URL, or a list of those: workers/rows/inputs.py).
KINDS = ("text", "string", "int", "number", "id", "image")


@dataclass(frozen=True)
class Field:
    name: str  # the manifest column (and the key in records stored beside the image)
    type: pa.DataType
    doc: str = ""
    role: str | None = None  # an input column sets it per row: the role's default column name
    kind: str | None = None  # what that column's values must be (KINDS)
    hint: str = ""  # said after the kind when a column has the wrong type, e.g. "a LoRA path or hub id"
    low: float | None = None  # per-row values outside [low, high] make the row an error
    high: float | None = None
    setting: bool = True  # a per-row role beside the identity ones (False: prompt, id, seed, negative prompt)
    pixels: bool = False  # changes pixels: images are batched by it and it is recorded per image
    call_arg: str | None = None  # the pipeline keyword it is passed as, where the pipeline takes it
    sidecar: bool = False  # also in the sidecar record stored beside each image (parquet rows, webdataset JSON)
    record: bool = True  # a manifest column (False: a per-row role with no column, `num_images`)
    column: str | None = None  # the role's default column name where it is not the role's (`--image-column`)
    clip: bool = False  # a clip's alone (video tasks): null for every image, and no column of an image stage's rows

    @property
    def default_column(self) -> str | None:
        return self.column or self.role


MAX_STEPS = 1000  # schedulers are trained on 1000 timesteps; more is a typo
MAX_SIDE = 8192  # pixels; no released text-to-image model generates larger, so more is a typo
MAX_IMAGES_PER_ROW = 1000
MAX_FRAMES = 2049  # frames of one clip: Wan makes 81, LTX up to 257; far more is a typo
MAX_FPS = 240  # images of one row stay in one shard: a bound on a shard's size
INPUT = pa.struct(
    [
        ("role", pa.string()),
        ("source", pa.string()),
        ("sha256", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("version", pa.string()),  # the object's size and ETag or mtime when read (null: bytes in the column)
    ]
)

FIELDS: list[Field] = [
    Field("id", pa.string(), "the image id: the row id, or `<row id>-<k>` when rows make several images", sidecar=True),
    Field("row_id", pa.string(), "the input row's id", role="id", kind="id", setting=False, sidecar=True),
    Field("image_index", pa.int32(), "k: which of its row's images", sidecar=True),
    Field(
        "prompt",
        pa.string(),
        "as generated (rendered from the template when there is one)",
        role="prompt",
        kind="text",
        setting=False,
        sidecar=True,
    ),
    Field("negative_prompt", pa.string(), "", role="negative_prompt", kind="string", setting=False, sidecar=True),
    Field("seed", pa.int64(), "", role="seed", kind="int", setting=False, sidecar=True),
    Field(
        "status",
        pa.string(),
        '"ok" | "error" | "filtered" (flagged by the pipeline\'s safety checker, or kept out by `--keep`: not stored)',
    ),
    Field("error", pa.string()),
    Field("warning", pa.string(), "e.g. the prompt was truncated to what the text encoder takes"),
    Field("image", pa.string(), "the object holding the image"),
    Field("member", pa.string(), "the image's name inside that object (webdataset tars; null otherwise)"),
    Field("sha256", pa.string(), "", sidecar=True),
    Field("size", pa.int64(), "bytes of the stored image (what `fleetgen verify` checks without --deep)"),
    Field("nsfw", pa.bool_(), "the safety checker's verdict, where the pipeline has one", sidecar=True),
    Field("width", pa.int32(), "pixels", role="width", kind="int", low=1, high=MAX_SIDE, pixels=True, sidecar=True),
    Field("height", pa.int32(), "pixels", role="height", kind="int", low=1, high=MAX_SIDE, pixels=True, sidecar=True),
    Field(
        "steps",
        pa.int32(),
        "denoising steps",
        role="steps",
        kind="int",
        low=1,
        high=MAX_STEPS,
        pixels=True,
        sidecar=True,
    ),
    Field(
        "guidance",
        pa.float32(),
        "guidance scale",
        role="guidance",
        kind="number",
        low=0,
        high=1e4,
        pixels=True,
        sidecar=True,
    ),
    Field(
        "lora",
        pa.list_(pa.string()),
        "the LoRA adapters applied, as the job or the row named them; a row's "
        'column replaces the job\'s ("" for none)',
        role="lora",
        kind="string",
        hint="a LoRA path or hub id",
        pixels=True,
        sidecar=True,
    ),
    Field(
        "lora_scale",
        pa.list_(pa.float32()),
        "their scales, in the same order",
        role="lora_scale",
        kind="number",
        low=-100,
        high=100,
        pixels=True,
        sidecar=True,
    ),
    Field(
        "strength",
        pa.float32(),
        "how far from the input image (0 keeps it, 1 ignores it): the row's, else `--strength`, else the "
        "task's default; null for tasks without one",
        role="strength",
        kind="number",
        low=0,
        high=1,
        pixels=True,
        call_arg="strength",
        sidecar=True,
    ),
    Field(
        "num_frames",
        pa.int32(),
        "frames of the clip (video tasks): the row's, else `--num-frames`, else the family's; null for images",
        role="num_frames",
        kind="int",
        low=1,
        high=MAX_FRAMES,
        pixels=True,
        call_arg="num_frames",
        sidecar=True,
        clip=True,
    ),
    Field(
        "fps",
        pa.float32(),
        "frames per second of the clip as stored (and the model's frame rate where its call takes one): the "
        "row's, else `--fps`, else the family's; null for images",
        role="fps",
        kind="number",
        low=1,
        high=MAX_FPS,
        pixels=True,
        call_arg="frame_rate",
        sidecar=True,
        clip=True,
    ),
    Field("duration", pa.float32(), "seconds of the stored clip (video tasks)", sidecar=True, clip=True),
    Field("codec", pa.string(), "the stored clip's codec, e.g. h264 (video tasks)", sidecar=True, clip=True),
    Field(
        "audio_codec",
        pa.string(),
        "the codec of the clip's sound (aac in mp4, opus in webm) for models that make it (LTX-2); null for silent "
        "clips and images",
        sidecar=True,
        clip=True,
    ),
    Field(
        "sample_rate",
        pa.int32(),
        "Hz of the clip's stored sound (Opus: 48000); null without one",
        sidecar=True,
        clip=True,
    ),
    Field(
        "inputs",
        pa.list_(INPUT),
        "the input images it was made from: role (image, mask), source (the column value's path or URL, or "
        "`bytes` where the column held them), sha256 of the bytes read, and their pixel size",
        sidecar=True,
    ),
    Field("template", pa.string(), "the prompt template the prompt was rendered from (null: none)"),
    Field(
        "quantized",
        pa.string(),
        "the storage formats its components had: `none`, or e.g. `transformer=fp8` (`--quantize`; under "
        "`auto`, what this image's worker chose)",
        sidecar=True,
    ),
    Field(
        "cache",
        pa.string(),
        "the step cache its denoiser ran with: `none`, or e.g. `first-block:0.08` (`--cache`; the same on every image)",
        sidecar=True,
    ),
    Field(
        "attention",
        pa.string(),
        "the attention kernel its denoiser ran (`--attention`): an exact one (`native`, `flash`, ...) may differ "
        "per worker, an inexact one (`sage`) is the job's",
        sidecar=True,
    ),
    Field(
        "cache_skipped",
        pa.float32(),
        "share of the denoiser's block evaluations the step cache skipped in the call that made it (null: no cache)",
        sidecar=True,
    ),
    *(
        Field(s.column, pa.float32(), f"`--score {s.name}`: {s.doc} (null: not scored)", sidecar=True)
        for s in SCORERS.values()
    ),
    Field(
        ERROR_COLUMN, pa.string(), "why a scorer could not score the image (it is stored all the same)", sidecar=True
    ),
    Field(
        "candidate",
        pa.int32(),
        "`--best-of`: which of its image's candidates (`<id>~<j>`; the best is stored under its image's id; "
        "null: no best-of)",
    ),
    Field("batch", pa.int32(), "images in the pipeline call that made this one"),
    Field("worker", pa.string()),
    Field("device", pa.string()),
    Field("seconds", pa.float32(), "this image's share of its batch's wall time"),
    Field(
        "input_image",
        pa.string(),
        "the input image(s) of the row, for image-to-image, inpaint and edit tasks",
        role="image",
        column="input_image",
        kind="image",
        record=False,
    ),
    Field(
        "mask_image",
        pa.string(),
        "the row's inpainting mask (white: repaint, black: keep)",
        role="mask",
        column="mask_image",
        kind="image",
        record=False,
    ),
    Field(
        "num_images",
        pa.int32(),
        "images of the row (overrides --images-per-prompt)",
        role="num_images",
        kind="int",
        low=1,
        high=MAX_IMAGES_PER_ROW,
        record=False,
    ),
]

# The roles the look is built from by hand (workers/rows/batches.py); every other pixel-changing role is
# carried through the look as it is and reaches the pipeline as its `call_arg`.
BUILT_IN = frozenset({"width", "height", "steps", "guidance", "lora", "lora_scale", "num_images"})
INPUT_ROLES = ("image", "mask")  # roles whose columns hold input images (workers/rows/inputs.py)


_frozen = False


def add_field(field: Field) -> Field:
    """A field from elsewhere: a plugin module (`FLEETGEN_PLUGINS`) adds it as the table first
    loads, so that the column option its role adds is one of `JobConfig`'s and the CLI's."""
    if _frozen:
        raise RuntimeError(
            f"field `{field.name}` added after the field table was in use: name its module in "
            f"`{PLUGINS_ENV}` before fleetgen starts"
        )
    if any(f.name == field.name for f in FIELDS):
        raise ValueError(f"a field named `{field.name}` exists")
    FIELDS.insert(len([f for f in FIELDS if f.record]) if field.record else len(FIELDS), field)
    return field


def table() -> list[Field]:
    """Every field, those of plugins included (their modules load at the table's first use, not
    when this module loads: a plugin's own imports may load modules that import this one)."""
    load_plugins()
    return FIELDS


def records() -> list[Field]:
    return [f for f in table() if f.record]


def clip_names() -> tuple[str, ...]:
    """The fields a clip alone has (null for images)."""
    return tuple(f.name for f in table() if f.clip)


def manifest_schema() -> pa.Schema:
    return pa.schema([(f.name, f.type) for f in records()])


def roles() -> list[Field]:
    """Every field an input column can set, identity roles (prompt, id, seed, negative prompt) first."""
    with_role = [f for f in table() if f.role]
    return [f for f in with_role if not f.setting] + [f for f in with_role if f.setting]


def setting_roles() -> tuple[str, ...]:
    return tuple(f.role for f in roles() if f.setting)


def default_column(role: str) -> str:
    """The column a role reads unless `--<role>-column` names another (`image`: `input_image`)."""
    return next(f.default_column for f in roles() if f.role == role)


def extra_settings() -> list[Field]:
    """Pixel-changing per-row settings the look carries as they are (every one not built in)."""
    return [f for f in table() if f.role and f.setting and f.pixels and f.role not in BUILT_IN]


def sidecar_names() -> list[str]:
    return [f.name for f in table() if f.sidecar]


def freeze() -> None:
    """The table is in use (workers/rows/shard.py read its roles, which `JobConfig`'s column settings follow): no more fields."""
    global _frozen
    _frozen = True
