"""Where everything lives under the output location `OUT` (docs/outputs.md, "The output layout").

Keys are deterministic from the shard id and the row id, so a retried shard overwrites its own
objects instead of adding new ones.
"""

from __future__ import annotations

import re

from fleetgen.workers.output.fields import manifest_schema

JOB = "job.json"  # resolved config, input fingerprint, versions; written first
SUMMARY = "summary.json"  # counts, failures, per-worker table; written at the end
SUCCESS = "_SUCCESS"  # only when every shard committed
SHARDS = "shards"  # shard manifests: their presence is the shard's commit
WORKERS = "workers"
STAGING = "_attempts"  # each shard attempt's objects until it wins the commit (workers/output/commit.py)
PARTS = "parts"  # a shard's parts: row ranges committed before its manifest (workers/output/parts.py)
LOCK = "_LOCK"  # the running driver's name and heartbeat (jobs/lock.py)
CARD = "README.md"  # the dataset card (jobs/dataset.py), rewritten at the end of every run
COUNTS_INDEX = "counts.parquet"  # per committed shard: its counts, keyed by the manifest's version (jobs/state.py)
WIDS_INDEX = "wids-index.json"  # webdataset output: every shard's URL and sample count, for `wids`
PLANS = "plans"  # per device kind: the plan its first worker measured fastest, reused by the others (workers/pipeline/trials.py)
FLEET = "fleet.json"  # the workers as the driver last saw them, and the latest fleet events (jobs/fleet.py)

IMAGE_FORMATS = {"png": "png", "jpeg": "jpg", "webp": "webp"}  # --image-format -> file extension
VIDEO_EXTENSIONS = {"mp4": "mp4", "webm": "webm"}  # --video-format -> file extension (workers/output/video.py)
EXTENSIONS = {**IMAGE_FORMATS, **VIDEO_EXTENSIONS}

# Ids become object keys: keep them to a portable alphabet, never a path (`../x`, `/abs`).
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def unsafe_id_reason(row_id: str) -> str | None:
    """Why `row_id` cannot be used as part of an object key, or None when it can."""
    if _SAFE_ID.fullmatch(row_id) is None:
        return (
            f"id `{row_id[:80]}` is not safe as an object key: use 1-128 characters of "
            "A-Z a-z 0-9 . _ - starting with a letter or digit"
        )
    return None


def manifest_key(shard_id: str) -> str:
    return f"{SHARDS}/{shard_id}.parquet"


def part_prefix(shard_id: str) -> str:
    return f"{PARTS}/{shard_id}"


def part_key(shard_id: str, first: int) -> str:
    """A part's key: named by its first row (8 digits: listed in row order)."""
    return f"{part_prefix(shard_id)}/{first:08d}.parquet"


def worker_key(worker: str) -> str:
    return f"{WORKERS}/{worker}.json"


def image_prefix(shard_id: str) -> str:
    """Where the `files` format keeps a shard's images, one object each."""
    return f"images/{shard_id}"


def image_key(shard_id: str, row_id: str, image_format: str) -> str:
    return f"{image_prefix(shard_id)}/{row_id}.{EXTENSIONS[image_format]}"


POSTER = "poster.jpg"  # a clip's first frame, stored beside it (`<id>.poster.jpg`, parquet's `poster` column)


def beside(key: str, name: str) -> str:
    """The key of an object stored beside an image: `images/s/<id>.mp4` -> `images/s/<id>.poster.jpg`."""
    return f"{key.rsplit('.', 1)[0]}.{name}"


FRAME = re.compile(r"frame-\d{4,}\.png")  # a clip's frame stored beside it (`--store-frames`)


def frame_name(i: int) -> str:
    """The name a clip's frame `i` (from 0) is stored under beside it: `frame-0000.png`."""
    return f"frame-{i:04d}.png"


def keeps(keys: set[str]):
    """A predicate: the key is one of these image keys, or an object stored beside one of their clips
    (files output: a clip's poster and, with `--store-frames`, its frames)."""
    clips = {k.rsplit(".", 1)[0] for k in keys if k.rsplit(".", 1)[-1] in VIDEO_EXTENSIONS.values()}

    def kept(key: str) -> bool:
        if key in keys:
            return True
        base, _, name = key.rpartition(".")  # <base>.frame-0000.png splits after `frame-0000`
        base, _, stem = base.rpartition(".")
        companion = f"{stem}.{name}"
        return base in clips and (companion == POSTER or bool(FRAME.fullmatch(companion)))

    return kept


def __getattr__(name: str):
    """`MANIFEST_SCHEMA`: one row per image, ok or error (a row of the input gives one image, or
    several with `--images-per-prompt`/`num_images`), followed by the input columns carried
    through; the field table's record columns (workers/output/fields.py), fields from plugins included.
    `RESERVED_COLUMNS`: what the manifest and the image records already use: an input column of
    one of these names can be carried only under another name (or dropped with `--drop-columns`).
    Both are read from the table when first imported, not when this module loads: a plugin's
    fields join the table while its own imports load this module."""
    if name == "MANIFEST_SCHEMA":
        return manifest_schema()
    if name == "RESERVED_COLUMNS":
        return frozenset([*manifest_schema().names, "model", "__key__", "__url__"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
