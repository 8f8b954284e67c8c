"""The embedded default: a tiny model, a sample prompt set, a local Ray, two CPU workers."""

from __future__ import annotations

import itertools
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fleetgen.jobs.config import JobConfig, validate

STYLES = ("a photo", "a watercolor painting", "a pixel art drawing", "a cinematic portrait")
SUBJECTS = ("red fox", "white owl", "old robot", "small cat", "gold ship", "green dragon tree")
PLACES = ("in the forest", "near the sea", "under the night sky", "in a snow city")


def sample_prompts(n: int = 48) -> list[str]:
    combos = itertools.product(STYLES, SUBJECTS, PLACES)
    return [f"{style} of a {subject} {place}" for style, subject, place in itertools.islice(combos, n)]


def write_prompts(path: Path, n: int = 48, row_group_size: int = 16) -> Path:
    """A prompt Parquet with `id` and `prompt` columns and several row groups."""
    prompts = sample_prompts(n)
    table = pa.table({"id": [f"demo-{i:04d}" for i in range(len(prompts))], "prompt": prompts})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def prepare(directory: str) -> JobConfig:
    """Build the tiny model and the prompt file under `directory` (once), and the job over them."""
    from fleetgen.workers.tiny import write_tiny_model

    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model = root / "tiny-model"
    if not (model / "model_index.json").exists():
        write_tiny_model(model)
    prompts = root / "prompts.parquet"
    if not prompts.exists():
        write_prompts(prompts)
    return validate(
        JobConfig.of(
            input=str(prompts),
            output=str(root / "out"),
            model=str(model),
            steps=8,
            guidance=5.0,
            width=64,
            height=64,
            workers=2,
            max_batch=4,
            rows_per_shard=8,
            device="cpu",
        )
    )
