"""Where everything lives under the output location `OUT` (see DESIGN.md, "Output layout").

Keys are deterministic from the shard id and the row id, so a retried shard overwrites its own
objects instead of adding new ones.
"""

from __future__ import annotations

import re

import pyarrow as pa

JOB = "job.json"  # resolved config, input fingerprint, versions; written first
SUMMARY = "summary.json"  # counts, failures, per-worker table; written at the end
SUCCESS = "_SUCCESS"  # only when every shard committed
SHARDS = "shards"  # shard manifests: their presence is the shard's commit
WORKERS = "workers"
LOCK = "_LOCK"  # the running driver's name and heartbeat (jobs/lock.py)
FLEET = "fleet.json"  # the workers as the driver last saw them, and the latest fleet events (jobs/fleet.py)

IMAGE_FORMATS = {"png": "png", "jpeg": "jpg", "webp": "webp"}  # --image-format -> file extension
OUTPUT_FORMATS = ("files", "webdataset", "parquet")

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


def worker_key(worker: str) -> str:
    return f"{WORKERS}/{worker}.json"


def image_key(shard_id: str, row_id: str, image_format: str) -> str:
    return f"images/{shard_id}/{row_id}.{IMAGE_FORMATS[image_format]}"


def data_key(shard_id: str, output_format: str) -> str:
    """The one object per shard for `webdataset` (tar) and `parquet` output."""
    return f"data/{shard_id}.{'tar' if output_format == 'webdataset' else 'parquet'}"


# One row per input row, ok or error. `image` is the object holding the image; `member` the name
# inside it for webdataset tars (null otherwise).
MANIFEST_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("negative_prompt", pa.string()),
        ("seed", pa.int64()),
        ("status", pa.string()),  # "ok" | "error" | "filtered" (flagged by the pipeline's safety checker)
        ("error", pa.string()),
        ("warning", pa.string()),  # e.g. the prompt was truncated to what the text encoder takes
        ("image", pa.string()),
        ("member", pa.string()),
        ("sha256", pa.string()),
        ("nsfw", pa.bool_()),  # the safety checker's verdict, where the pipeline has one
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("steps", pa.int32()),
        ("guidance", pa.float32()),
        ("batch", pa.int32()),  # images in the pipeline call that made this one
        ("worker", pa.string()),
        ("device", pa.string()),
        ("seconds", pa.float32()),  # this image's share of its batch's wall time
    ]
)
